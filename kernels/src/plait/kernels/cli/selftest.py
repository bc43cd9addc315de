"""``plait selftest``: run every GPU path plait has on the device found, one table of PASS/FAIL.

* On a GPU: real model shapes, Triton compiled for the device, figures with targets.
* Without one (or ``--device cpu``): a dry run. Its first line says ``dry run: no GPU``; Triton
  runs in its interpreter (``TRITON_INTERPRET=1``) where it imports, shapes are tiny, distributed
  checks use gloo. It exists so the GPU code runs in every CI run; its numbers are not GPU figures.
* ``--json PATH`` writes the rows and their provenance anywhere (e.g. under ``$OUT`` on a lent
  machine); ``--update-results`` writes the committed ``kernels/benchmarks/results/selftest.json``
  and is refused on a dry run, so a README table generated with ``--table`` only ever shows a GPU run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

COMMITTED = Path(__file__).resolve().parents[4] / "benchmarks" / "results" / "selftest.json"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plait selftest`` to the ``plait`` parser."""
    parser = subparsers.add_parser(
        "selftest", help="run every GPU path plait has (a CPU dry run without a GPU), as one table",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: cuda when available, else a CPU dry run")
    parser.add_argument("--only", action="append", default=[], metavar="PATTERN",
                        help="run only checks whose name matches (shell pattern or substring; repeatable, "
                             "comma-separated)")
    parser.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                        help="leave out checks whose name matches (same form as --only)")
    parser.add_argument("--budget-s", type=float, default=450.0, metavar="SECONDS",
                        help="seconds for the whole run (default 450: a GPU run fits in 8 minutes with start-up); "
                             "checks left when it is spent are SKIP rows")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--discovery", choices=("auto", "entry-points", "import-names"), default="auto",
                        help="where checks come from (auto: entry points if any are installed, else the "
                             "plait.*.selftest modules on the path)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write rows and provenance here")
    parser.add_argument("--update-results", action="store_true",
                        help=f"write the committed results file ({COMMITTED.name}); refused on a dry run")
    parser.add_argument("--table", nargs="?", const=COMMITTED, type=Path, default=None, metavar="PATH",
                        help="print the README markdown table of a results file (default: the committed one); "
                             "with --only/--skip, of the matching rows (each package's README shows its own)")
    parser.set_defaults(func=run)


def _patterns(values: list[str]) -> list[str]:
    return [p.strip() for value in values for p in value.split(",") if p.strip()]


def _prepare_dry_run() -> str:
    """Route the ops to their Triton kernels in the interpreter (when Triton imports) before any is
    imported, and say which; the user's own settings win."""
    if importlib.util.find_spec("triton") is None:
        return "Triton not importable: torch references only"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("PLAIT_KERNEL_BACKEND", "triton")
    return "Triton interpreter (TRITON_INTERPRET=1)"


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance(device, *, dry_run: bool, how: str) -> dict:
    """Where and how the run was made: device, driver, CUDA, torch/Triton/transformers versions, date, command."""
    import torch

    def version(module: str) -> str:
        try:
            return __import__(module).__version__ if importlib.util.find_spec(module) else "not installed"
        except Exception as exc:  # noqa: BLE001 - a broken install is still worth naming
            return f"import failed: {type(exc).__name__}"

    cpu = f"CPU dry run ({platform.processor() or 'cpu'})"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu
    driver = _driver() if device.type == "cuda" else "n/a"
    versions = {"torch": torch.__version__, "triton": version("triton"), "transformers": version("transformers")}
    # "machine" is what a README table's provenance line shows: the device and what ran it
    machine = (f"{name}, driver {driver}, CUDA {torch.version.cuda}, torch {versions['torch']}, "
               f"Triton {versions['triton']}" if device.type == "cuda" else name)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine, "device": name, "dry_run": dry_run, "driver": driver, "cuda": torch.version.cuda,
        **versions,
        "python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
        "discovery": how, "command": _command_line(),
    }


