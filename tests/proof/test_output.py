"""The proof's outputs: the Markdown table, the chart and the files written (issue 16)."""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import matplotlib
import pytest

from retrysafe import ConfigurationError
from retrysafe.proof._output import (
    CHART_HINT,
    MissingExtraError,
    Written,
    render_chart,
    render_markdown,
    write_outputs,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(duplicated: int = 0, **changes: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "operations": 100_000,
        "attempted": 112_000,
        "acknowledged": 99_000,
        "effects": 100_000 + duplicated,
        "duplicated": duplicated,
        "duplicated_operations": duplicated,
        "lost": 0,
        "unknown": 120,
        "recovered": 120,
        "still_unknown": 0,
        "rejected": 0,
        "failed": 0,
        "p50_seconds": 1.2,
        "p95_seconds": 3.4,
        "wall_seconds": 160.2,
        "ops_per_second": 624.1,
        "faults": {"lose_after_commit": 2500, "worker_kills": 12},
        "max_attempts": 5,
        "deferred": 0,
    }
    row.update(changes)
    return row


def _scenario(name: str, title: str, naive: Any, protected: Any, **changes: Any) -> dict[str, Any]:
    scenario: dict[str, Any] = {
        "name": name,
        "title": title,
        "description": f"What {name} does.",
        "mode": "plain",
        "ok": True,
        "failures": [],
        "partial": False,
        "rows": {"naive": naive, "retrysafe": protected},
    }
    scenario.update(changes)
    return scenario


def _doc(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "version": 1,
        "partial": False,
        "ok": True,
        "store": "sqlite",
        "jobs": 100_000,
        "seed": 7,
        "concurrency": 32,
        "command": "retrysafe proof --jobs 100000 --store sqlite --out docs/proof/sqlite",
        "started_at": "2026-12-01T20:40:00Z",
        "finished_at": "2026-12-01T21:01:14Z",
        "seconds": 1234.5,
        "environment": {"python": "3.11.7", "platform": "Linux-x86_64", "cpus": 2,
                        "retrysafe": "0.1.0"},
        "scenarios": [
            _scenario("loss-10", "10 % of answers lost after commit",
                      _row(9876, ops_per_second=1500.7), _row(0)),
            _scenario("kill-workers", "workers SIGKILLed and restarted",
                      _row(123, faults={"worker_kills": 12}), _row(0, faults={"worker_kills": 13}),
                      mode="transactional"),
        ],
    }  # fmt: skip
    doc.update(changes)
    return doc


def _table_rows(markdown: str) -> list[list[str]]:
    """The table's body rows, split into cells (escaped pipes kept inside their cell)."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")][2:]
    return [
        [cell.strip().replace("\0", "\\|") for cell in line.replace("\\|", "\0").split("|")[1:-1]]
        for line in lines
    ]


def _svg_texts(data: bytes) -> list[str]:
    root = ET.fromstring(data)
    return [element.text or "" for element in root.iter("{http://www.w3.org/2000/svg}text")]


# --- Markdown ---------------------------------------------------------------------------------


def test_heading_names_store_jobs_seed_concurrency_and_command() -> None:
    """The section opens with a heading naming the store, the operations, the seed and the
    concurrency, then the command in a code span."""
    markdown = render_markdown(_doc())
    heading = markdown.splitlines()[0]
    assert heading.startswith("## ")
    assert "SQLite" in heading
    assert "100,000 operations" in heading
    assert "seed 7" in heading
    assert "concurrency 32" in heading
    assert "PARTIAL" not in markdown
    assert "`retrysafe proof --jobs 100000 --store sqlite --out docs/proof/sqlite`" in markdown


def test_table_has_one_line_per_scenario_and_client_with_formatted_numbers() -> None:
    """Four body lines for two scenarios × two clients; counts with thousands separators,
    seconds as `1.20 s`, throughput as whole operations per second."""
    rows = _table_rows(render_markdown(_doc()))
    assert len(rows) == 4
    assert [row[1] for row in rows] == ["naive", "retrysafe", "naive", "retrysafe"]
    assert all(len(row) == 15 for row in rows)
    naive = rows[0]
    assert naive[0] == "10 % of answers lost after commit (`loss-10`)"
    assert naive[2:10] == [
        "100,000", "112,000", "99,000", "109,876", "9,876", "0", "120", "120",
    ]  # fmt: skip
    assert naive[11:] == ["1.20 s", "3.40 s", "160.20 s", "1,501"]
    assert rows[1][14] == "624"


def test_nonzero_protected_duplicates_and_losses_are_bold() -> None:
    """A protected row with duplicates, losses or unrecovered UNKNOWN shows them in bold; the
    naive row's duplicates are never bold."""
    doc = _doc()
    doc["scenarios"][0]["rows"]["retrysafe"] = _row(3, lost=2, recovered=100, still_unknown=20)
    rows = _table_rows(render_markdown(doc))
    assert rows[1][6:10] == ["**3**", "**2**", "120", "**100**"]
    assert rows[0][6] == "9,876"
    assert rows[3][6:10] == ["0", "0", "120", "120"]


def test_verdict_passes_when_every_protected_row_holds() -> None:
    """All protected rows at 0 duplicated, 0 lost, every UNKNOWN recovered: the verdict says
    so, with the naive client's duplicates beside it."""
    markdown = render_markdown(_doc())
    verdict = next(line for line in markdown.splitlines() if line.startswith("**Verdict"))
    assert verdict.startswith("**Verdict: passed.**")
    assert "0 duplicated effects, 0 lost operations and every UNKNOWN recovered" in verdict
    assert "9,999 duplicated" in verdict


def test_verdict_names_failing_scenarios_and_why() -> None:
    """A failing scenario is named with its failures; without phrases, with what its
    protected row shows."""
    doc = _doc(ok=False)
    doc["scenarios"][0].update(ok=False, failures=["2 operations lost"])
    doc["scenarios"][1].update(ok=False)
    doc["scenarios"][1]["rows"]["retrysafe"] = _row(5, recovered=110, still_unknown=None)
    markdown = render_markdown(doc)
    verdict = next(line for line in markdown.splitlines() if line.startswith("**Verdict"))
    assert verdict.startswith("**Verdict: FAILED.**")
    assert "in 2 of 2 scenarios: `loss-10`: 2 operations lost;" in verdict
    assert "`kill-workers`: 5 duplicated effects, 10 UNKNOWN not recovered" in verdict


def test_verdict_fails_when_rows_contradict_an_ok_document() -> None:
    """Protected duplicates fail the verdict even when the document says ok."""
    doc = _doc()
    doc["scenarios"][1]["rows"]["retrysafe"] = _row(1)
    verdict = next(
        line for line in render_markdown(doc).splitlines() if line.startswith("**Verdict")
    )
    assert verdict.startswith("**Verdict: FAILED.**")
    assert "`kill-workers`: 1 duplicated effect." in verdict


def test_verdict_fails_when_the_document_is_not_ok_without_a_failing_row() -> None:
    """ok false with every protected row clean is still a failure, said as such."""
    verdict = next(
        line for line in render_markdown(_doc(ok=False)).splitlines() if line.startswith("**Verd")
    )
    assert verdict.startswith("**Verdict: FAILED.** The run reports a failure (`ok` is false)")


def test_partial_document_is_marked_and_missing_values_show_as_dash() -> None:
    """A partial run (never ok) says PARTIAL in the heading, a banner and the verdict, not
    FAILED; None fields and a missing row render as "–", and the cut scenario is not counted as
    measured."""
    doc = _doc(partial=True, ok=False, seconds=None)
    doc["scenarios"][0]["rows"]["retrysafe"] = _row(0, p50_seconds=None, ops_per_second=None)
    doc["scenarios"][1].update(partial=True, rows={"naive": _row(4)})
    markdown = render_markdown(doc)
    assert markdown.splitlines()[0].endswith("— PARTIAL")
    assert "> **PARTIAL**" in markdown
    rows = _table_rows(markdown)
    assert rows[1][11] == "–"
    assert rows[1][14] == "–"
    assert rows[2][0].endswith("— cut short")
    assert rows[3][1] == "retrysafe"
    assert rows[3][2:] == ["–"] * 13
    verdict = next(line for line in markdown.splitlines() if line.startswith("**Verdict"))
    assert verdict.startswith("**Verdict: PARTIAL.** In the 1 scenario measured")
    assert "not measured: `kill-workers`" in verdict


def test_pipes_in_text_cells_are_escaped() -> None:
    """A `|` in a title or a client name cannot split a table cell."""
    doc = _doc()
    doc["scenarios"][0]["title"] = "lost | reset"
    doc["scenarios"][0]["rows"]["odd|client"] = _row(0)
    markdown = render_markdown(doc)
    rows = _table_rows(markdown)
    assert rows[0][0] == "lost \\| reset (`loss-10`)"
    assert rows[2][1] == "odd\\|client"
    assert all(len(row) == 15 for row in rows)


def test_command_with_backticks_gets_a_longer_fence() -> None:
    """A backtick in the command does not end its code span early."""
    markdown = render_markdown(_doc(command="retrysafe proof --out `pwd`/x"))
    assert "``retrysafe proof --out `pwd`/x``" in markdown


def test_faults_are_listed_per_scenario() -> None:
    """The faults list gives each scenario's counts, once when both clients had the same."""
    markdown = render_markdown(_doc())
    faults = markdown.split("**Faults injected**", 1)[1]
    assert "- `loss-10` (plain) — What loss-10 does. Injected: lose after commit 2,500," in faults
    assert "worker kills 12 (each client)." in faults
    assert "`kill-workers` (transactional)" in faults
    assert "naive: worker kills 12; retrysafe: worker kills 13." in faults


def test_unknown_keys_and_odd_values_do_not_break_the_rendering() -> None:
    """Extra keys are ignored; wrong types, NaN and garbage render without raising."""
    doc = _doc(extra={"a": 1}, store=["x"], jobs="many", environment="none")
    doc["scenarios"].append("not a scenario")
    doc["scenarios"].append({"rows": {"naive": 3, "retrysafe": {"duplicated": math.nan}}})
    doc["scenarios"][0]["rows"]["naive"]["new_counter"] = 5
    doc["scenarios"][0]["rows"]["naive"]["faults"] = None
    markdown = render_markdown(doc)
    rows = _table_rows(markdown)
    assert len(rows) == 6
    assert rows[4][0] == "–"
    assert rows[5][6] == "–"
    assert "many operations" in markdown
    assert render_markdown({}).count("|") > 0


def test_empty_document_has_no_verdict() -> None:
    """A document with no scenarios renders a header-only table and says nothing was measured."""
    markdown = render_markdown({"partial": True})
    assert "**Verdict: none.**" in markdown
    assert _table_rows(markdown) == []


def test_heading_level_is_adjustable_and_checked() -> None:
    """heading_level sets the number of #; outside 1–6 it is a ValueError."""
    assert render_markdown(_doc(), heading_level=3).startswith("### ")
    with pytest.raises(ValueError, match="heading_level"):
        render_markdown(_doc(), heading_level=0)


# --- Chart ------------------------------------------------------------------------------------


def test_svg_chart_is_valid_and_names_store_and_jobs(tmp_path: Path) -> None:
    """The SVG parses as XML and keeps its text: the title, both panels, the scenarios."""
    path = tmp_path / "chart.svg"
    render_chart(_doc(), path)
    texts = _svg_texts(path.read_bytes())
    assert "retrysafe proof on SQLite: 100,000 operations per scenario" in texts
    assert any(text.startswith("duplicated effects") for text in texts)
    assert any(text.startswith("throughput") for text in texts)
    assert {"loss-10", "kill-workers", "naive", "retrysafe"} <= set(texts)


def test_protected_bars_are_labelled_with_their_zero(tmp_path: Path) -> None:
    """Each protected bar at 0 duplicates carries the label "0" (visible on the log axis)."""
    render_chart(_doc(), tmp_path / "zero.svg")
    doc = _doc()
    for scenario in doc["scenarios"]:
        scenario["rows"]["retrysafe"]["duplicated"] = 7
    render_chart(doc, tmp_path / "seven.svg")
    zeros = _svg_texts((tmp_path / "zero.svg").read_bytes()).count("0")
    sevens = _svg_texts((tmp_path / "seven.svg").read_bytes())
    assert zeros - sevens.count("0") == 2
    assert sevens.count("7") == 2


def test_partial_chart_says_partial_in_its_title(tmp_path: Path) -> None:
    """A partial document's chart title ends in PARTIAL."""
    path = tmp_path / "chart.svg"
    render_chart(_doc(partial=True), path)
    assert any(text.endswith("— PARTIAL") for text in _svg_texts(path.read_bytes()))


def test_svg_chart_bytes_are_reproducible(tmp_path: Path) -> None:
    """Two renderings of one document give identical SVG bytes (no date, fixed ids)."""
    render_chart(_doc(), tmp_path / "a.svg")
    render_chart(_doc(), tmp_path / "b.svg")
    first = (tmp_path / "a.svg").read_bytes()
    assert first == (tmp_path / "b.svg").read_bytes()
    assert b"<dc:date>" not in first


def test_png_chart_is_a_png(tmp_path: Path) -> None:
    """A .png path gives a PNG file."""
    path = tmp_path / "chart.PNG"
    render_chart(_doc(), path)
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_chart_of_a_document_without_scenarios_is_drawn(tmp_path: Path) -> None:
    """An empty or partial document still gives a chart."""
    render_chart({}, tmp_path / "empty.svg")
    assert "no scenario ran" in _svg_texts((tmp_path / "empty.svg").read_bytes())


def test_chart_leaves_global_matplotlib_settings_alone(tmp_path: Path) -> None:
    """Drawing does not change the rcParams or choose a backend."""
    before = copy.deepcopy(dict(matplotlib.rcParams))
    render_chart(_doc(), tmp_path / "chart.svg")
    assert dict(matplotlib.rcParams) == before


def test_chart_with_another_suffix_is_refused(tmp_path: Path) -> None:
    """A path that is neither .svg nor .png is a ConfigurationError naming the chart."""
    with pytest.raises(ConfigurationError) as caught:
        render_chart(_doc(), tmp_path / "chart.pdf")
    assert caught.value.option == "chart"
    assert list(tmp_path.iterdir()) == []


def test_chart_without_matplotlib_raises_missing_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With matplotlib not importable, MissingExtraError (a ConfigurationError, option "chart")
    says how to install it, and nothing is written."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError) as caught:
        render_chart(_doc(), tmp_path / "chart.svg")
    assert isinstance(caught.value, ConfigurationError)
    assert caught.value.option == "chart"
    assert caught.value.extra == "proof"
    assert str(caught.value) == "the chart needs matplotlib: pip install 'retrysafe[proof]'"
    assert list(tmp_path.iterdir()) == []


# --- Files ------------------------------------------------------------------------------------


def test_write_outputs_writes_json_markdown_and_chart(tmp_path: Path) -> None:
    """proof.json (indent 2, document order, final newline), proof.md and proof.svg, named in
    Written in that order, and nothing else in the directory."""
    doc = _doc()
    written = write_outputs(doc, tmp_path)
    names = ["proof.json", "proof.md", "proof.svg"]
    assert written == Written(files=[tmp_path / name for name in names], chart_missing=None)
    assert sorted(os.listdir(tmp_path)) == sorted(names)
    text = (tmp_path / "proof.json").read_text(encoding="utf-8")
    assert text == json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    assert list(json.loads(text)) == list(doc)
    assert (tmp_path / "proof.md").read_text(encoding="utf-8") == render_markdown(doc)
    assert (tmp_path / "proof.svg").read_bytes().startswith(b"<?xml")


def test_write_outputs_png_and_no_chart(tmp_path: Path) -> None:
    """chart="png" writes proof.png; chart=None writes only the JSON and the Markdown."""
    (tmp_path / "png").mkdir()
    (tmp_path / "none").mkdir()
    write_outputs(_doc(), tmp_path / "png", chart="png")
    assert (tmp_path / "png" / "proof.png").read_bytes().startswith(PNG_MAGIC)
    written = write_outputs(_doc(), tmp_path / "none", chart=None)
    assert [path.name for path in written.files] == ["proof.json", "proof.md"]
    assert sorted(os.listdir(tmp_path / "none")) == ["proof.json", "proof.md"]


def test_write_outputs_without_matplotlib_keeps_json_and_markdown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing extra costs only the chart: JSON and Markdown are written, the hint is
    returned, nothing is raised."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    written = write_outputs(_doc(), tmp_path)
    assert written.chart_missing == CHART_HINT
    assert [path.name for path in written.files] == ["proof.json", "proof.md"]
    assert sorted(os.listdir(tmp_path)) == ["proof.json", "proof.md"]


def test_nan_is_written_as_null(tmp_path: Path) -> None:
    """NaN and infinities, which JSON cannot hold, are written as null."""
    doc = _doc(seconds=math.inf)
    doc["scenarios"][0]["rows"]["naive"]["p95_seconds"] = math.nan
    write_outputs(doc, tmp_path, chart=None)
    loaded = json.loads((tmp_path / "proof.json").read_text(encoding="utf-8"))
    assert loaded["seconds"] is None
    assert loaded["scenarios"][0]["rows"]["naive"]["p95_seconds"] is None


def test_document_json_cannot_hold_writes_nothing(tmp_path: Path) -> None:
    """A value JSON cannot encode is a TypeError before any file is written."""
    with pytest.raises(TypeError):
        write_outputs(_doc(seed=object()), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_failed_replace_keeps_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the final move fails, the previous proof.json stays whole and the temporary file
    is removed."""
    (tmp_path / "proof.json").write_text("old\n", encoding="utf-8")

    def refuse(source: object, target: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        write_outputs(_doc(), tmp_path)
    assert os.listdir(tmp_path) == ["proof.json"]
    assert (tmp_path / "proof.json").read_text(encoding="utf-8") == "old\n"


def test_written_files_get_the_umask_mode(tmp_path: Path) -> None:
    """The files are readable by others under a 022 umask (not a temporary file's 0600)."""
    previous = os.umask(0o022)
    try:
        write_outputs(_doc(), tmp_path, chart=None)
    finally:
        os.umask(previous)
    assert (tmp_path / "proof.md").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_out_dir_that_is_not_a_directory_is_refused(tmp_path: Path, kind: str) -> None:
    """A missing path or a file as out_dir is a ConfigurationError naming "out"."""
    target = tmp_path / "out"
    if kind == "file":
        target.write_text("", encoding="utf-8")
    with pytest.raises(ConfigurationError) as caught:
        write_outputs(_doc(), target)
    assert caught.value.option == "out"
    assert str(target) in str(caught.value)


def test_unknown_chart_format_is_refused(tmp_path: Path) -> None:
    """chart must be "svg", "png" or None; anything else writes nothing."""
    with pytest.raises(ConfigurationError) as caught:
        write_outputs(_doc(), tmp_path, chart="pdf")  # type: ignore[arg-type]
    assert caught.value.option == "chart"
    assert list(tmp_path.iterdir()) == []
