"""``deepspeed.zero.Init`` and ``deepspeed.zero.GatheredParameters`` on plait's ZeRO-3."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def Init(module: Any = None, data_parallel_group: Any = None, mem_efficient_linear: bool = True,  # noqa: N802
         remote_device: str | None = None, pin_memory: bool = False, config_dict_or_path: Any = None,
         config: Any = None, enabled: bool = True, dtype: Any = None, mpu: Any = None, mesh: Any = None,
         **_: Any) -> Iterator[None]:
    """Build the model inside so no rank holds all of it (plait's :func:`~plait.zero_sharding.sharded_init`).

    Args:
        module: refused (DeepSpeed partitions an already-built module here; build it inside instead).
        data_parallel_group, mesh: the group/mesh to shard over (``None``: the world).
        enabled: ``False`` builds normally.
        mem_efficient_linear, remote_device, pin_memory, config_dict_or_path, config, dtype:
            accepted for DeepSpeed's signature; the config's offload and dtype keys act when
            ``initialize`` shards the model.
        mpu: refused (no model-parallel units).

    Raises:
        ValueError: ``module=`` or ``mpu=`` given.
    """
    if module is not None:
        raise ValueError("zero.Init(module=...): build the model inside `with deepspeed.zero.Init():` instead.")
    if mpu is not None:
        raise ValueError("zero.Init(mpu=...): model-parallel units are not supported by plait's shim.")
    if not enabled:
        yield
        return
    from plait.zero_sharding.api import sharded_init

    with sharded_init(mesh if mesh is not None else data_parallel_group):
        yield


def GatheredParameters(params: Any, modifier_rank: int | None = None, fwd_module: Any = None,  # noqa: N802
                       enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Gather ZeRO-3-sharded parameters for the scope; ``modifier_rank``'s in-place edits are kept.

    Args:
        params: a parameter or an iterable of parameters.
        modifier_rank: the rank whose changes are written back to the shards on exit (``None``: read only).
        fwd_module: accepted for DeepSpeed's signature.
        enabled: ``False`` does nothing.

    Returns:
        The context manager (plait's ``gathered_parameters``).
    """
    from plait.zero_sharding import gathered_parameters

    return gathered_parameters(params, modifier_rank=modifier_rank, enabled=enabled)
