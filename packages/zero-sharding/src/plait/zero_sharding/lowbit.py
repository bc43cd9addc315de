"""torchao's low-bit optimizers (``torchao.optim.AdamW8bit``, ``AdamW4bit``, ``AdamWFp8`` and their
Adam twins) as ZeRO's inner optimizer.

They keep each state as codes plus one scale per block of ``block_size`` consecutive elements of
the tensor they step, and their update is elementwise within a block. Under ZeRO that tensor is a
unit's flat master shard, so each shard is padded to whole blocks (``block_size`` is read from the
optimizer: the ``block_size`` option, else the class default, 256 for 8-bit and fp8, 128 for
4-bit) and a block never spans two ranks. A run then equals one process running the same torchao
optimizer over the same flat tensors; with one parameter per unit (stage 2
``reduce_bucket_elements=1``, stage 3 ``unit_classes`` naming the leaf modules) the blocks are each
parameter's own, as in one process over the parameters.

torchao quantizes a state only when its tensor has at least 4096 elements and a whole number of
blocks; under ZeRO the tensor is the shard, so a parameter whose shard is smaller keeps fp32
states (in one process it might not). torchao is not a dependency: nothing here imports it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

LOWBIT_MODULE = "torchao.optim"


def is_lowbit(cls: Any) -> bool:
    """Whether ``cls`` is one of torchao's low-bit optimizers (a class of :data:`LOWBIT_MODULE`
    whose constructor takes ``block_size``)."""
    module = getattr(cls, "__module__", "") or ""
    if not (module == LOWBIT_MODULE or module.startswith(LOWBIT_MODULE + ".")):
        return False
    try:
        return "block_size" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


def lowbit_block_size(cls: Any, optimizer: Any, kwargs: Mapping[str, Any]) -> int | None:
    """The quantisation block of a torchao low-bit optimizer, or ``None`` for any other optimizer.

    Args:
        cls: the optimizer class.
        optimizer: ``zero_shard``'s ``optimizer`` (a class, or an instance carrying ``block_size``).
        kwargs: the options ``zero_shard`` builds the class with.

    Returns:
        Elements per block: each shard is padded to a multiple of it.

    Raises:
        ValueError: a ``block_size`` that is not a positive integer (naming the option).
    """
    if not is_lowbit(cls):
        return None
    if not isinstance(optimizer, type) and hasattr(optimizer, "block_size"):
        block = optimizer.block_size
    else:
        block = kwargs.get("block_size", inspect.signature(cls).parameters["block_size"].default)
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"{cls.__name__}(block_size={block!r}): ZeRO pads every shard to whole quantisation "
                         "blocks, so block_size must be a positive integer, e.g. 256.")
    return block
