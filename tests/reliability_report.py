"""The failure table of docs/reliability.md: measured by the reliability tests, kept in a results file.

``python tests/reliability_report.py run [TEST ...]`` runs the given tests (default: the dead-rank
and restart tests) with ``PLAIT_RELIABILITY_RESULTS`` set, so each of them appends its measured row
(:func:`reliability_jobs.record`); the rows replace those of the same package and fault in
``tests/reliability_results.json``, each stamped with the date, the machine's load before and after
and the command. ``python tests/reliability_report.py render`` writes the table rendered from that
committed file into docs/reliability.md, between its two marker lines;
``test_reliability_report.py`` checks that the page holds exactly that rendering. Rows of the chaos
campaign (``tests/test_reliability_chaos.py``) and the suite's pass rates under a load generator
(the file's ``under_load`` list, written by ``python tests/reliability_report.py load TEST ...``,
which runs them with ``stress-ng --cpu 4`` beside them) go to a second table, between the ``chaos-table`` markers.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "reliability_results.json"
PAGE = HERE.parent / "docs" / "reliability.md"
START, END = "<!-- reliability-table: start (tests/reliability_report.py render) -->", "<!-- reliability-table: end -->"
DEFAULT_TESTS = ("tests/test_reliability_dead_rank.py", "tests/test_reliability_restart.py",
                 "tests/test_reliability_lightning_restart.py")
CHAOS_START = "<!-- chaos-table: start (tests/reliability_report.py render) -->"
CHAOS_END = "<!-- chaos-table: end -->"
CHAOS_HEADER = ("| campaign | faults injected | recovered, final weights bitwise "
                "| steps lost per fault (median / worst) | seconds lost per fault (median / worst) | measured |"
                "\n|---|---|---|---|---|---|")
LOAD_HEADER = "| tests | load beside them | passed | measured |\n|---|---|---|---|"
HEADER = ("| what ran | fault | who is named, with which collective | fault to named / resumed | processes left "
          "| work lost | resume bitwise | measured |\n|---|---|---|---|---|---|---|---|")


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"


def _timing(row: dict) -> str:
    """The row's time figure in words."""
    if "seconds" in row:
        return f"{row['seconds']:.1f} s (timeout {row['timeout_s']:g} s)"
    if "resumed_after_s" in row:
        return f"resumed {row['resumed_after_s']:.1f} s after the kill"
    if row.get("requeue"):
        return (f"checkpoint committed {row['checkpoint_after_s']:.2f} s after SIGUSR1; exit 0 "
                f"{row['exit_after_s']:.1f} s after the requeue's SIGTERM")
    if "checkpoint_after_s" in row:
        ratio = f" ({row['checkpoint_after_s'] / row['one_save_s']:.1f}x one whole save)" if "one_save_s" in row else ""
        return (f"checkpoint committed {row['checkpoint_after_s']:.2f} s after SIGTERM{ratio}; "
                f"exit 0 {row['exit_after_s']:.1f} s after")
    if "exit_zero" in row:
        return f"exit code 0 in {row['exit_zero']} runs"
    return ""


def _lost(row: dict) -> str:
    if "lost_steps" not in row:
        return ""
    seconds = f", {row['lost_s']:.2f} s of training" if "lost_s" in row else ""
    return f"{row['lost_steps']} step{'s' if row['lost_steps'] != 1 else ''}{seconds}"


def _cell(value: object) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "no"
    return "" if value is None else str(value).replace("|", "\\|")


def render(results: dict) -> str:
    """The markdown table of ``results`` (the results file's content), one row per package and fault."""
    lines = [HEADER]
    for row in results["rows"]:
        if "chaos" in row:
            continue  # the chaos campaign has its own table (render_chaos)
        named = row.get("named", "")
        if "checkpoint" in row:
            named = f"{named}; {row['checkpoint']}"
        lines.append("| " + " | ".join(_cell(v) for v in (
            row["package"], row["fault"], named, _timing(row), row.get("left", ""), _lost(row),
            row.get("bitwise"), f"{row['date']}, load {row['load']}")) + " |")
    return "\n".join(lines)


def render_chaos(results: dict) -> str:
    """The chaos campaigns' table and, below it, the suite's pass rate under a load generator."""
    lines = [CHAOS_HEADER]
    for row in results["rows"]:
        if "chaos" not in row:
            continue
        c = row["chaos"]
        lines.append("| " + " | ".join(_cell(v) for v in (
            row["package"], row["fault"], f"{c['recovered']} of {c['faults']}" + (
                f"; {c['damaged_refused']} damaged checkpoints refused on load" if "damaged_refused" in c else ""),
            f"{c['steps_lost_median']:g} / {c['steps_lost_worst']:g}",
            f"{c['seconds_lost_median']:.1f} / {c['seconds_lost_worst']:.1f}", f"{row['date']}, load {row['load']}"))
            + " |")
    lines += ["", LOAD_HEADER]
    for row in results.get("under_load", []):
        share = f"{row['passed']} of {row['total']} ({100 * row['passed'] / row['total']:.0f}%)"
        lines.append("| " + " | ".join(_cell(v) for v in (
            row["tests"], row["generator"], share,
            f"{row['date']}, load {row['load']}")) + " |")
    return "\n".join(lines)


