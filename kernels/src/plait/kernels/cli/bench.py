"""``plait bench NAME [--quick]``: run a package's benchmarks, print the table, write JSON."""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import platform
import urllib.parse
from importlib import metadata
from pathlib import Path

from plait.kernels.bench import format_table, write_json
from plait.kernels.cli.registry import entry_points


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plait bench``."""
    parser = subparsers.add_parser("bench", help="run a package's benchmarks against its peers, as a table")
    parser.add_argument("name", nargs="?", help="benchmark suite (a package name, e.g. zero-sharding); omit to list")
    parser.add_argument("--quick", action="store_true", help="small sizes: the whole suite in about a minute on CPU")
    parser.add_argument("--out", type=Path, default=None, help="JSON output path (default: the package's "
                        "benchmarks/results/<name>.json in a source checkout, else ./plait-bench-<name>.json)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run one suite (or list them). Exit 1 when a row fails its target, 2 on an unknown name."""
    suites = _suites()
    if not args.name:
        print("benchmark suites:", ", ".join(sorted(suites)) or "none installed")
        return 0
    if args.name not in suites:
        print(f"plait bench: no suite named {args.name!r}; installed: {', '.join(sorted(suites)) or 'none'}. "
              f"Install the package (pip install plait-{args.name}) to add its suite.")
        return 2
    rows = suites[args.name](quick=args.quick)
    print(format_table(rows))
    out = args.out or _default_out(args.name + ("-quick" if args.quick else ""), args.name)
    meta = {"suite": args.name, "quick": args.quick, "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "machine": platform.platform(), "processor": platform.processor(), "command": f"plait bench {args.name}"
            + (" --quick" if args.quick else "")}
    print(f"\nwrote {write_json(rows, out, meta=meta)}")
    return 1 if any(row.passed is False for row in rows) else 0


def _suites() -> dict:
    found = {name: ep.load for name, ep in entry_points("plait.benchmarks").items()}
    if "kernels" not in found:  # running from a source tree: plait-kernels' own suite still works
        found["kernels"] = lambda: importlib.import_module("plait.kernels.benchmarks.suite").run
    return {name: _lazy(loader) for name, loader in found.items()}


def _lazy(loader):  # defer importing a suite (and its peers) until it is run
    def run_suite(*, quick: bool):
        return loader()(quick=quick)

    return run_suite


def _default_out(stem: str, name: str) -> Path:
    """``<source folder>/benchmarks/results/<stem>.json`` for an editable install, else the cwd.

    Quick runs get their own file (``<name>-quick.json``) so they never overwrite a full run's figures.
    """
    dist_name = "plait-kernels" if name == "kernels" else f"plait-{name}"
    try:
        direct = json.loads(metadata.distribution(dist_name).read_text("direct_url.json") or "{}")
    except (metadata.PackageNotFoundError, json.JSONDecodeError):
        direct = {}
    url = direct.get("url", "")
    if direct.get("dir_info", {}).get("editable") and url.startswith("file://"):
        return Path(urllib.parse.unquote(url[len("file://"):])) / "benchmarks" / "results" / f"{stem}.json"
    return Path(f"plait-bench-{stem}.json")
