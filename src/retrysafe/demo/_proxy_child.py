"""The demo's chaos proxy in a process of its own: ``python -m retrysafe.demo._proxy_child``.

Started by :func:`retrysafe.demo.run_demo` through :class:`~retrysafe.demo._proxy.ProxyProcess`
(internal: the arguments and the control lines are the runner's). A proxy in the demo's own
process shares one interpreter lock with the client it is measured against: at 100,000 jobs
the proxy's ~0.3 ms of CPU per request then counts against each pass twice over (the client
waits for it), while a proxy of its own runs beside the client on the other core, as a lossy
network would.

Control, one JSON object per line: the first line on stdout is ``{"port": N}`` once the proxy
listens on ``127.0.0.1:N``; then each line on stdin is a command and gets one line back:

* ``{"op": "rates", "rates": {…}}`` (the fields of :class:`~retrysafe.chaos.FaultRates`):
  ``{"ok": true}``, or ``{"error": "…"}`` when the rates are invalid (the old ones stay);
* ``{"op": "heal"}``: every rate to 0, ``{"ok": true}``;
* ``{"op": "stats"}``: ``{"stats": …}`` (:meth:`~retrysafe.chaos.ProxyStats.to_dict`).

The end of stdin (the demo closed it, or exited, even killed outright) stops the proxy and the
process; so does SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m retrysafe.demo._proxy_child")
    parser.add_argument("--upstream", required=True, help="the service's base URL")
    parser.add_argument("--rates", required=True, help="the FaultRates' fields as JSON")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)

    from retrysafe._exceptions import ConfigurationError
    from retrysafe._gc import tune_for_serving
    from retrysafe.chaos import ChaosProxy, FaultRates

    tune_for_serving()
    proxy = ChaosProxy(
        args.upstream, rates=FaultRates(**json.loads(args.rates)), seed=args.seed
    ).start_in_thread()
    try:
        _say({"port": proxy.port})
        for line in sys.stdin:
            command: dict[str, Any] = json.loads(line)
            op = command.get("op")
            if op == "rates":
                try:
                    proxy.set_rates(FaultRates(**command["rates"]))
                except (ConfigurationError, TypeError) as exc:
                    _say({"error": str(exc)})
                    continue
                _say({"ok": True})
            elif op == "heal":
                proxy.heal()
                _say({"ok": True})
            elif op == "stats":
                _say({"stats": proxy.stats().to_dict()})
            else:
                _say({"error": f"unknown command {op!r}"})
    finally:
        proxy.close()


def _say(answer: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
