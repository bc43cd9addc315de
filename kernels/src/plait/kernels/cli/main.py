"""``plait``: one command whose subcommands come from the installed plait distributions.

Start-up stays short: ``plait --help`` lists every subcommand from entry-point metadata alone,
importing no plugin; ``plait NAME ...`` imports only NAME's plugin (and torch only when that
plugin needs it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

from plait.kernels.cli.registry import entry_points

Register = Callable[[argparse._SubParsersAction], None]

# plait-kernels' own subcommands are registered directly, so the command also works from a
# source tree on PYTHONPATH (where no entry points exist); others come from entry points.
_BUILTIN = {"report": "plait.kernels.cli.report:register", "bench": "plait.kernels.cli.bench:register",
            "selftest": "plait.kernels.cli.selftest:register"}
_BUILTIN_HELP = {"report": "what is installed, what each piece registers, which kernels run where",
                 "bench": "run a package's benchmarks against its peers, as a table",
                 "selftest": "run every GPU path plait has (a CPU dry run without a GPU), as one table"}


def _commands() -> dict[str, metadata.EntryPoint]:
    found = {name: metadata.EntryPoint(name, value, "plait.commands") for name, value in _BUILTIN.items()}
    for name, ep in entry_points("plait.commands").items():
        found.setdefault(name, ep)
    return found


def _summary(ep: metadata.EntryPoint) -> str:
    """One line for ``plait --help`` from the distribution's metadata (no import of the plugin)."""
    dist = getattr(ep, "dist", None)
    if ep.name in _BUILTIN_HELP and (dist is None or dist.metadata["Name"] == "plait-kernels"):
        return _BUILTIN_HELP[ep.name]
    if dist is None:
        return ""
    text = (dist.metadata["Summary"] or "").strip().rstrip(".")
    return f"{text} ({dist.metadata['Name']})" if text else f"({dist.metadata['Name']})"


def _wanted(argv: Sequence[str] | None) -> str | None:
    """The subcommand named on the command line (its first non-option word), if any."""
    return next((word for word in argv or () if not word.startswith("-")), None)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser: the subcommand ``argv`` names registered for real, the others as one-line stubs.

    Args:
        argv: the command line (without the program name); ``None`` registers every subcommand for
            real (imports every plugin; for tests and tools that walk the whole parser).

    Returns:
        The ``plait`` parser.
    """
    parser = argparse.ArgumentParser(
        prog="plait", description="plait: large-model training techniques, piece by piece.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = _wanted(argv)
    for name, ep in sorted(_commands().items()):
        if argv is not None and name != wanted:
            subparsers.add_parser(name, help=_summary(ep), add_help=False)
            continue
        try:
            ep.load()(subparsers)
        except Exception as exc:  # noqa: BLE001 - one broken plugin must not take the command down
            print(f"plait: subcommand {name!r} from {ep.value} failed to load: {exc}", file=sys.stderr)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plait`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
