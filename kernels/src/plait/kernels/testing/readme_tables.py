"""Checks that a README's results summary is taken, row for row, from a committed results file.

A package README is a front door: it shows a few headline rows of each benchmark table and links to
the package's results page for the full tables and plots. What it does show must still be the
committed results, verbatim: the table's header, some of its rows in the file's order, and the
line naming the run's date, machine and command. These helpers are what the README tests of every
package call, so the rule is written once.
"""

from __future__ import annotations

from collections.abc import Sequence

# A README summary stays short; the full table is on the results page.
MAX_SUMMARY_ROWS = 15


def table_above(text: str, line: str) -> list[str]:
    """The markdown table that ends one blank line above ``line`` in ``text``.

    Args:
        text: a README (or a block of it).
        line: the generated line under the table (date, machine, command, file).

    Returns:
        The table's lines, header and separator included.

    Raises:
        AssertionError: ``line`` is not a line of ``text``, or no table stands above it.
    """
    lines = text.splitlines()
    assert line in lines, f"no table with this generated line under it: {line}"
    end = lines.index(line) - 1
    assert end > 0 and lines[end] == "", f"a blank line goes between the table and its generated line: {line}"
    start = end
    while start > 0 and lines[start - 1].startswith("|"):
        start -= 1
    assert end - start >= 2, f"no table above the generated line: {line}"
    return lines[start:end]


def assert_rows_of(shown: Sequence[str], full: Sequence[str], what: str, *,
                   max_rows: int = MAX_SUMMARY_ROWS) -> None:
    """``shown`` (a README table) is ``full``'s header and 1 to ``max_rows`` of its rows, in order.

    Args:
        shown: the README table's lines, header and separator first.
        full: the full rendered table's lines, header and separator first.
        what: names the README and results file in the error.
        max_rows: the most rows a summary may keep.

    Raises:
        AssertionError: the header differs, there are too few or too many rows, or a row is not
            (or not in order) one of the full table's rows.
    """
    assert list(shown[:2]) == list(full[:2]), f"{what}: the summary's header is not the results table's header"
    rows, body = shown[2:], list(full[2:])
    assert 1 <= len(rows) <= max_rows, (
        f"{what}: a README summary has 1 to {max_rows} rows, found {len(rows)}; the full table is on the "
        "results page")
    position = 0
    for row in rows:
        assert row in body[position:], (
            f"{what}: this README row is not a row of the committed results (or is out of order); paste it "
            f"from the rendered table (or update the results first): {row}")
        position = body.index(row, position) + 1


def assert_results_summary(readme_text: str, rendered: str, what: str) -> None:
    """The README carries a summary of ``rendered``: a table, a blank line, then its generated line.

    Args:
        readme_text: the README.
        rendered: the full rendering of a results file: table, blank line, generated line (what
            ``plait bench NAME --table`` prints).
        what: names the README and results file in the error.

    Raises:
        AssertionError: as :func:`table_above` and :func:`assert_rows_of`.
    """
    lines = rendered.splitlines()
    assert len(lines) >= 4 and lines[-2] == "", f"{what}: not a rendered results table"
    assert_rows_of(table_above(readme_text, lines[-1]), lines[:-2], what)
