"""Sharded construction that keeps the user's initialisation (``sharded_init(init="construct")``).

Modules are built for real, by their own constructors, with the process's random generator, so
every value is bitwise what the same code produces without plait. As soon as the next module
starts registering parameters, the finished parameters keep only this rank's slice of their
flattened value (``1/world`` of it, padded) and their own storage shrinks to nothing; at most one
module's parameters are whole at a time, so no rank ever holds the whole model. This is the idea of
DeepSpeed's ``zero.Init``, which also runs the real constructors and partitions as modules are
built.

Code that touches a parameter after it was sliced (HF's ``post_init`` re-initialises every
weight; ``MultiheadAttention`` initialises ``in_proj_weight`` after building ``out_proj``) still
sees a whole tensor: the parameter's class becomes :class:`ConstructedParameter`, whose
``__torch_function__`` answers shape questions from the recorded shape, rebuilds the whole value
for any other operation (an all-gather of the slices; write-only initialisers such as ``normal_``
skip the gather and start from an empty tensor, which consumes the generator exactly as the
original does), runs it, and keeps the new slice when the operation wrote to it. Views taken from
such a value (``weight[padding_idx]``) write through to their parameter the same way.

With a construction storage (``sharded_init(placement=...)``, a placement that offloads
parameters), each slice is written there and dropped as soon as it is stored, at any world size
including 1; :func:`slice_of` reads it back for the operations above and for ``zero_shard``. On one
rank the slice is the whole value, so this is what keeps building to one module at a time.

Every rank must build the same model with the same seed (as with DeepSpeed's ``zero.Init``):
:func:`check_consistent` compares the names, shapes and value fingerprints of every parameter
across ranks before ``zero_shard`` uses them and names the first that differs.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from plait.kernels.collectives import all_gather_into_tensor

# In-place initialisers that overwrite every element without reading it: rebuilding the whole
# value first would only cost an all-gather whose result is thrown away.
_WRITE_ONLY = {getattr(torch.Tensor, name) for name in (
    "normal_", "uniform_", "zero_", "fill_", "random_", "exponential_", "geometric_", "log_normal_",
    "cauchy_", "bernoulli_",
)}
_KEYS = itertools.count()  # construction storage keys (``init-<n>``)
# Questions about shape and type, answered from a meta tensor of the whole shape (no gather).
_SHAPE_QUERIES = {torch.Tensor.shape.__get__, torch.Tensor.ndim.__get__, torch.Tensor.dtype.__get__,
                  torch.Tensor.layout.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
                  torch.Tensor.nelement, torch.Tensor.element_size, torch.Tensor.is_floating_point,
                  torch.Tensor.is_complex, torch.Tensor.__len__, torch.Tensor.stride,
                  torch.Tensor.is_contiguous, torch.Tensor.ndimension}
# Questions about the parameter object itself, answered by its (empty) placeholder.
_OWN_QUERIES = {torch.Tensor.requires_grad.__get__, torch.Tensor.requires_grad.__set__, torch.Tensor.requires_grad_,
                torch.Tensor.is_leaf.__get__, torch.Tensor.grad.__get__, torch.Tensor.grad_fn.__get__,
                torch.Tensor.is_meta.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.is_sparse.__get__,
                torch.Tensor.device.__get__, torch.Tensor.__hash__, torch.Tensor.get_device,
                torch.Tensor.is_quantized.__get__}


class ConstructionGroup:
    """The ranks that build the model together and how a parameter is split between them.

    Args:
        group: the process group (``None``: one process, no ``torch.distributed``).
        storage: where finished slices wait for ``zero_shard`` (a
            :class:`~plait.zero_sharding.extension.ShardStorage`, e.g. plait-offload-io's files);
            ``None`` keeps them in memory.
    """

    def __init__(self, group: Any, storage: Any = None) -> None:
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.storage = storage

    def chunk(self, numel: int) -> int:
        """Elements of a parameter of ``numel`` elements each rank keeps."""
        return math.ceil(numel / self.world) if numel else 0


class ConstructedParameter(nn.Parameter):
    """A parameter built under ``sharded_init``, of which this rank keeps one slice.

    Attributes (set by :func:`slice_parameter`): ``_plait_shape`` the whole shape,
    ``_plait_slice`` this rank's slice of the flattened value, ``_plait_group`` the
    :class:`ConstructionGroup`, ``_plait_generation`` bumped at every write (views check it).
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _dispatch(func, args, kwargs or {})


class ConstructedView(torch.Tensor):
    """A view of a rebuilt whole value (``weight[padding_idx]``): writes reach its parameter."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _dispatch(func, args, kwargs or {})


def slice_parameter(param: nn.Parameter, group: ConstructionGroup) -> None:
    """Keep only this rank's slice of ``param`` (same object: ties and references stay valid)."""
    with torch.no_grad():
        value = param.detach()
        param.__class__ = ConstructedParameter
        param._plait_shape = tuple(value.shape)
        param._plait_group = group
        param._plait_generation = 0
        _store_slice(param, value)
        with torch._C.DisableTorchFunctionSubclass():
            param.data = torch.empty(0, dtype=value.dtype, device=value.device)


def _store_slice(param: ConstructedParameter, value: torch.Tensor) -> None:
    group = param._plait_group
    flat = value.reshape(-1)
    chunk = group.chunk(flat.numel())
    if _sole_owner(flat, chunk):
        # One rank keeps the whole value: keeping the tensor itself, not a copy, saves a second
        # copy of the largest module (the embedding) while the model is built.
        piece = flat.detach()  # not a view: see FlatUnit._adopt
    else:
        piece = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
        lo, hi = min(group.rank * chunk, flat.numel()), min((group.rank + 1) * chunk, flat.numel())
        piece[:hi - lo].copy_(flat[lo:hi])
    param._plait_fingerprint = _fingerprint(flat)
    param._plait_generation += 1
    param._plait_dtype = piece.dtype
    if group.storage is None:
        param._plait_slice = piece
        return
    # Straight to the store: the slice (on one rank the constructor's tensor itself) is written
    # and dropped, so the memory of building the model is one module, not the model.
    if not hasattr(param, "_plait_key"):
        # Unique in the process, not per build: two models built with the same placement must not
        # write over each other's construction files.
        param._plait_key = f"init-{next(_KEYS)}"
    piece = piece.contiguous()
    _wait(group.storage.write(param._plait_key, piece))
    param._plait_slice = None
    param._plait_spilled = (piece.numel(), piece.device)


def _wait(handle: Any) -> None:
    if handle is not None:
        handle.wait()


def slice_of(param: ConstructedParameter) -> torch.Tensor:
    """This rank's slice of ``param``: in memory, or read back from the construction storage."""
    if param._plait_slice is not None:
        return param._plait_slice
    numel, device = param._plait_spilled
    storage = param._plait_group.storage
    empty = getattr(storage, "empty", None)
    out = empty(numel, dtype=param._plait_dtype, device=device) if empty is not None else \
        torch.empty(numel, dtype=param._plait_dtype, device=device)
    _wait(storage.read(param._plait_key, out))
    return out


def _sole_owner(flat: torch.Tensor, chunk: int) -> bool:
    """Whether ``flat`` can be kept as this rank's slice without a copy: the slice is the whole
    value (one rank) and ``flat`` is all of its own storage (no other tensor shares its memory, so
    nothing else can change the slice)."""
    return chunk == flat.numel() and flat.is_contiguous() and flat.storage_offset() == 0 and \
        flat.untyped_storage().nbytes() == flat.numel() * flat.element_size()


def _fingerprint(flat: torch.Tensor, block: int = 1 << 20) -> tuple[float, float]:
    """Sum and sum of squares in float64, a block at a time (a float64 copy of a whole embedding
    would cost twice its own memory). Every rank computed the whole value, so equal fingerprints
    mean the ranks built the same thing."""
    total = squares = 0.0
    for start in range(0, flat.numel(), block):
        part = flat[start:start + block].double()
        total += part.sum().item()
        squares += part.square().sum().item()
    return total, squares


def whole_value(param: ConstructedParameter, *, gather: bool = True, copy: bool = True) -> torch.Tensor:
    """The whole value of ``param`` as a plain tensor (collective over its construction group
    unless ``gather=False``, which returns uninitialised memory of the right shape). On one rank
    ``copy=False`` returns the slice itself (for a caller that drops the slice right after)."""
    group = param._plait_group
    numel = math.prod(param._plait_shape)
    if not gather:
        device = param._plait_slice.device if param._plait_slice is not None else param._plait_spilled[1]
        return torch.empty(param._plait_shape, dtype=param._plait_dtype, device=device)
    piece = slice_of(param)
    if group.world == 1:
        whole = piece[:numel]
        return (whole.clone() if copy else whole).view(param._plait_shape)
    out = torch.empty(piece.numel() * group.world, dtype=piece.dtype, device=piece.device)
    all_gather_into_tensor(out, piece, group=group.group)
    return out[:numel].view(param._plait_shape)


def release(param: ConstructedParameter) -> torch.Tensor:
    """Turn ``param`` back into a plain ``nn.Parameter`` holding its whole value (collective).
    The slice is dropped, so on one rank the value is the slice itself, not a copy."""
    value = whole_value(param, copy=False)
    with torch._C.DisableTorchFunctionSubclass():
        param.data = value
    storage = param._plait_group.storage
    if storage is not None and hasattr(param, "_plait_key") and hasattr(storage, "discard"):
        storage.discard(param._plait_key)  # optional member: free the construction file
    for attr in ("_plait_shape", "_plait_slice", "_plait_group", "_plait_generation", "_plait_fingerprint",
                 "_plait_dtype", "_plait_key", "_plait_spilled"):
        if hasattr(param, attr):
            delattr(param, attr)
    param.__class__ = nn.Parameter
    return value


def _meta(param: ConstructedParameter) -> torch.Tensor:
    return torch.empty(param._plait_shape, dtype=param._plait_dtype, device="meta")


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` with every constructed parameter replaced by its whole value."""
    first = args[0] if args else None
    if isinstance(first, ConstructedParameter):
        if func in _SHAPE_QUERIES:
            with torch._C.DisableTorchFunctionSubclass():
                return func(_meta(first), *args[1:], **kwargs)
        if func in _OWN_QUERIES:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.data.__get__:
            return first  # ``weight.data.normal_()`` must still reach the slices
        if func is torch.Tensor.data.__set__:
            _store_slice(first, _whole_of(args[1]).detach())
            return None
    live: dict[int, tuple[ConstructedParameter, torch.Tensor, int]] = {}

    def unwrap(x: Any) -> Any:
        if isinstance(x, ConstructedParameter):
            if id(x) not in live:
                value = whole_value(x, gather=not (func in _WRITE_ONLY and x is first))
                live[id(x)] = (x, value, value._version)
            return live[id(x)][1]
        if isinstance(x, ConstructedView):
            parent, base = x._plait_parent, x._plait_base
            if parent._plait_generation != x._plait_generation:  # the parameter changed since: refresh
                with torch._C.DisableTorchFunctionSubclass():
                    base.copy_(whole_value(parent))
                x._plait_generation = parent._plait_generation
            live.setdefault(id(parent), (parent, base, base._version))
            with torch._C.DisableTorchFunctionSubclass():
                return x.as_subclass(torch.Tensor)
        return x

    plain_args, plain_kwargs = pytree.tree_map(unwrap, (args, kwargs))
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*plain_args, **plain_kwargs)
    for param, value, version in live.values():
        if value._version != version:
            _store_slice(param, value)
    return pytree.tree_map(lambda r: _wrap(r, live), out)


def _whole_of(x: Any) -> Any:
    if isinstance(x, ConstructedParameter):
        return whole_value(x)
    if isinstance(x, ConstructedView):
        with torch._C.DisableTorchFunctionSubclass():
            return x.as_subclass(torch.Tensor)
    return x


def _wrap(result: Any, live: dict[int, tuple[ConstructedParameter, torch.Tensor, int]]) -> Any:
    if not isinstance(result, torch.Tensor) or isinstance(result, (ConstructedParameter, ConstructedView)):
        return result
    for param, value, _ in live.values():
        if result is value:
            return param
        shares = value.numel() and result.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
        if shares and result.device == value.device:
            view = result.as_subclass(ConstructedView)
            view._plait_parent, view._plait_base = param, value
            view._plait_generation = param._plait_generation
            return view
    return result


def check_consistent(model: nn.Module) -> None:
    """Refuse a model whose constructed parameters differ across ranks, in names and shapes or in
    values (a rank seeded differently): compares every rank's list and fingerprints with rank 0's.
    Collective over the construction group.

    Raises:
        ValueError: naming the first parameter that differs, the rank, and the fix.
    """
    names, shapes, prints, group = [], [], [], None
    for name, param in model.named_parameters():
        if isinstance(param, ConstructedParameter):
            group = param._plait_group
            names.append(name)
            shapes.append(param._plait_shape)
            prints.append(param._plait_fingerprint)
    if group is None or group.world == 1:
        return
    everyone: list[Any] = [None] * group.world
    dist.all_gather_object(everyone, list(zip(names, shapes)), group=group.group)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            mine, ref = next((a, b) for a, b in itertools.zip_longest(theirs, everyone[0]) if a != b)
            raise ValueError(f"sharded_init: rank {rank} built parameter {mine} where rank 0 built {ref}; every rank "
                             "must build the same model under sharded_init.")
    local = torch.tensor(prints, dtype=torch.float64)
    gathered = [torch.empty_like(local) for _ in range(group.world)]
    dist.all_gather(gathered, local, group=group.group)  # a few floats per parameter: metadata, not counted
    for rank, theirs in enumerate(gathered):
        same = (theirs == gathered[0]) | (theirs.isnan() & gathered[0].isnan())
        differs = (~same).any(dim=-1).nonzero()
        if differs.numel():
            raise ValueError(f"sharded_init: parameter {names[int(differs[0, 0])]!r} was built with different values "
                             f"on rank {rank} and rank 0; seed every rank the same (torch.manual_seed) before building "
                             "the model under sharded_init, initialise parameters a constructor leaves empty "
                             "(torch.empty), or build it under sharded_init(init='meta') and load weights.")
