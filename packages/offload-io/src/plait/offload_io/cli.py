"""``plait io``: the offload I/O commands (``plait io bench``)."""

from __future__ import annotations

import argparse

from plait.offload_io import settings
from plait.offload_io.config import MIB


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plait io`` and its ``bench`` subcommand.

    Args:
        subparsers: the ``plait`` command's subparsers.
    """
    parser = subparsers.add_parser("io", help="offload I/O tools (plait-offload-io)")
    commands = parser.add_subparsers(dest="io_command", metavar="{bench}")
    bench = commands.add_parser("bench", help="sweep block size, queue depth and workers against raw os.write/read")
    bench.add_argument("--path", default=None,
                       help="directory on the drive to measure (default: $PLAIT_OFFLOAD_BENCH_DIR or the temp dir)")
    bench.add_argument("--size-mib", type=int, default=None, help="MiB per operation (default 512, quick 64)")
    bench.add_argument("--quick", action="store_true", help="a small grid and size, well under a minute")
    bench.set_defaults(func=run_bench)
    parser.set_defaults(func=lambda args: _usage(parser))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def run_bench(args: argparse.Namespace) -> int:
    """Run the sweep and print the table and the best settings.

    Args:
        args: parsed ``plait io bench`` arguments.

    Returns:
        0 on success, 2 on a bad argument.
    """
    from plait.offload_io.io_bench import report, sweep

    size_mib = args.size_mib or (64 if args.quick else 512)
    if size_mib < 1:
        print(f"plait io bench: --size-mib={size_mib} must be >= 1.")
        return 2
    directory = args.path or settings.bench_directory()
    results = sweep(directory, nbytes=size_mib * MIB, quick=args.quick)
    print()
    print(report(results, directory, size_mib * MIB))
    return 0
