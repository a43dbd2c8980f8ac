"""Merge ``retrysafe proof`` runs of single scenarios into one published result.

A 100,000-operation matrix takes hours; run one ``retrysafe proof --scenarios NAME`` per
scenario (so that each finished scenario is kept whole, whatever happens to the next), then
merge their ``proof.json`` files into one ``proof.json``, ``proof.md`` and chart with the
renderers of ``retrysafe proof`` itself:

    python benchmarks/proof_merge.py --out docs/proof/sqlite-100k \\
        runs/loss-2.5/proof.json runs/loss-10/proof.json …

The runs must agree on the store, operations, seed, concurrency, timeout and attempts (else
the merge is refused: the table would compare unlike runs). Scenarios come out in matrix
order; a scenario given twice is refused, except that one cut short (``partial``, from an
interrupted matrix) gives way to a whole run of it. The merged document is ``partial`` when a
scenario it keeps is, ``ok`` only when every scenario it keeps is, and ``seconds`` is the sum
of the runs' run times.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from retrysafe.proof import ProofOptions, scenario_names, write_outputs

DEFAULT_SEED, DEFAULT_CONCURRENCY = ProofOptions().seed, ProofOptions().concurrency

#: What every merged run must share (the table compares like with like).
SAME = ("version", "store", "jobs", "seed", "concurrency", "timeout", "attempts")


def merge(docs: list[dict[str, Any]], command: str) -> dict[str, Any]:
    """One proof document from per-scenario ones (see the module docstring).

    Raises:
        SystemExit: no documents, runs that differ in a :data:`SAME` field, a scenario twice.
    """
    if not docs:
        raise SystemExit("proof_merge: no proof.json given")
    first = docs[0]
    for doc in docs[1:]:
        for name in SAME:
            if doc.get(name) != first.get(name):
                raise SystemExit(
                    f"proof_merge: the runs differ in {name!r}: "
                    f"{first.get(name)!r} and {doc.get(name)!r}"
                )
    order = {name: i for i, name in enumerate(scenario_names())}
    scenarios = [s for doc in docs for s in doc["scenarios"]]
    whole = {s["name"] for s in scenarios if not s.get("partial")}
    # A scenario cut short in one run (an interrupted matrix) gives way to a whole run of it.
    scenarios = [s for s in scenarios if not (s.get("partial") and s["name"] in whole)]
    names = [s["name"] for s in scenarios]
    if len(set(names)) != len(names):
        raise SystemExit(f"proof_merge: a scenario appears twice: {sorted(names)}")
    scenarios.sort(key=lambda s: order.get(s["name"], len(order)))
    merged = {name: first.get(name) for name in SAME}
    merged.update(
        {
            "partial": any(s.get("partial") for s in scenarios),
            "ok": all(s.get("ok") is True for s in scenarios),
            "command": command,
            "started_at": min(d["started_at"] for d in docs),
            "finished_at": max(d["finished_at"] for d in docs),
            "seconds": round(sum(float(d["seconds"]) for d in docs), 1),
            "environment": first.get("environment"),
            "failures": [f for d in docs for f in d.get("failures", [])],
            "scenarios": scenarios,
        }
    )
    # The document's own key order (version first, scenarios last).
    return {key: merged[key] for key in first if key in merged} | merged


def _command(doc: dict[str, Any], out: Path) -> str:
    """The shell command that regenerates the merged document ``doc``: one run per scenario
    with the runs' settings, then this merge. A PostgreSQL URL is written as
    ``postgresql://…`` (the runs' documents keep no credentials to repeat)."""
    names = " ".join(s["name"] for s in doc["scenarios"])
    store = "sqlite" if doc.get("store") == "sqlite" else "postgresql://…"
    settings = f"--jobs {doc.get('jobs')} --store {store}"
    if doc.get("seed") != DEFAULT_SEED:
        settings += f" --seed {doc.get('seed')}"
    if doc.get("concurrency") != DEFAULT_CONCURRENCY:
        settings += f" --concurrency {doc.get('concurrency')}"
    return (
        f"for s in {names}; do retrysafe proof {settings} --scenarios $s --out runs/$s; done;"
        f" python benchmarks/proof_merge.py --out {out} runs/*/proof.json"
    )


def _load(path: Path) -> dict[str, Any]:
    """One run's ``proof.json``; a one-line refusal when it cannot be one."""
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise SystemExit(f"proof_merge: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise SystemExit(f"proof_merge: {str(path)!r} is not JSON: {exc}") from None
    scenarios = doc.get("scenarios") if isinstance(doc, dict) else None
    if not isinstance(scenarios, list) or not all(
        isinstance(s, dict) and isinstance(s.get("name"), str) for s in scenarios
    ):
        raise SystemExit(f"proof_merge: {str(path)!r} is not a retrysafe proof.json")
    for name in ("started_at", "finished_at", "seconds"):
        if name not in doc:
            raise SystemExit(f"proof_merge: {str(path)!r} has no {name!r}")
    found: dict[str, Any] = doc
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="proof.json files, one per run")
    parser.add_argument(
        "--out", type=Path, required=True, help="directory to write into (created if absent)"
    )
    parser.add_argument(
        "--force", action="store_true", help="write into --out even if it holds files"
    )
    parser.add_argument(
        "--command",
        default=None,
        help="the command the table says regenerates it (default: one retrysafe proof run"
        " per scenario with the runs' settings, then this merge)",
    )
    parser.add_argument(
        "--chart", choices=("svg", "png", "none"), default="svg", help="chart format"
    )
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.exit(2, f"proof_merge: --out {str(args.out)!r} is not a directory\n")
    if args.out.is_dir() and any(args.out.iterdir()) and not args.force:
        parser.exit(2, f"proof_merge: --out {str(args.out)!r} holds files (--force to write)\n")
    try:
        docs = [_load(path) for path in args.runs]
        doc = merge(docs, "")
    except SystemExit as exc:
        parser.exit(2, f"{exc}\n")
    doc["command"] = args.command if args.command is not None else _command(doc, args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    written = write_outputs(doc, args.out, chart=None if args.chart == "none" else args.chart)
    for path in written.files:
        print(f"wrote {path}")
    if written.chart_missing:
        print(written.chart_missing, file=sys.stderr)
    return 0 if doc["ok"] and not doc["partial"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
