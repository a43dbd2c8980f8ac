"""The outputs of ``retrysafe proof``: ``proof.json``, ``proof.md`` and a chart (issue 16).

The run hands one plain, JSON-serialisable document here. :func:`render_markdown` and
:func:`render_chart` draw it (the chart needs the ``proof`` extra, matplotlib) and
:func:`write_outputs` writes all three files into a directory, each one atomically.

The document, as written to ``proof.json``::

    {"version": 1,
     "partial": bool,          # stopped early (Ctrl-C): scenarios missing or cut short
     "ok": bool,               # every protected row: 0 duplicated, 0 lost, UNKNOWN recovered
     "store": "sqlite" | "postgresql",
     "jobs": int,              # operations per scenario and client
     "seed": int, "concurrency": int,
     "command": str,           # the command line that regenerates the run
     "started_at": str, "finished_at": str,   # ISO 8601, UTC
     "seconds": float,         # the whole run
     "environment": {"python": str, "platform": str, "cpus": int, "retrysafe": str},
     "scenarios": [
         {"name": str,         # the id --scenarios takes, e.g. "loss-10"
          "title": str, "description": str,
          "mode": "plain" | "transactional",
          "ok": bool, "failures": [str],   # phrases about the protected row
          "partial": bool,
          "rows": {"naive": ROW | None, "retrysafe": ROW | None}}]}

    ROW = {"operations": int, "attempted": int,   # attempted: HTTP requests the proxy saw
           "acknowledged": int,                    # the client believes SUCCEEDED (a 2xx)
           "effects": int,
           "duplicated": int,                      # effects beyond the first, per operation
           "duplicated_operations": int, "lost": int,
           "unknown": int,                         # ended UNKNOWN before reconciliation
           "recovered": int,                       # UNKNOWN later reconciled with the same key
           "still_unknown": int, "rejected": int, "failed": int,
           "p50_seconds": float | None, "p95_seconds": float | None,
           "wall_seconds": float, "ops_per_second": float,
           "faults": {name: count},                # what the proxy and the run injected
           "max_attempts": int | None, "deferred": int | None}

The counts mean what they mean in the chaos report (:mod:`retrysafe.chaos._report`,
docs/chaos.md). The ``retrysafe`` row is the protected one: a scenario holds when that row has
0 duplicated, 0 lost and every UNKNOWN recovered.

A partial document may lack any field, or hold None: both renderings show such a value as
"–", and neither fails on a missing, extra or ill-typed key.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from retrysafe._exceptions import ConfigurationError

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "CHART_HINT",
    "MissingExtraError",
    "Written",
    "render_chart",
    "render_markdown",
    "write_outputs",
]

#: What to do when the chart cannot be drawn: the message of :class:`MissingExtraError`.
CHART_HINT = "the chart needs matplotlib: pip install 'retrysafe[proof]'"

_DASH = "–"
_NAIVE = "naive"
_PROTECTED = "retrysafe"
_CLIENTS = (_NAIVE, _PROTECTED)
_STORES = {"sqlite": "SQLite", "postgresql": "PostgreSQL"}
_COLUMNS = (
    "scenario", "client", "operations", "attempted", "acknowledged", "effects", "duplicated",
    "lost", "unknown", "recovered", "failed", "p50", "p95", "wall", "ops/s",
)  # fmt: skip
_LEGEND = (
    "*attempted*: HTTP requests sent; *acknowledged*: operations the client believes"
    " succeeded; *duplicated*: effects beyond the first per operation; *lost*: believed"
    " succeeded without an effect, or never finished; *unknown*: jobs that ended UNKNOWN;"
    " *recovered*: UNKNOWN jobs reconciled with their same key; *failed*: operations the"
    " naive client gave up on; p50/p95: seconds from creation (all at the start) to the end."
    " Every column is defined in retrysafe's docs/proof.md, \"What is counted\"."
)
# The protected row's cells that must be zero (or match ``unknown``); otherwise in bold.
_MUST_BE_ZERO = ("duplicated", "lost")
_COLORS = {_NAIVE: "#c8553d", _PROTECTED: "#2f6690"}
# Fixed salt for the SVG's element ids: the same document gives the same bytes.
_SVG_SALT = "retrysafe-proof"


class MissingExtraError(ConfigurationError):
    """An output needs an optional dependency that is not installed.

    Raised by :func:`render_chart` when matplotlib cannot be imported; the message says how
    to install it (:data:`CHART_HINT`).

    Attributes:
        option: ``"chart"``, the output that cannot be made.
        extra: the extra that brings the dependency, e.g. ``"proof"``.
    """

    def __init__(
        self, message: str = CHART_HINT, *, option: str = "chart", extra: str = "proof"
    ) -> None:
        super().__init__(message, option=option)
        self.extra = extra


@dataclass(frozen=True, slots=True, kw_only=True)
class Written:
    """What :func:`write_outputs` wrote.

    A missing chart is reported here rather than raised: ``proof.json`` and ``proof.md`` hold
    the results of a run that may have taken an hour, and an absent optional extra must not
    cost them. The caller prints :attr:`chart_missing` and exits by the document's verdict.

    Attributes:
        files: the files written, in order: ``proof.json``, ``proof.md``, then the chart when
            one was drawn.
        chart_missing: None, or the hint to show (:data:`CHART_HINT`) when a chart was asked
            for and matplotlib is not installed.
    """

    files: list[Path]
    chart_missing: str | None = None


# --- Markdown ---------------------------------------------------------------------------------


def render_markdown(doc: Mapping[str, Any], *, heading_level: int = 2) -> str:
    """The proof as a Markdown section ready for the docs.

    In order: a heading with the store, the operations per scenario, the seed and the
    concurrency (and ``PARTIAL`` when the run stopped early); the command that regenerates the
    run, in a code span, and the environment; one table with a line per scenario and client;
    the verdict on the protected rows (or which scenarios failed and why); the faults injected
    per scenario.

    Counts carry thousands separators (``100,000``), times are seconds (``1.23 s``), throughput
    is whole operations per second. Missing and None values show as "–"; the protected row's
    duplicated and lost counts are in bold when not zero, and so is its recovered count when
    it falls short of its unknown count. ``|`` in text cells is escaped.

    Args:
        doc: the proof document (module docstring); extra keys are ignored.
        heading_level: 1–6, the number of ``#`` of the heading.

    Returns:
        The Markdown text, ending in a newline.

    Raises:
        ValueError: ``heading_level`` is not between 1 and 6.
    """
    if not 1 <= heading_level <= 6:
        raise ValueError(f"heading_level must be between 1 and 6, got {heading_level}")
    scenarios = _scenarios(doc)
    partial = doc.get("partial") is True
    parts = [
        f"{'#' * heading_level} {_heading(doc)}" + (" — PARTIAL" if partial else ""),
    ]
    if partial:
        parts.append(
            "> **PARTIAL**: the run was stopped before it finished. Scenarios are missing or"
            " cut short, and the verdict covers only what ran."
        )
    parts.extend(_preamble(doc))
    parts.append(_table(scenarios))
    parts.append(_LEGEND)
    parts.append(_verdict(doc, scenarios))
    parts.append(_faults(scenarios))
    return "\n\n".join(parts) + "\n"


def _heading(doc: Mapping[str, Any]) -> str:
    return (
        f"Proof on {_store(doc)}: {_count(doc.get('jobs'))} operations per scenario and client,"
        f" seed {_count(doc.get('seed'))}, concurrency {_count(doc.get('concurrency'))}"
    )


def _preamble(doc: Mapping[str, Any]) -> list[str]:
    lines = []
    command = doc.get("command")
    if isinstance(command, str) and command.strip():
        lines.append(f"Regenerate with {_code(command)}.")
    env = _mapping(doc.get("environment"))
    facts = []
    if env.get("retrysafe") is not None:
        facts.append(f"retrysafe {_inline(env['retrysafe'])}")
    if env.get("python") is not None:
        facts.append(f"Python {_inline(env['python'])}")
    if env.get("platform") is not None:
        facts.append(_inline(env["platform"]))
    if env.get("cpus") is not None:
        facts.append(f"{_count(env['cpus'])} CPUs")
    if doc.get("started_at") is not None:
        facts.append(f"started {_inline(doc['started_at'])}")
    if doc.get("seconds") is not None:
        facts.append(f"run time {_seconds(doc['seconds'])}")
    if facts:
        lines.append(", ".join(facts) + ".")
    return lines


def _table(scenarios: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(_COLUMNS) + " |",
        "|" + "|".join([":---", ":---"] + ["---:"] * (len(_COLUMNS) - 2)) + "|",
    ]
    for scenario in scenarios:
        first = True
        for client, row in _rows(scenario):
            label = _scenario_label(scenario) if first else ""
            first = False
            lines.append("| " + " | ".join(_table_cells(label, client, row)) + " |")
    return "\n".join(lines)


def _scenario_label(scenario: Mapping[str, Any]) -> str:
    name, title = scenario.get("name"), scenario.get("title")
    if isinstance(title, str) and title.strip():
        label = _inline(title)
        if isinstance(name, str) and name.strip():
            label += f" ({_code(name)})"
    elif isinstance(name, str) and name.strip():
        label = _code(name)
    else:
        label = _DASH
    if scenario.get("partial") is True:
        label += " — cut short"
    return label


def _table_cells(label: str, client: str, row: Mapping[str, Any] | None) -> list[str]:
    values = _mapping(row)
    cells = {name: _count(values.get(name)) for name in _COLUMNS[2:11]}
    if client == _PROTECTED:
        for name in _MUST_BE_ZERO:
            if _positive(values.get(name)):
                cells[name] = f"**{cells[name]}**"
        unknown, recovered = _number(values.get("unknown")), _number(values.get("recovered"))
        if unknown is not None and recovered is not None and recovered < unknown:
            cells["recovered"] = f"**{cells['recovered']}**"
    texts = [
        label,
        _inline(client),
        *cells.values(),
        _seconds(values.get("p50_seconds")),
        _seconds(values.get("p95_seconds")),
        _seconds(values.get("wall_seconds")),
        _rate(values.get("ops_per_second")),
    ]
    return [_cell(text) for text in texts]


def _verdict(doc: Mapping[str, Any], scenarios: Sequence[Mapping[str, Any]]) -> str:
    failed: list[str] = []
    unmeasured: list[str] = []
    unproven: list[str] = []
    for index, scenario in enumerate(scenarios):
        name = _code(_name(scenario, index))
        problems = _problems(scenario)
        doubts = _phrases(scenario.get("inconclusive"))
        if problems:
            failed.append(f"{name}: {', '.join(problems)}")
        elif scenario.get("partial") is True or not isinstance(
            _mapping(scenario.get("rows")).get(_PROTECTED), Mapping
        ):
            unmeasured.append(name)
        elif doubts:
            unproven.append(f"{name}: {', '.join(doubts)}")
    if failed:
        verdict = (
            f"**Verdict: FAILED.** The protected client broke the guarantee in {len(failed)} of"
            f" {_counted(len(scenarios), 'scenario')}: " + "; ".join(failed) + "."
        )
    elif unproven:
        verdict = (
            "**Verdict: not proven.** Nothing broke, but a scenario's fault never came, so it"
            " proves nothing: " + "; ".join(unproven) + "."
        )
    elif doc.get("ok") is False and doc.get("partial") is not True:
        # A partial run is never ok; that alone is no failure of the rows that ran.
        verdict = (
            "**Verdict: FAILED.** The run reports a failure (`ok` is false) that no scenario's"
            " protected row shows."
        )
    else:
        measured = len(scenarios) - len(unmeasured)
        holds = (
            "the protected (retrysafe) row has 0 duplicated effects, 0 lost operations and"
            " every UNKNOWN recovered"
        )
        if not scenarios or not measured:
            verdict = "**Verdict: none.** No protected row was measured."
        elif unmeasured or doc.get("partial") is True:
            verdict = (
                f"**Verdict: {'PARTIAL' if doc.get('partial') is True else 'incomplete'}.**"
                f" In the {_counted(measured, 'scenario')} measured, {holds}"
            )
            if unmeasured:
                verdict += "; not measured: " + ", ".join(unmeasured)
            verdict += "."
        else:
            every = "the one scenario" if measured == 1 else f"each of the {measured} scenarios"
            verdict = f"**Verdict: passed.** In {every} {holds}."
    return verdict + _naive_contrast(scenarios)


def _problems(scenario: Mapping[str, Any]) -> list[str]:
    """Why a scenario failed: the run's own phrases, else what its protected row shows. A
    scenario cut short by a stop is not measured, so it has none."""
    if scenario.get("partial") is True:
        return []
    failures = scenario.get("failures")
    if isinstance(failures, Sequence) and not isinstance(failures, (str, bytes)):
        phrases = [_inline(phrase) for phrase in failures if phrase]
        if phrases:
            return phrases
    row = _mapping(_mapping(scenario.get("rows")).get(_PROTECTED))
    shown = []
    for name, what in (("duplicated", "duplicated effect"), ("lost", "lost operation")):
        if _positive(row.get(name)):
            shown.append(_counted(row[name], what))
    still = _number(row.get("still_unknown"))
    if still is None:
        unknown, recovered = _number(row.get("unknown")), _number(row.get("recovered"))
        if unknown is not None and recovered is not None:
            still = unknown - recovered
    if still is not None and still > 0:
        shown.append(f"{_count(still)} UNKNOWN not recovered")
    if not shown and scenario.get("ok") is False and not _phrases(scenario.get("inconclusive")):
        shown.append("reported not ok")
    return shown


def _phrases(value: object) -> list[str]:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_inline(v) for v in value if v]
    return []


def _naive_contrast(scenarios: Sequence[Mapping[str, Any]]) -> str:
    duplicated = lost = 0.0
    seen = False
    for scenario in scenarios:
        row = _mapping(scenario).get("rows")
        naive = _mapping(_mapping(row).get(_NAIVE))
        for name in ("duplicated", "lost"):
            value = _number(naive.get(name))
            if value is not None:
                seen = True
                if name == "duplicated":
                    duplicated += value
                else:
                    lost += value
    if not seen:
        return ""
    return (
        " On the same jobs, with the same seeded faults, the naive client made"
        f" {_counted(duplicated, 'duplicated effect')} and lost {_counted(lost, 'operation')}."
    )


def _faults(scenarios: Sequence[Mapping[str, Any]]) -> str:
    lines = ["**Faults injected**, per scenario and client:", ""]
    for index, scenario in enumerate(scenarios):
        head = _code(_name(scenario, index))
        mode = scenario.get("mode")
        if isinstance(mode, str) and mode:
            head += f" ({_inline(mode)})"
        description = scenario.get("description")
        if isinstance(description, str) and description.strip():
            head += f" — {_inline(description).rstrip('.')}."
        rows = _rows(scenario)
        counts = [(client, _fault_list(row)) for client, row in rows]
        present = [(client, text) for client, text in counts if text]
        if not present:
            injected = "none recorded"
        elif len(present) == len(counts) and len({text for _, text in present}) == 1:
            injected = f"{present[0][1]} (each client)"
        else:
            injected = "; ".join(f"{_inline(client)}: {text}" for client, text in present)
        lines.append(f"- {head} Injected: {injected}.")
    if not scenarios:
        lines.append("- no scenario ran.")
    return "\n".join(lines)


def _fault_list(row: Mapping[str, Any] | None) -> str:
    faults = _mapping(_mapping(row).get("faults"))
    return ", ".join(
        f"{_inline(str(name)).replace('_', ' ')} {_count(count)}" for name, count in faults.items()
    )


# --- Chart ------------------------------------------------------------------------------------


def render_chart(doc: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Draw the proof's chart and write it to ``path``, atomically.

    Two panels side by side, one group of bars per scenario, naive beside retrysafe:
    duplicated effects (a symmetric-log axis, every bar labelled with its value so a protected
    0 reads as "0") and throughput in operations per second. The title names the store and
    the operations per scenario, and says ``PARTIAL`` when the run stopped early. A value the
    document lacks draws no bar and is labelled "–".

    The SVG is reproducible: fixed element ids (``svg.hashsalt``), text kept as text
    (``svg.fonttype="none"``) and no date, so one document always gives the same bytes with
    the same matplotlib. Only ``matplotlib.figure.Figure`` is used (no pyplot); rcParams are
    changed only inside an ``rc_context``.

    Args:
        doc: the proof document (module docstring).
        path: the file to write; its suffix chooses the format, ``.svg`` or ``.png``.

    Raises:
        ConfigurationError (``option="chart"``): the suffix is neither ``.svg`` nor ``.png``.
        MissingExtraError (``option="chart"``): matplotlib is not installed; nothing is written.
        OSError: the file cannot be written (its directory must exist).
    """
    target = Path(path)
    fmt = target.suffix.lower().lstrip(".")
    if fmt not in ("svg", "png"):
        raise ConfigurationError(
            f"the chart is written as .svg or .png, not {str(target)!r}", option="chart"
        )
    _write_atomic(target, _chart_bytes(doc, fmt))


