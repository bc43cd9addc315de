"""Imported by :func:`plait.kernels.testing.run_distributed`'s forkserver before it forks a rank.

Every rank of a distributed test is forked from that server, so a module imported here is paid
for once per test session instead of once per rank of every test: transformers' Llama, the HF
Trainer and Lightning take 2-4 s each to import, and most distributed tests build one of them.
A module that is not installed, or fails to import, is skipped: the rank imports it itself (and
meets the same error where the test can report it), and the server stays up for every other test.

``torch._dynamo`` comes first: it costs a process about as much CPU time as torch itself (1.6 of
3.5 CPU-seconds), and the ranks of the compile tests, transformers' models and Lightning import it.
plait's own modules do not (:func:`plait.kernels.eager.eager_only` marks the code compile
never traces without importing it), so in a distribution's own environment without transformers
and Lightning (CI's install-alone stage) only this server pays for it, once per test session.
"""

from __future__ import annotations

import importlib

OPTIONAL = ("torch._dynamo", "transformers", "transformers.models.llama.modeling_llama", "transformers.trainer",
            "lightning.pytorch")
# plait's own feature packages, where installed: a rank of a ZeRO or 1-bit test imports them (and
# torch.distributed.tensor under them) for 0.2-0.7 CPU-seconds, every rank of every test. Safe to
# import once before forking: they read the environment when called (settings), never at import,
# and start no thread at import. The integrations are left out: importing one changes its host
# framework (plait.lightning registers its strategy names), which a test must see happen itself.
PLAIT = ("plait.kernels.collectives", "plait.kernels.ops", "plait.zero_sharding", "plait.offload_io",
         "plait.onebit_optim", "plait.universal_ckpt", "plait.moe_layers", "plait.ulysses_sp",
         "plait.inference_kernels")


def _load(names: tuple[str, ...]) -> list[str]:
    """Import each of ``names`` that imports cleanly; return the ones that did."""
    loaded = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a broken optional import must not take the server down
            continue
        loaded.append(name)
    return loaded


LOADED = _load(OPTIONAL + PLAIT)
