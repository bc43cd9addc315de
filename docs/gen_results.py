"""Write the site's results pages from the committed benchmark results files.

For every distribution folder (``kernels``, ``packages/*``, ``integrations/*``) this writes
``docs/results/<folder name>.md``: each results file under ``<folder>/benchmarks/results/`` as its
table (rendered by :func:`plait.kernels.bench.format_markdown`, the renderer ``plait bench --table``
uses), the PNG plot committed beside it (copied to ``docs/results/img/``), and the date, machine and
command the file records. The pages are committed, so package READMEs can link to them; CI runs
``python docs/gen_results.py --check``, which fails when a results file changed and the pages were
not regenerated.

Usage::

    python docs/gen_results.py            # rewrite docs/results/
    python docs/gen_results.py --check    # exit 1 (naming the stale files) when a page is out of date
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "results"
IMG = OUT / "img"
# plait.kernels.bench has only standard-library imports, so this works in an environment without torch.
sys.path.insert(0, str(ROOT / "kernels" / "src"))
from plait.kernels.bench import BenchRow, format_markdown  # noqa: E402

_BENCH_FIELDS = {field.name for field in dataclasses.fields(BenchRow)}
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])/[\w.+-]+(?:/[\w.+-]+)*")


def distribution_folders() -> list[Path]:
    """The folders that hold a distribution (a ``pyproject.toml``), in the site's order."""
    folders = [ROOT / "kernels", *sorted((ROOT / "packages").glob("*")), *sorted((ROOT / "integrations").glob("*"))]
    return [folder for folder in folders if (folder / "pyproject.toml").is_file()]


def distribution_name(folder: Path) -> str:
    """The pip name of a distribution folder (``plait-<folder>``)."""
    return f"plait-{folder.name}"


def results_files(folder: Path) -> list[Path]:
    """The JSON results files of a folder: the suite named after the folder first, then the other
    full runs, then quick runs, each group by name."""
    files = sorted((folder / "benchmarks" / "results").glob("*.json"))
    return sorted(files, key=lambda path: (path.stem != folder.name, path.stem.endswith("-quick"), path.name))


def plot_for(results: Path) -> list[Path]:
    """The PNGs committed beside ``results`` whose names start with its stem and no longer results file's.

    ``ulysses-sp-memory.png`` belongs to ``ulysses-sp.json``; ``zero-breakdown-before.png`` belongs
    to ``zero-breakdown-before.json``, not to ``zero-breakdown.json``; ``optimizers-quality-quick.png``
    belongs to ``optimizers-quick.json``.
    """
    stems = [path.stem for path in results.parent.glob("*.json")]
    return [png for png in sorted(results.parent.glob("*.png")) if _owner(png.stem, stems) == results.stem]


def _owner(name: str, stems: list[str]) -> str | None:
    """The results file a PNG named ``name`` belongs to: the longest stem it starts with; a name
    ending in ``-quick`` (``plait bench --update-results --quick`` writes ``<plot>-quick.png``)
    belongs to the quick results of that stem when there is one."""
    def longest(text: str, among: list[str]) -> str | None:
        found = [stem for stem in among if text == stem or text.startswith(stem + "-")]
        return max(found, key=len) if found else None

    owner = longest(name, stems)
    if name.endswith("-quick") and owner is not None and not owner.endswith("-quick"):
        quick = longest(name.removesuffix("-quick"), [s.removesuffix("-quick") for s in stems if s.endswith("-quick")])
        return owner if quick is None else quick + "-quick"
    return owner


def bench_rows(payload: object) -> list[BenchRow] | None:
    """The rows of a ``plait bench`` results file, or None when the file has another shape."""
    if not isinstance(payload, dict) or not isinstance(payload.get("rows"), list) or not payload["rows"]:
        return None
    rows = []
    for row in payload["rows"]:
        if not isinstance(row, dict) or not {"benchmark", "figure", "ours"} <= row.keys():
            return None
        rows.append(BenchRow(**{key: value for key, value in row.items() if key in _BENCH_FIELDS}))
    return rows


def _cell(value: object) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def scalar_table(payload: dict) -> str:
    """A results file not written by ``plait bench``: its scalar top-level fields as a two-column
    table, then its ``rows`` (a list of flat records) as a table of their own, when it has them."""
    lines = ["| field | value |", "|---|---|"]
    for key, value in payload.items():
        if isinstance(value, (str, int, float, bool)) and len(str(value)) <= 200:
            lines.append(f"| {_cell(key)} | {_cell(value)} |")
    records = payload.get("rows")
    if isinstance(records, list) and records and all(isinstance(row, dict) for row in records):
        columns = list(dict.fromkeys(key for row in records for key in row))
        lines += ["", "| " + " | ".join(map(_cell, columns)) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(row.get(key, "")) for key in columns) + " |" for row in records]
    return "\n".join(lines)