def _chart_bytes(doc: Mapping[str, Any], fmt: str) -> bytes:
    try:
        # The package first: with ``matplotlib`` absent (or blocked) this fails even when a
        # submodule was imported earlier.
        import matplotlib
        from matplotlib.figure import Figure
        from matplotlib.ticker import StrMethodFormatter
    except ImportError as exc:
        raise MissingExtraError from exc

    scenarios = _scenarios(doc)
    names = [_name(scenario, index) for index, scenario in enumerate(scenarios)]
    duplicated = {client: _series(scenarios, client, "duplicated") for client in _CLIENTS}
    throughput = {client: _series(scenarios, client, "ops_per_second") for client in _CLIENTS}

    title = f"retrysafe proof on {_store(doc)}: {_count(doc.get('jobs'))} operations per scenario"
    if doc.get("partial") is True:
        title += " — PARTIAL"

    with matplotlib.rc_context(
        {"svg.hashsalt": _SVG_SALT, "svg.fonttype": "none", "font.size": 9.0}
    ):
        figure = Figure(figsize=(max(10.0, 2.0 + 1.8 * len(names)), 4.8), layout="constrained")
        figure.suptitle(title, fontsize=12)
        left = figure.add_subplot(1, 2, 1)
        right = figure.add_subplot(1, 2, 2)
        _bars(left, names, duplicated, label=_count)
        left.set_yscale("symlog", linthresh=1.0)
        top = max((v for vs in duplicated.values() for v in vs if v is not None), default=0.0)
        left.set_ylim(0.0, max(10.0, top * 6.0))
        left.set_title("duplicated effects (lower is better; symlog)")
        left.legend(loc="upper right")
        _bars(right, names, throughput, label=_rate)
        top = max((v for vs in throughput.values() for v in vs if v is not None), default=0.0)
        right.set_ylim(0.0, max(1.0, top * 1.15))
        right.set_title("throughput, operations per second")
        for axes in (left, right):
            axes.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
            axes.spines[["top", "right"]].set_visible(False)
            if not names:
                axes.text(0.5, 0.5, "no scenario ran", ha="center", transform=axes.transAxes)
        buffer = io.BytesIO()
        metadata: dict[str, str | None] = {"Date": None} if fmt == "svg" else {}
        figure.savefig(buffer, format=fmt, dpi=150, metadata=metadata)
    return buffer.getvalue()