def _command_line() -> str:
    """``plait selftest ...`` as run, with ``--json``'s path cut to its file name (a results file,
    and the README table made from it, name no machine's paths)."""
    argv = sys.argv[sys.argv.index("selftest") + 1:] if "selftest" in sys.argv else sys.argv[1:]
    words = [Path(a).name if i and argv[i - 1] == "--json" else a for i, a in enumerate(argv)]
    words = [w.split("=", 1)[0] + "=" + Path(w.split("=", 1)[1]).name if w.startswith("--json=") else w for w in words]
    return " ".join(["plait selftest", *(shlex.quote(w) for w in words)])


def _bench_rows(rows):
    from plait.kernels.bench import BenchRow

    return [BenchRow(benchmark=r.name, figure=r.outcome.figure or "-", ours=r.outcome.value,
                     target=r.outcome.target, passed=None if r.outcome.status == "SKIP" else r.outcome.status == "PASS",
                     note=f"{r.outcome.status}, {r.seconds:.1f} s" + (f"; {r.outcome.note}" if r.outcome.note else ""))
            for r in rows]


def run(args: argparse.Namespace) -> int:
    """Run the selftest (see the module docstring); exit status 1 when any row FAILs, 2 on bad use."""
    if args.table is not None:
        from plait.kernels.cli.bench import results_markdown

        if not args.table.is_file():
            print(f"plait selftest: no results file {args.table}; "
                  "a GPU run with --update-results (or --json) writes one.")
            return 2
        from plait.kernels.selftest.core import matches

        only, skip = _patterns(args.only), _patterns(args.skip)
        print(results_markdown(args.table, keep=lambda name: (not only or matches(name, only))
                               and not matches(name, skip)))
        return 0
    import torch

    if not args.budget_s > 0:
        print(f"plait selftest: --budget-s {args.budget_s} must be > 0 seconds, e.g. 450.")
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("plait selftest: --device cuda but torch sees no CUDA device; drop --device (a CPU dry run).")
        return 2
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    dry_run = device.type == "cpu"
    if dry_run and args.update_results:
        print("plait selftest: --update-results is refused on a dry run (its rows are not GPU figures); "
              "use --json PATH to keep them.")
        return 2
    how_kernels = _prepare_dry_run() if dry_run else "Triton compiled for the device"
    from plait.kernels.selftest.core import FAIL, SelftestContext, format_table, run_all, selected
    from plait.kernels.selftest.discover import all_checks, discover

    ctx = SelftestContext(device=device, dry_run=dry_run)
    found = discover(args.discovery)
    checks = selected(all_checks(found, ctx), _patterns(args.only), _patterns(args.skip))
    meta = provenance(device, dry_run=dry_run, how=found.how)
    if dry_run:
        print(f"dry run: no GPU; tiny shapes, {how_kernels}, gloo; these rows are not GPU figures", flush=True)
    else:
        print(f"device: {meta['device']}, driver {meta['driver']}, CUDA {meta['cuda']}, torch {meta['torch']}, "
              f"Triton {meta['triton']}", flush=True)
    print(f"checks from {found.how}: {', '.join(found.providers) or 'none'}; {len(checks)} selected", flush=True)
    if args.list:
        print("\n".join(f"{c.name} (cap {c.cap_s:.0f} s)" for c in checks))
        return 0
    start = time.monotonic()
    rows = run_all(checks, ctx, budget_s=args.budget_s)
    print(f"\n{format_table(rows)}\n\n{sum(r.outcome.status == FAIL for r in rows)} FAIL of {len(rows)} rows "
          f"in {time.monotonic() - start:.0f} s", flush=True)
    from plait.kernels.bench import write_json

    for path in ([args.json] if args.json else []) + ([COMMITTED] if args.update_results else []):
        print(f"wrote {write_json(_bench_rows(rows), path, meta=meta)}")
    return 1 if any(r.outcome.status == FAIL for r in rows) else 0
