"""``plait bench NAME [--quick]``: run a package's benchmarks, print the table, write JSON.

Where results go (so that running a benchmark never dirties a source checkout):

* by default, a new timestamped file under :func:`plait.kernels.settings.bench_dir` (outside any
  checkout; ``PLAIT_BENCH_DIR`` moves it); the path is printed;
* ``--update-results``: the package's committed results file,
  ``<source folder>/benchmarks/results/<name>[-quick].json`` (an editable install only), which
  the README tables are generated from;
* ``--out PATH``: exactly there.

``plait bench NAME --table [--quick]`` runs nothing: it prints the committed results file (or
``--out PATH``) as the markdown table a README carries, with the date, machine and command that
produced it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import urllib.parse
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

from plait.kernels.cli.registry import entry_points


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plait bench``."""
    parser = subparsers.add_parser("bench", help="run a package's benchmarks against its peers, as a table")
    parser.add_argument("name", nargs="?", help="benchmark suite (a package name, e.g. zero-sharding); omit to list")
    parser.add_argument("--quick", action="store_true", help="small sizes: the whole suite in about a minute on CPU")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=None,
                       help="JSON path to write (with --table: to read); default: a new timestamped file under "
                            "PLAIT_BENCH_DIR (~/.cache/plait/bench), never inside the source tree")
    where.add_argument("--update-results", action="store_true",
                       help="write the package's committed results file (benchmarks/results/<name>[-quick].json "
                            "of a source checkout), the one README tables are generated from")
    parser.add_argument("--table", action="store_true",
                        help="run nothing: print the committed results (or --out) as a README markdown table "
                             "with their date, machine and command")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run one suite (or list them, or print a results table).

    Returns:
        0; 1 when a row fails its target; 2 on an unknown name or a results file that is not there.
    """
    suites = entry_points("plait.benchmarks")
    if "kernels" not in suites:  # running from a source tree: plait-kernels' own suite still works
        suites["kernels"] = metadata.EntryPoint("kernels", "plait.kernels.benchmarks.suite:run", "plait.benchmarks")
    if not args.name:
        print("benchmark suites:", ", ".join(sorted(suites)) or "none installed")
        return 0
    if args.name not in suites:
        print(f"plait bench: no suite named {args.name!r}; installed: {', '.join(sorted(suites)) or 'none'}. "
              f"Install the package (pip install plait-{args.name}) to add its suite.")
        return 2
    stem = args.name + ("-quick" if args.quick else "")
    if args.table:
        return _print_table(args.out or committed_results(args.name, stem))
    from plait.kernels.bench import format_table, load_average, run_meta, write_json

    if args.update_results:
        out = committed_results(args.name, stem)
        if out is None:
            print(f"plait bench: --update-results needs plait-{args.name} installed editable from a source "
                  f"checkout (pip install -e <checkout>/...); use --out PATH to keep the results elsewhere.")
            return 2
    else:
        out = args.out or default_results_path(stem)
    load_before = load_average()
    rows = suites[args.name].load()(quick=args.quick)
    print(format_table(rows))
    meta = run_meta(f"plait bench {args.name}" + (" --quick" if args.quick else ""), load_before,
                    suite=args.name, quick=args.quick)
    print(f"\nwrote {write_json(rows, out, meta=meta)}")
    if not args.update_results:
        print(f"(the committed results are updated only with: plait bench {args.name}"
              f"{' --quick' if args.quick else ''} --update-results)")
    return 1 if any(row.passed is False for row in rows) else 0


def default_results_path(stem: str) -> Path:
    """A new, timestamped file for one run, under :func:`plait.kernels.settings.bench_dir`.

    Args:
        stem: ``<suite>`` or ``<suite>-quick``.

    Returns:
        ``<bench dir>/<stem>-<UTC time>.json``; earlier runs are never overwritten.
    """
    from plait.kernels.settings import bench_dir

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    path, n = bench_dir() / f"{stem}-{stamp}.json", 1
    while path.exists():  # two runs in one second
        path, n = bench_dir() / f"{stem}-{stamp}-{n}.json", n + 1
    return path


def committed_results(name: str, stem: str) -> Path | None:
    """``<source folder>/benchmarks/results/<stem>.json`` of an editable install, else None.

    Quick runs have their own file (``<name>-quick.json``), so they never replace a full run's figures.
    """
    dist_name = "plait-kernels" if name == "kernels" else f"plait-{name}"
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:  # a second suite of a package (offload-io-capacity): its entry point's
        dist = getattr(entry_points("plait.benchmarks").get(name), "dist", None)
    try:
        direct = json.loads((dist.read_text("direct_url.json") if dist else None) or "{}")
    except json.JSONDecodeError:
        direct = {}
    url = direct.get("url", "")
    if direct.get("dir_info", {}).get("editable") and url.startswith("file://"):
        return Path(urllib.parse.unquote(url[len("file://"):])) / "benchmarks" / "results" / f"{stem}.json"
    return None


def _print_table(path: Path | None) -> int:
    if path is None or not path.is_file():
        print(f"plait bench --table: no results file at {path or 'a source checkout of this package'}; "
              "run the suite with --update-results (or pass --out PATH of a run's JSON).")
        return 2
    print(results_markdown(path))
    return 0


def results_markdown(path: Path, *, keep: Callable[[str], bool] | None = None) -> str:
    """What ``plait bench NAME --table`` prints for a results file: the markdown table, a blank
    line, then one line with the run's date, machine, CPU count and load average (when recorded),
    command and file name. README benchmark tables are this text pasted verbatim.

    Args:
        path: a JSON file ``plait bench`` wrote.
        keep: given a row's ``benchmark`` name, whether the table shows it (all rows when None;
            ``plait selftest --table --only`` uses it so each package's README shows its own checks).
    """
    from plait.kernels.bench import format_markdown, read_json

    rows, meta = read_json(path)
    if keep is not None:
        rows = [row for row in rows if keep(row.benchmark)]
    load = meta.get("load_average")
    cpus = f", {meta['cpus']} CPUs" if meta.get("cpus") else ""
    load_text = (f"{cpus}, 1-min load average {load[0]:.1f} before / {load[1]:.1f} after (other jobs' CPU use; "
                 "the timings are as noisy as that)" if load and None not in load else "")
    return (f"{format_markdown(rows)}\n\n{meta.get('date', 'date unknown')}, {meta.get('machine', 'machine unknown')}"
            f"{load_text}, `{meta.get('command', 'command unknown')}` ({Path(path).name})")


def _bench_options(suite: str, argv: Sequence[str]) -> argparse.Namespace | None:
    """``--out`` and ``--update-results`` of a ``plait bench <suite>`` command line, else None."""
    if "bench" not in argv or suite not in argv:
        return None
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--update-results", action="store_true")
    return parser.parse_known_args(list(argv))[0]


def plot_path(suite: str, name: str, *, quick: bool, argv: Sequence[str] | None = None) -> Path:
    """Where a suite's side output (its PNG ``name``) goes: where ``plait bench`` puts the run's
    JSON, so running a benchmark never writes into the checkout or the current directory unless
    the committed results are being updated.

    Args:
        suite: the suite's name, e.g. ``"ulysses-sp"``.
        name: the PNG's name without suffix, e.g. ``"ulysses-sp-memory"``.
        quick: a ``--quick`` run (its files carry ``-quick``, as its JSON does).
        argv: the command line (default ``sys.argv``); only a ``plait bench <suite>`` command
            line's ``--out`` / ``--update-results`` count.

    Returns:
        ``--update-results``: ``<checkout>/benchmarks/results/<name>[-quick].png`` (an editable
        install; otherwise as by default); ``--out PATH``: ``PATH``'s folder, named after it;
        by default a new timestamped file under ``bench_dir()``.
    """
    from plait.kernels.settings import bench_dir

    stem = name + ("-quick" if quick else "")
    options = _bench_options(suite, sys.argv if argv is None else argv)
    if options is not None and options.update_results:
        results = committed_results(suite, suite + ("-quick" if quick else ""))
        if results is not None:
            return results.parent / f"{stem}.png"
    if options is not None and options.out is not None:
        return options.out.with_name(f"{options.out.stem}-{name}.png")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    return bench_dir() / f"{stem}-{stamp}.png"