def _series(scenarios: Sequence[Mapping[str, Any]], client: str, field: str) -> list[float | None]:
    return [
        _number(_mapping(_mapping(scenario.get("rows")).get(client)).get(field))
        for scenario in scenarios
    ]


def _bars(
    axes: Axes,
    names: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    *,
    label: Callable[[object], str],
) -> None:
    width = 0.8 / len(series)
    for offset, (client, values) in enumerate(series.items()):
        positions = [i + (offset - (len(series) - 1) / 2) * width for i in range(len(names))]
        bars = axes.bar(
            positions,
            [value or 0.0 for value in values],
            width,
            label=client,
            color=_COLORS.get(client),
        )
        axes.bar_label(bars, labels=[label(value) for value in values], padding=2, fontsize=8)
    many = len(names) > 4
    axes.set_xticks(
        list(range(len(names))), names, rotation=30 if many else 0, ha="right" if many else "center"
    )


# --- Files ------------------------------------------------------------------------------------


def write_outputs(
    doc: Mapping[str, Any],
    out_dir: str | os.PathLike[str],
    *,
    chart: Literal["svg", "png"] | None = "svg",
) -> Written:
    """Write ``proof.json``, ``proof.md`` and the chart (``proof.svg`` or ``proof.png``).

    Each file is written to a temporary file in ``out_dir`` and moved over its name with
    :func:`os.replace`, so a reader sees the old file or the new one, never half of one, and
    an interruption leaves no temporary file. ``proof.json`` is the document with an indent
    of 2, keys in the document's order and a final newline; NaN and infinities, which JSON
    cannot hold, are written as ``null``. ``proof.md`` is :func:`render_markdown`.

    The chart comes last. When matplotlib is missing the other two files are still written
    and nothing is raised: :attr:`Written.chart_missing` holds the hint.

    Args:
        doc: the proof document (module docstring).
        out_dir: an existing directory (the caller creates it and decides about old files).
        chart: ``"svg"``, ``"png"``, or None for no chart.

    Returns:
        A :class:`Written` naming the files written and whether the chart is missing.

    Raises:
        ConfigurationError (``option="out"``): ``out_dir`` is not an existing directory.
        ConfigurationError (``option="chart"``): ``chart`` is not ``"svg"``, ``"png"`` or None.
        TypeError: the document holds a value JSON cannot encode; nothing is written.
        OSError: a file cannot be written.
    """
    directory = Path(out_dir)
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        raise ConfigurationError(f"the output directory {str(directory)!r} {what}", option="out")
    if chart not in ("svg", "png", None):
        raise ConfigurationError(
            f"chart must be 'svg', 'png' or None, got {chart!r}", option="chart"
        )
    texts = {
        "proof.json": json.dumps(_finite(doc), indent=2, ensure_ascii=False) + "\n",
        "proof.md": render_markdown(doc),
    }
    files = []
    for name, text in texts.items():
        path = directory / name
        _write_atomic(path, text.encode("utf-8"))
        files.append(path)
    missing = None
    for fmt in ("svg", "png"):  # a chart of an earlier run (--force) must not sit beside this one
        if fmt != chart:
            with contextlib.suppress(FileNotFoundError):
                (directory / f"proof.{fmt}").unlink()
    if chart is not None:
        try:
            image = _chart_bytes(doc, chart)
        except MissingExtraError as exc:
            missing = str(exc)
        else:
            path = directory / f"proof.{chart}"
            _write_atomic(path, image)
            files.append(path)
    return Written(files=files, chart_missing=missing)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file beside ``path``, then move it over ``path``."""
    # Opened by name rather than with mkstemp: the file gets the umask's mode, not 0600.
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        with open(temporary, "xb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        raise


def _finite(value: object) -> object:
    """The value with NaN and infinities replaced by None, mappings as dicts, sequences as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


