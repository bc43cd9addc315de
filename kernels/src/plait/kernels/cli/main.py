"""``plait``: one command whose subcommands come from the installed plait distributions."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from plait.kernels.cli import bench, report
from plait.kernels.cli.registry import entry_points

# plait-kernels' own subcommands are registered directly, so the command also works from a
# source tree on PYTHONPATH (where no entry points exist); others come from entry points.
_BUILTIN = {"report": report.register, "bench": bench.register}


def build_parser() -> argparse.ArgumentParser:
    """The parser with every available subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="plait", description="plait: large-model training techniques, piece by piece.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in _BUILTIN.values():
        register(subparsers)
    for name, ep in sorted(entry_points("plait.commands").items()):
        if name in _BUILTIN:
            continue
        try:
            ep.load()(subparsers)
        except Exception as exc:  # noqa: BLE001 - one broken plugin must not take the command down
            print(f"plait: subcommand {name!r} from {ep.value} failed to load: {exc}", file=sys.stderr)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plait`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
