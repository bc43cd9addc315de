"""Where the benchmark's side outputs (its PNG) go: where ``plait bench`` writes the run's JSON.

``plait bench onebit-optim`` chooses the JSON's place (:mod:`plait.kernels.cli.bench`): a new file under
:func:`plait.kernels.settings.bench_dir` (``PLAIT_BENCH_DIR``, default ``~/.cache/plait/bench``) by
default, the package's committed ``benchmarks/results/`` only with ``--update-results``, or
``--out PATH``. The PNG follows the same choice, so running the benchmark never writes into the
source checkout (or the current directory) unless the committed results are being updated.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence
from pathlib import Path

SUITE = "onebit-optim"


def _bench_options(argv: Sequence[str]) -> argparse.Namespace | None:
    """``--out`` and ``--update-results`` of a ``plait bench onebit-optim`` command line, else None."""
    if "bench" not in argv or SUITE not in argv:
        return None
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--update-results", action="store_true")
    return parser.parse_known_args(list(argv))[0]


def plot_path(name: str, *, quick: bool, argv: Sequence[str] | None = None) -> Path:
    """The path for the PNG ``name`` of this run, beside the run's JSON.

    Args:
        name: the PNG's name without suffix, e.g. ``"onebit-optim-memory"``.
        quick: a ``--quick`` run (its files carry ``-quick``, as its JSON does).
        argv: the command line (default ``sys.argv``); only a ``plait bench onebit-optim`` command
            line's ``--out`` / ``--update-results`` count.

    Returns:
        ``--update-results``: ``<checkout>/benchmarks/results/<name>[-quick].png`` (an editable
        install; otherwise as by default); ``--out PATH``: ``PATH``'s folder, named after it;
        by default a new timestamped file under ``bench_dir()``, never inside a checkout.
    """
    from plait.kernels.cli.bench import committed_results
    from plait.kernels.settings import bench_dir

    stem = name + ("-quick" if quick else "")
    options = _bench_options(sys.argv if argv is None else argv)
    if options is not None and options.update_results:
        results = committed_results(SUITE, SUITE + ("-quick" if quick else ""))
        if results is not None:
            return results.parent / f"{stem}.png"
    if options is not None and options.out is not None:
        return options.out.with_name(f"{options.out.stem}-{name}.png")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    return bench_dir() / f"{stem}-{stamp}.png"
