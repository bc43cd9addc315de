"""DeepSpeed's 1-bit ``"optimizer"`` types in a ``ds_config``, for plait-zero-sharding's DeepSpeed shim.

plait-zero-sharding's translator (:mod:`plait.zero_sharding.deepspeed`) never imports this package;
without it an ``"optimizer": {"type": "OneBitAdam", ...}`` block is refused, naming the install.
Installed, the ``plait.deepspeed_keys`` entry point calls :func:`register`, which adds a builder per
DeepSpeed type (``OneBitAdam``, ``OneBitLamb``, ``ZeroOneAdam``): the block's ``lr``, ``betas``,
``eps`` and ``weight_decay`` become the optimizer's arguments, and the rest its plait config
(:func:`~plait.onebit_optim.config_from_dict`), so ``deepspeed.initialize`` under
``python -m plait.zero_sharding.deepspeed`` runs the 1-bit optimizer composed with ZeRO.
DeepSpeed's transport settings that describe what plait does anyway are accepted
(``comm_backend_name`` ``"nccl"``/``"gloo"``, ``cuda_aware: false``); others are refused by name.
"""

from __future__ import annotations

from typing import Any

#: DeepSpeed's optimizer ``type`` -> the plait optimizer class name (and its config kind).
TYPES = {"OneBitAdam": "OnebitAdam", "OneBitLamb": "OnebitLamb", "ZeroOneAdam": "ZeroOneAdam"}
_OWN_ARGUMENTS = ("lr", "betas", "eps", "weight_decay")


def _transport(kind: str, params: dict[str, Any]) -> None:
    if params.pop("cuda_aware", False) is not False:
        raise ValueError(f"optimizer.params.cuda_aware=true ({kind}) selects DeepSpeed's CUDA-aware MPI path; plait "
                         "exchanges through the torch.distributed process group: remove it or set false.")
    backend = params.pop("comm_backend_name", "nccl")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"optimizer.params.comm_backend_name={backend!r} ({kind}): plait exchanges through the "
                         "torch.distributed process group (NCCL on GPU, gloo on CPU); use 'nccl' or remove it.")


def builder(kind: str) -> Any:
    """The ``OPTIMIZERS`` builder for DeepSpeed type ``kind``: ``params -> (class, kwargs)``."""

    def build(params: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        import plait.onebit_optim as onebit_optim

        params = dict(params)
        _transport(kind, params)
        kwargs = {name: params.pop(name) for name in _OWN_ARGUMENTS if name in params}
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        try:
            config = onebit_optim.config_from_dict(TYPES[kind], params)
        except ValueError as exc:
            raise ValueError(f"optimizer.params ({kind}): {exc}") from exc
        return getattr(onebit_optim, TYPES[kind]), {**kwargs, "onebit_config": config}

    return build


def register() -> None:
    """The ``plait.deepspeed_keys`` entry point: add the 1-bit types to the shim's optimizers."""
    from plait.zero_sharding.deepspeed.config import OPTIMIZERS

    for kind in TYPES:
        OPTIMIZERS[kind.lower()] = builder(kind)


__all__ = ["TYPES", "builder", "register"]
