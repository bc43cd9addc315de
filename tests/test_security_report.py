"""docs/reliability.md's security table is exactly the rendering of tests/security_results.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import security_report


def test_page_holds_the_rendered_security_table():
    results = json.loads(security_report.RESULTS.read_text())
    page = security_report.PAGE.read_text()
    table = page.split(security_report.START, 1)[1].split(security_report.END, 1)[0].strip()
    assert table == security_report.render(results), "run `python tests/security_report.py render`"
    assert all(row["passed"] for row in results["attacks"])
    assert results["fuzzer"]["inputs_refused"] == results["fuzzer"]["inputs_tried"] > 0
