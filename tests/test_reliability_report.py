"""docs/reliability.md's failure table is exactly the rendering of the committed results file.

The table is measured (``python tests/reliability_report.py run``) and written
(``python tests/reliability_report.py render``), never typed by hand: this fails when either side
changed without the other.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_report import CHAOS_END, CHAOS_START, END, PAGE, RESULTS, START, render, render_chaos


def test_the_page_holds_the_rendered_results():
    results = json.loads(RESULTS.read_text())
    assert results["rows"], "the results file holds no measured rows"
    for row in results["rows"]:
        assert {"package", "fault", "date", "load", "command"} <= set(row), row
    page = PAGE.read_text()
    assert START in page and END in page, f"{PAGE} lacks the table's marker lines"
    table = page.split(START, 1)[1].split(END, 1)[0].strip()
    assert table == render(results), "docs/reliability.md is stale: run python tests/reliability_report.py render"
    assert CHAOS_START in page and CHAOS_END in page, f"{PAGE} lacks the chaos table's marker lines"
    chaos = page.split(CHAOS_START, 1)[1].split(CHAOS_END, 1)[0].strip()
    assert chaos == render_chaos(results), "docs/reliability.md is stale: run python tests/reliability_report.py render"


def test_every_plait_dead_rank_row_names_rank_1_in_time():
    rows = [row for row in json.loads(RESULTS.read_text())["rows"]
            if "seconds" in row and not row["named"].startswith("no:")]  # not the DDP/DeepSpeed comparisons
    assert rows
    for row in rows:
        assert row["named"].startswith("rank 1 did not enter "), row
        assert row["seconds"] < row["timeout_s"] + 4, row
