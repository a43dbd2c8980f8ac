"""``python -m retrysafe``: the same command line as ``retrysafe``."""

from retrysafe.cli import main

main()
