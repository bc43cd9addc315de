"""``plait train`` argument parsing, kept apart from the job so that every ``plait`` command
does not import Lightning at start-up: the job module is imported only when ``train`` runs."""

from __future__ import annotations

import argparse
from typing import Any

_DESCRIPTION = ("The main job: tiny-llama on the built-in corpus through Lightning with plait_zero3 on 2 "
                "processes, a universal checkpoint, resume on 1 process, a sample, a table and a loss plot.")


def register(subparsers: Any) -> None:
    """Add ``plait train`` to the ``plait`` command (entry point ``plait.commands``)."""
    parser = subparsers.add_parser("train", help="the main job: tiny-llama through Lightning with plait ZeRO-3",
                                   description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/main-job", help="output directory (default: out/main-job)")
    parser.add_argument("--strategy", default="plait_zero3", help="a plait strategy name (default: plait_zero3)")
    parser.add_argument("--precision", default=None, help="Lightning precision (default: 32-true on CPU, "
                                                          "bf16-mixed on GPU)")
    parser.add_argument("--devices", type=int, default=2, help="processes of the first phase (default 2)")
    parser.add_argument("--steps", type=int, default=180, help="optimizer steps before the checkpoint")
    parser.add_argument("--resume-steps", type=int, default=60, help="steps after resuming on 1 process")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--cpu", action="store_true", help="ignore GPUs")
    parser.add_argument("--quick", action="store_true", help="a 2-layer model and few steps (a smoke run)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from plait.lightning.main_job import run

    return run(args)
