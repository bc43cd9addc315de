"""Every name a module's ``state_dict`` has, tied aliases included.

``nn.Module.named_parameters()`` yields a parameter shared by two modules once (a GPT whose
``head.weight`` is ``wte.weight``), but ``nn.Module.state_dict()`` carries it under both names, and
``load_state_dict(strict=True)`` wants both. Sharded engines and checkpoint writers walk the
deduplicated list, so their consolidated dicts miss the second name. These helpers find the
aliases on the live module and put them back into a dict built from the deduplicated names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["tied_aliases", "with_aliases"]


def tied_aliases(module: nn.Module, *, prefix: str = "") -> dict[str, str]:
    """Names under which ``module``'s ``state_dict`` repeats a tensor, mapped to the first name.

    Args:
        module: the model (before or after sharding: tying is a property of the module tree).
        prefix: prepended to both names of every pair (a checkpoint's own naming, e.g. ``"model."``).

    Returns:
        ``{alias: canonical}`` where ``canonical`` is the name ``named_parameters()`` /
        ``named_buffers()`` yield and ``alias`` every further name of the same tensor, in
        ``state_dict`` order. Empty for a model without tied tensors.
    """
    out: dict[str, str] = {}
    for named in (module.named_parameters, module.named_buffers):
        first: dict[int, str] = {}
        for name, tensor in named(remove_duplicate=False):
            if tensor is None:
                continue
            if id(tensor) in first:
                out[prefix + name] = prefix + first[id(tensor)]
            else:
                first[id(tensor)] = name
    return out


def with_aliases(state: dict[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """Add each alias to ``state`` (in place) as the same value as its canonical name.

    Args:
        state: a dict keyed by canonical names (as built from ``named_parameters()``).
        aliases: ``{alias: canonical}`` from :func:`tied_aliases` (or a checkpoint's record of it).

    Returns:
        ``state``, with every alias whose canonical name it holds (same tensor object, so a writer
        that copies values writes identical bytes under both names).
    """
    for alias, canonical in aliases.items():
        if canonical in state and alias not in state:
            state[alias] = state[canonical]
    return state
