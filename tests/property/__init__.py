"""Property-based and model-based tests (hypothesis): the pure rules fuzzed, the stores checked
against plain-Python models of their contracts. Example counts come from the hypothesis
profile (``ci`` by default, ``--hypothesis-profile=long`` for deeper runs; docs/testing.md)."""