def _between(text: str, start: str, end: str, body: str) -> str:
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    if not rest:
        raise SystemExit(f"{PAGE} has no line {start!r}; add the two marker lines where the table goes.")
    return f"{head}{start}\n{body}\n{end}{tail}"


def write_page(results: dict) -> None:
    """Put :func:`render`'s and :func:`render_chaos`'s tables between their markers on the page."""
    text = _between(PAGE.read_text(), START, END, render(results))
    PAGE.write_text(_between(text, CHAOS_START, CHAOS_END, render_chaos(results)))


def run(tests: list[str]) -> int:
    """Run ``tests`` collecting their rows; merge them into the results file. Returns pytest's code."""
    before, started = _load(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as rows_file:
        env = {**os.environ, "PLAIT_RELIABILITY_RESULTS": rows_file.name}
        command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *tests]
        code = subprocess.call(command, env=env, cwd=HERE.parent)
        rows = [json.loads(line) for line in Path(rows_file.name).read_text().splitlines() if line]
    # The PLAIT_* settings the tests read (the chaos campaign's size, setups, seed) belong to the command.
    settings = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                        if k.startswith("PLAIT_") and k != "PLAIT_RELIABILITY_RESULTS")
    stamp = {"date": started, "load": f"{before} -> {_load()}",
             "command": f"{settings} python tests/reliability_report.py run ".lstrip() + " ".join(tests)}
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"machine": "", "rows": []}
    fresh = {(row["package"], row["fault"]) for row in rows}
    kept = [row for row in old["rows"] if (row["package"], row["fault"]) not in fresh]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}"
    RESULTS.write_text(json.dumps({**old, "machine": machine, "rows": kept + [{**row, **stamp} for row in rows]},
                                  indent=1) + "\n")
    print(f"{len(rows)} rows from {len(tests)} test files into {RESULTS} (pytest exit code {code})")
    return code


def record_load(junit_xml: Path, tests: str, generator: str, load: str, started: str, command: str) -> dict:
    """Count a pytest run's passed tests (its JUnit XML) and keep the row in the results file's
    ``under_load`` list (replacing a row of the same tests and generator). Returns the row."""
    import xml.etree.ElementTree as ET

    cases = list(ET.parse(junit_xml).getroot().iter("testcase"))
    failed = sum(1 for case in cases if case.find("failure") is not None or case.find("error") is not None)
    skipped = sum(1 for case in cases if case.find("skipped") is not None)
    row = {"tests": tests, "generator": generator, "passed": len(cases) - failed - skipped,
           "total": len(cases) - skipped, "date": started, "load": load, "command": command}
    old = json.loads(RESULTS.read_text())
    kept = [r for r in old.get("under_load", []) if (r["tests"], r["generator"]) != (tests, generator)]
    RESULTS.write_text(json.dumps({**old, "under_load": kept + [row]}, indent=1) + "\n")
    return row


def run_under_load(tests: list[str], cpus: int = 4) -> int:
    """Run ``tests`` with ``stress-ng --cpu CPUS`` beside them; record the share that passed."""
    before, started = _load(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    stress = subprocess.Popen(["stress-ng", "--cpu", str(cpus), "--timeout", "3600s"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with tempfile.NamedTemporaryFile(suffix=".xml") as xml:
            code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    f"--junitxml={xml.name}", *tests], cwd=HERE.parent)
            row = record_load(Path(xml.name), " ".join(tests), f"stress-ng --cpu {cpus}", f"{before} -> {_load()}",
                              started, "python tests/reliability_report.py load " + " ".join(tests))
    finally:
        stress.terminate()
        stress.wait()
    print(f"{row['passed']} of {row['total']} passed with stress-ng --cpu {cpus} (pytest exit code {code})")
    return code


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("run", "render", "load"):
        raise SystemExit("usage: python tests/reliability_report.py run [TEST ...] | load TEST ... | render")
    if sys.argv[1] == "run":
        sys.exit(run(sys.argv[2:] or list(DEFAULT_TESTS)))
    if sys.argv[1] == "load":
        sys.exit(run_under_load(sys.argv[2:]))
    write_page(json.loads(RESULTS.read_text()))