def provenance(payload: object) -> str:
    """The run's date, machine and command as the file records them (``-`` where it does not)."""
    meta = payload.get("meta") if isinstance(payload, dict) else None
    meta = meta if isinstance(meta, dict) else (payload if isinstance(payload, dict) else {})
    cpus = f", {meta['cpus']} CPUs" if meta.get("cpus") else ""
    load = meta.get("load_average") or meta.get("load_average_1m_before_after")
    load_text = (f"; 1-min load average before/after: {load[0]} / {load[1]}"
                 if isinstance(load, list) and len(load) == 2 else "")
    # An absolute path in a recorded command names the machine that ran it, not something a reader has.
    command = _ABSOLUTE_PATH.sub("DIR", meta.get("command") or "-")
    return (f"Run: {meta.get('date', '-')}; machine: {meta.get('machine') or meta.get('platform') or '-'}{cpus}"
            f"{load_text}; command: `{command}`")


def benchmark_section(results: Path, images: dict[str, bytes]) -> str:
    """One results file as a page section: heading, provenance, table, plots (added to ``images``)."""
    payload = json.loads(results.read_text())
    rows = bench_rows(payload)
    table = format_markdown(rows) if rows is not None else scalar_table(payload if isinstance(payload, dict) else {})
    # A cell such as "ACT2FN[silu](gate)" is text, not a link.
    table = table.replace("](", "]\\(")
    parts = [f"## {results.stem}", "", provenance(payload), "", f"From `{results.name}`.", "", table, ""]
    for png in plot_for(results):
        name = f"{results.parent.parent.parent.name}-{png.name}"
        images[name] = png.read_bytes()
        parts += [f"![{png.stem}](img/{name})", ""]
    return "\n".join(parts)


def page(folder: Path, images: dict[str, bytes]) -> str:
    """The results page of one distribution folder."""
    name = distribution_name(folder)
    files = results_files(folder)
    head = [f"# {name}: results", "",
            "Generated by `python docs/gen_results.py` from the results files committed under "
            f"`{folder.relative_to(ROOT).as_posix()}/benchmarks/results/`. Each table is what "
            "`plait bench NAME --table` prints for that file; ratios are ours over the peer's, "
            "measured side by side in the same run.", "",
            f"How to use the package and its limits: the [{name} page](../packages/{folder.name}.md); "
            f"its API: the [{name} reference](../api/{folder.name}.md).", ""]
    if not files:
        return "\n".join([*head, "This distribution has no committed benchmark results.", ""])
    return "\n".join(head) + "\n" + "\n".join(benchmark_section(path, images) for path in files)


def render() -> dict[Path, bytes]:
    """Every file the results pages consist of, by path, with its bytes."""
    files: dict[Path, bytes] = {}
    images: dict[str, bytes] = {}
    for folder in distribution_folders():
        files[OUT / f"{folder.name}.md"] = page(folder, images).encode()
    for name, data in images.items():
        files[IMG / name] = data
    return files


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) the results pages.

    Returns:
        0 when written or up to date, 1 when ``--check`` found a stale or extra file.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="fail if the committed pages differ from the results files")
    args = parser.parse_args(argv)
    wanted = render()
    present = {path for pattern in ("*.md", "img/*.png") for path in OUT.glob(pattern)}
    stale = sorted(path for path, data in wanted.items() if not path.is_file() or path.read_bytes() != data)
    extra = sorted(present - wanted.keys())
    if args.check:
        if stale or extra:
            names = ", ".join(path.relative_to(ROOT).as_posix() for path in [*stale, *extra])
            print(f"gen_results: out of date: {names}; run `python docs/gen_results.py` and commit docs/results/")
            return 1
        print(f"gen_results: {len(wanted)} files in docs/results/ are up to date")
        return 0
    IMG.mkdir(parents=True, exist_ok=True)
    for path in extra:
        path.unlink()
    for path in stale:
        path.write_bytes(wanted[path])
    print(f"gen_results: wrote {len(stale)} and removed {len(extra)} of {len(wanted)} files in docs/results/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