# --- Reading and formatting values ------------------------------------------------------------


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _scenarios(doc: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    items = _mapping(doc).get("scenarios")
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)):
        return []
    return [item for item in items if isinstance(item, Mapping)]


def _rows(scenario: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any] | None]]:
    """``(client, row)`` for naive and retrysafe (None when missing), then any other client."""
    rows = _mapping(scenario.get("rows"))
    found = [(client, rows.get(client)) for client in _CLIENTS]
    found += [(str(client), row) for client, row in rows.items() if client not in _CLIENTS]
    return [(client, row if isinstance(row, Mapping) else None) for client, row in found]


def _store(doc: Mapping[str, Any]) -> str:
    store = doc.get("store")
    if not isinstance(store, str) or not store.strip():
        return _DASH
    return _STORES.get(store, _inline(store))


def _name(scenario: Mapping[str, Any], index: int) -> str:
    name = scenario.get("name")
    return _inline(name) if isinstance(name, str) and name.strip() else f"#{index + 1}"


def _number(value: object) -> float | None:
    """A finite int or float as a float; None for anything else (bools included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _positive(value: object) -> bool:
    number = _number(value)
    return number is not None and number > 0


def _count(value: object) -> str:
    """``100,000``; a fraction keeps one decimal; "–" for None and non-finite numbers."""
    if value is None:
        return _DASH
    number = _number(value)
    if number is None:
        return _DASH if isinstance(value, (int, float)) else _inline(value)
    return f"{number:,.0f}" if number.is_integer() else f"{number:,.1f}"


def _counted(value: object, noun: str) -> str:
    """``1 duplicated effect``, ``9,876 duplicated effects``."""
    return f"{_count(value)} {noun}{'' if _number(value) == 1 else 's'}"


def _seconds(value: object) -> str:
    """``1.23 s``; "–" for None and non-finite numbers."""
    number = _number(value)
    if number is None:
        return _DASH if value is None or isinstance(value, (int, float)) else _inline(value)
    return f"{number:,.2f} s"


def _rate(value: object) -> str:
    """Whole operations per second, ``1,234``; "–" for None and non-finite numbers."""
    number = _number(value)
    if number is None:
        return _DASH if value is None or isinstance(value, (int, float)) else _inline(value)
    return f"{round(number):,}"


def _inline(value: object) -> str:
    """The value as one line of text (line breaks would end a table row or a heading)."""
    return " ".join(str(value).split())


def _cell(text: str) -> str:
    """Text for a table cell: ``|`` escaped (GFM removes the backslash, in code spans too)."""
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    """A code span around ``text``, fenced with more backticks than it holds in a row."""
    text = _inline(text)
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"
