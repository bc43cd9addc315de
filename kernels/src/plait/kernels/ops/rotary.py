"""Rotary position embedding (RoPE) on q and k: in place for inference, out of place for training.

RoPE rotates pairs of channels of every q/k head by an angle ``pos * inv_freq[i]``. Two pairings
exist in the wild and both are supported:

* NeoX layout (``is_neox=True``; Llama, Mistral, Qwen in HF): channel ``i`` pairs with
  ``i + rotary_dim/2``.
* GPT-J layout (``is_neox=False``): interleaved pairs, channel ``2i`` with ``2i+1``.

Partial rotary (``rotary_dim < head_size``) rotates the first ``rotary_dim`` channels of each head
and leaves the tail untouched. q and k may have different head counts (GQA/MQA). Positions are
arbitrary integers per token (packed sequences, decode steps, speculative trees): the angle
table is indexed with them, never assumed to be ``arange``.

The angle table is either one ``cos_sin_cache`` of shape ``[max_positions, rotary_dim]`` with
cosines in the first half and sines in the second (vLLM's layout; :func:`rotary_cos_sin` builds
it), or a pair ``(cos, sin)`` of ``[max_positions, rotary_dim/2]`` tables.

Public functions validate everything before any launch and dispatch through
:func:`plait.kernels.dispatch.select_backend`; the Triton kernels live in ``rotary_triton``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from plait.kernels import dispatch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""q/k dtypes the ops accept."""

MAX_ROTARY_DIM = 1024
"""Largest rotary_dim accepted: the Triton kernel holds half a head's angles in one block."""

CosSin = torch.Tensor | Sequence[torch.Tensor]


def rotary_cos_sin(
    max_positions: int,
    rotary_dim: int,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Build a ``[max_positions, rotary_dim]`` cos|sin cache for plain (unscaled) RoPE.

    ``inv_freq[i] = base ** (-2i / rotary_dim)``, computed in fp32 as HF and vLLM do.

    Args:
        max_positions: number of positions (rows).
        rotary_dim: rotated channels per head; even.
        base: RoPE theta.
        dtype: dtype of the cache (angles are computed in fp32 then cast).
        device: where to build it.

    Returns:
        ``cache`` with ``cache[p, :rotary_dim//2] = cos(p * inv_freq)`` and
        ``cache[p, rotary_dim//2:] = sin(p * inv_freq)``.

    Raises:
        ValueError: non-positive ``max_positions``, odd or non-positive ``rotary_dim``, ``base <= 1``.
    """
    if not isinstance(max_positions, int) or max_positions <= 0:
        raise ValueError(f"rotary_cos_sin: max_positions={max_positions!r} must be a positive int.")
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_cos_sin: rotary_dim={rotary_dim!r} must be a positive even int.")
    if not (isinstance(base, int | float) and math.isfinite(base) and base > 1):
        raise ValueError(f"rotary_cos_sin: base={base!r} must be a finite number > 1, e.g. 10000.0.")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    inv_freq = 1.0 / (float(base) ** exponents)
    positions = torch.arange(max_positions, dtype=torch.int64, device=device).float()
    angles = torch.outer(positions, inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)


def split_cos_sin(cos_sin: CosSin, rotary_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn either table form into ``(cos, sin)``, each ``[max_positions, rotary_dim/2]`` (views).

    Args:
        cos_sin: a ``[max_positions, rotary_dim]`` cache, or a ``(cos, sin)`` pair.
        rotary_dim: the rotated width.
        device: the device q lives on.

    Returns:
        ``(cos, sin)``.

    Raises:
        ValueError: wrong shapes, non-float dtypes or a different device.
    """
    half = rotary_dim // 2
    if isinstance(cos_sin, torch.Tensor):
        if cos_sin.dim() != 2 or cos_sin.shape[1] != rotary_dim:
            raise ValueError(
                f"rotary: cos_sin_cache has shape {tuple(cos_sin.shape)}; it must be "
                f"[max_positions, rotary_dim={rotary_dim}] (cos half then sin half), see rotary_cos_sin()."
            )
        cos, sin = cos_sin[:, :half], cos_sin[:, half:]
    elif isinstance(cos_sin, tuple | list) and len(cos_sin) == 2:
        cos, sin = cos_sin
        for name, table in (("cos", cos), ("sin", sin)):
            if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[1] != half:
                shape = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
                raise ValueError(
                    f"rotary: {name} table is {shape}; each of (cos, sin) must be "
                    f"[max_positions, rotary_dim/2={half}]."
                )
        if cos.shape[0] != sin.shape[0]:
            raise ValueError(f"rotary: cos has {cos.shape[0]} rows but sin has {sin.shape[0]}; they must match.")
    else:
        raise ValueError(
            "rotary: cos_sin must be a [max_positions, rotary_dim] tensor or a (cos, sin) pair of "
            f"[max_positions, rotary_dim/2] tensors, got {type(cos_sin).__name__}."
        )
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"rotary: {name} table dtype {table.dtype} is not supported; use fp32, bf16 or fp16.")
        if table.device != device:
            raise ValueError(f"rotary: {name} table is on {table.device} but q is on {device}; move it.")
    return cos, sin


def as_heads(x: torch.Tensor, head_size: int, name: str) -> torch.Tensor:
    """View q or k as ``[..., n_heads, head_size]`` (no copy).

    A 2-D tensor is ``[tokens, n_heads*head_size]``; a tensor of 3+ dims whose last dim equals
    ``head_size`` is already ``[..., n_heads, head_size]``; otherwise the last dim is split.

    Raises:
        ValueError: the last dimension is not a multiple of ``head_size``.
    """
    if x.dim() >= 3 and x.shape[-1] == head_size:
        return x
    if x.dim() < 2 or x.shape[-1] % head_size:
        raise ValueError(
            f"rotary: {name} has shape {tuple(x.shape)}; it must be [tokens, n_heads*head_size] or "
            f"[..., n_heads, head_size] with head_size={head_size}."
        )
    return x.unflatten(-1, (x.shape[-1] // head_size, head_size))


def check_rotary_inputs(
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin: CosSin,
    positions: torch.Tensor,
    *,
    head_size: int,
    rotary_dim: int | None,
    validate_positions: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Validate the rotary arguments and normalise them.

    Returns:
        ``(q4, k4, cos, sin, positions_flat, rotary_dim)``: q and k as ``[..., heads, head_size]``
        views, the two angle tables, positions flattened to one int64 entry per token.

    Raises:
        ValueError: any inconsistency, naming the argument and the fix.
    """
    if not isinstance(q, torch.Tensor) or (k is not None and not isinstance(k, torch.Tensor)):
        raise ValueError("rotary: q must be a tensor and k a tensor or None.")
    if not isinstance(head_size, int) or head_size <= 0:
        raise ValueError(f"rotary: head_size={head_size!r} must be a positive int.")
    rotary_dim = head_size if rotary_dim is None else rotary_dim
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(
            f"rotary: rotary_dim={rotary_dim!r} must be a positive even int <= head_size={head_size}."
        )
    if rotary_dim > MAX_ROTARY_DIM:
        raise ValueError(f"rotary: rotary_dim={rotary_dim} exceeds the supported {MAX_ROTARY_DIM}.")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"rotary: q dtype {q.dtype} is not supported; cast q and k to fp32, bf16 or fp16.")
    q4 = as_heads(q, head_size, "q")
    k4 = None
    if k is not None:
        if k.dtype != q.dtype or k.device != q.device:
            raise ValueError(
                f"rotary: k is {k.dtype} on {k.device} but q is {q.dtype} on {q.device}; they must match."
            )
        k4 = as_heads(k, head_size, "k")
        if k4.shape[:-2] != q4.shape[:-2]:
            raise ValueError(
                f"rotary: q has token dims {tuple(q4.shape[:-2])} but k has {tuple(k4.shape[:-2])}; "
                "they must match (only the head count may differ)."
            )
    cos, sin = split_cos_sin(cos_sin, rotary_dim, q.device)
    flat = _check_positions(positions, q4.shape[:-2], q.device)
    if validate_positions and flat.numel():
        low, high = int(flat.min()), int(flat.max())
        if low < 0 or high >= cos.shape[0]:
            raise ValueError(
                f"rotary: positions span [{low}, {high}] but the angle table has {cos.shape[0]} rows; "
                "build a larger cache (rotary_cos_sin(max_positions=...))."
            )
    return q4, k4, cos, sin, flat, rotary_dim


def _check_positions(positions: torch.Tensor, token_shape: torch.Size, device: torch.device) -> torch.Tensor:
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64):
        got = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"rotary: positions must be an int32/int64 tensor, got {got}.")
    if positions.device != device:
        raise ValueError(f"rotary: positions are on {positions.device} but q is on {device}; move them.")
    tokens = math.prod(token_shape)
    if positions.shape != token_shape and not (positions.dim() == 1 and positions.numel() == tokens):
        raise ValueError(
            f"rotary: positions have shape {tuple(positions.shape)}; they must be {tuple(token_shape)} "
            f"(q's token dims) or a flat [{tokens}]."
        )
    return positions.reshape(-1).to(torch.int64)


def rotate_reference(
    x: torch.Tensor,
    cos_rows: torch.Tensor,
    sin_rows: torch.Tensor,
    rotary_dim: int,
    is_neox: bool,
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` channels of ``x`` ``[..., heads, head_size]``; pure torch.

    Args:
        x: the heads to rotate.
        cos_rows: ``[..., rotary_dim/2]``, the cosines for x's token dims (already gathered by position).
        sin_rows: the matching sines (negate them to rotate by ``-theta``).
        rotary_dim: rotated width.
        is_neox: NeoX (halves) or GPT-J (interleaved) pairing.

    Returns:
        A new tensor like ``x`` (computed in fp32, one cast), the tail channels copied unchanged.
    """
    half = rotary_dim // 2
    rot = x[..., :rotary_dim].float()
    cos = cos_rows.float().unsqueeze(-2)
    sin = sin_rows.float().unsqueeze(-2)
    if is_neox:
        x1, x2 = rot[..., :half], rot[..., half:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    # Same operation order as HF's q*cos + rotate_half(q)*sin, so fp32 results match bit for bit.
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    out = torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)
    out = out.to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rotary_dim:]), dim=-1)


def _reference_rotate_pair(q4, k4, cos, sin, flat, rotary_dim, is_neox):
    token_shape = q4.shape[:-2]
    cos_rows = cos[flat].view(*token_shape, -1)
    sin_rows = sin[flat].view(*token_shape, -1)
    q_out = rotate_reference(q4, cos_rows, sin_rows, rotary_dim, is_neox)
    k_out = None if k4 is None else rotate_reference(k4, cos_rows, sin_rows, rotary_dim, is_neox)
    return q_out, k_out


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin: CosSin,
    positions: torch.Tensor,
    *,
    head_size: int,
    rotary_dim: int | None = None,
    is_neox: bool = True,
    validate_positions: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply RoPE to q and k **in place** (inference; vLLM's ``RotaryEmbedding.forward`` contract).

    Args:
        q: ``[tokens, n_heads*head_size]`` or ``[..., n_heads, head_size]``; any strides.
        k: same token dims as q, its own (GQA) head count; or None.
        cos_sin: ``[max_positions, rotary_dim]`` cos|sin cache, or a ``(cos, sin)`` pair.
        positions: int tensor with q's token shape (or flat), indexing the table.
        head_size: channels per head.
        rotary_dim: rotated channels per head (default ``head_size``); the rest is untouched.
        is_neox: NeoX halves pairing (True) or GPT-J interleaved pairs (False).
        validate_positions: check positions lie inside the table (one device sync on CUDA);
            a caller that guarantees it (a serving engine) may turn it off.

    Returns:
        ``(q, k)``, the same tensor objects, rotated.

    Raises:
        ValueError: bad shapes, dtypes, devices, positions out of range, or q/k needing grad
            (an in-place rotation would corrupt autograd; use :func:`rotary_embedding`).
    """
    if torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)):
        raise ValueError(
            "apply_rotary rotates in place and is not differentiable; call rotary_embedding() for "
            "training, or run under torch.no_grad()/inference_mode()."
        )
    compiling = torch.compiler.is_compiling()  # positions are then checked by the op, at run time
    q4, k4, cos, sin, flat, rotary_dim = check_rotary_inputs(
        q, k, cos_sin, positions, head_size=head_size, rotary_dim=rotary_dim,
        validate_positions=validate_positions and not compiling,
    )
    if compiling:  # the custom op: opaque to torch.compile
        from plait.kernels.ops.rotary_op import rotary_custom

        rotary_custom(q4, k4, cos, sin, flat, rotary_dim, is_neox, in_place=True, check_positions=validate_positions,
                      use_triton=dispatch.select_backend(q) == dispatch.TRITON)
        return q, k
    if dispatch.select_backend(q) == dispatch.TRITON:
        from plait.kernels.ops.rotary_triton import rotary_inplace_triton

        rotary_inplace_triton(q4, k4, cos, sin, flat, rotary_dim, is_neox)
        return q, k
    token_shape = q4.shape[:-2]
    cos_rows = cos[flat].view(*token_shape, 1, -1)
    sin_rows = sin[flat].view(*token_shape, 1, -1)
    if is_neox and q.dtype == torch.float32 and cos.dtype == torch.float32:
        cos_full, sin_signed = neox_full_tables(cos_rows, sin_rows)  # built once for q and k
        rotate_neox_in_place(q4, cos_full, sin_signed, rotary_dim)
        if k4 is not None:
            rotate_neox_in_place(k4, cos_full, sin_signed, rotary_dim)
        return q, k
    rotate_in_place_reference(q4, cos_rows, sin_rows, rotary_dim, is_neox)
    if k4 is not None:
        rotate_in_place_reference(k4, cos_rows, sin_rows, rotary_dim, is_neox)
    return q, k


def neox_full_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos|cos, -sin|sin)`` from half-width tables: the full-width factors of the NeoX rotation.

    Args:
        cos: ``[..., rotary_dim/2]`` cosines.
        sin: the matching sines.

    Returns:
        ``(cos_full, sin_signed)``, each ``[..., rotary_dim]``.
    """
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def rotate_neox_in_place(x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor,
                         rotary_dim: int) -> None:
    """Rotate fp32 ``x`` ``[..., heads, head_size]`` in place, NeoX layout, in four tensor ops.

    ``x[:rd] = x[:rd] * cos_full + swap_halves(x[:rd]) * sin_signed``: HF's ``q*cos + rotate_half(q)*sin``
    with the sign moved into the table (``(-x2)*s == x2*(-s)`` exactly), so results are bitwise
    those of :func:`rotate_reference` and of HF in fp32, with one temporary and no output allocation.

    Args:
        x: fp32 heads, rotated in place (any strides).
        cos_full: ``[..., 1, rotary_dim]`` (broadcast over heads), from :func:`neox_full_tables`.
        sin_signed: the matching ``-sin|sin``.
        rotary_dim: rotated width.
    """
    half = rotary_dim // 2
    rot = x if rotary_dim == x.shape[-1] else x[..., :rotary_dim]
    swapped = torch.cat((rot[..., half:], rot[..., :half]), dim=-1)
    swapped.mul_(sin_signed)
    rot.mul_(cos_full)
    rot.add_(swapped)


def rotate_in_place_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                              is_neox: bool) -> None:
    """In-place form of :func:`rotate_reference` (same arithmetic, same order, so same bits).

    Writes the rotated halves straight into ``x`` instead of building and copying a new tensor.

    Args:
        x: ``[..., heads, head_size]``, rotated in place.
        cos: ``[..., 1, rotary_dim/2]`` cosines per token (broadcast over heads).
        sin: the matching sines.
        rotary_dim: rotated width.
        is_neox: pairing layout.
    """
    half = rotary_dim // 2
    if is_neox:
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
    else:
        x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    if x.dtype == torch.float32 and cos.dtype == torch.float32:
        new_x1 = x1 * cos - x2 * sin
        x2.mul_(cos).add_(x1 * sin)  # x1 still holds its old values here
        x1.copy_(new_x1)
        return
    # Half dtypes: compute in fp32 and round once, like the out-of-place reference and the kernel.
    f1, f2 = x1.float(), x2.float()
    cos, sin = cos.float(), sin.float()
    x1.copy_(f1 * cos - f2 * sin)
    x2.copy_(f2 * cos + f1 * sin)


def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin: CosSin,
    positions: torch.Tensor,
    *,
    head_size: int,
    rotary_dim: int | None = None,
    is_neox: bool = True,
    validate_positions: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Out-of-place, differentiable RoPE (training). Backward is the rotation by ``-theta``.

    The angle table is treated as a constant (no gradient flows to it), as in every RoPE model.

    Args:
        q, k, cos_sin, positions, head_size, rotary_dim, is_neox, validate_positions: as in
            :func:`apply_rotary`.

    Returns:
        ``(q_out, k_out)``: new tensors of q's and k's shapes (k_out None when k is None).

    Raises:
        ValueError: as in :func:`apply_rotary` (except the grad check).
    """
    compiling = torch.compiler.is_compiling()  # positions are then checked by the op, at run time
    q4, k4, cos, sin, flat, rotary_dim = check_rotary_inputs(
        q, k, cos_sin, positions, head_size=head_size, rotary_dim=rotary_dim,
        validate_positions=validate_positions and not compiling,
    )
    if compiling:
        # The custom op (opaque to torch.compile, its backward registered); eager keeps the
        # reference's autograd graph or the Triton autograd Function.
        from plait.kernels.ops.rotary_op import rotary_custom

        q_out, k_out = rotary_custom(q4, k4, cos, sin, flat, rotary_dim, is_neox, in_place=False,
                                     check_positions=validate_positions,
                                     use_triton=dispatch.select_backend(q) == dispatch.TRITON)
    elif dispatch.select_backend(q) == dispatch.TRITON:
        from plait.kernels.ops.rotary_triton import rotary_out_of_place_triton

        q_out, k_out = rotary_out_of_place_triton(q4, k4, cos, sin, flat, rotary_dim, is_neox)
    else:
        q_out, k_out = _reference_rotate_pair(q4, k4, cos, sin, flat, rotary_dim, is_neox)
    q_out = q_out.reshape(q.shape)
    return q_out, (None if k is None else k_out.reshape(k.shape))


class RotaryEmbedding(nn.Module):
    """RoPE layer holding its cos|sin cache; ``forward(positions, query, key)`` as vLLM's layer.

    Rotates in place when no gradient is needed (inference) and out of place, differentiably,
    otherwise (training), so one module serves both.

    Args:
        head_size: channels per head.
        rotary_dim: rotated channels per head (``<= head_size``).
        max_position: rows of the cache.
        base: RoPE theta.
        is_neox: NeoX (True) or GPT-J (False) pairing.
        dtype: the cache's dtype (fp32 keeps the angles exact; the kernel upcasts either way).
        device: where to build the cache.

    Raises:
        ValueError: invalid sizes (see :func:`rotary_cos_sin`) or ``rotary_dim > head_size``.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float = 10000.0, *,
                 is_neox: bool = True, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(head_size, int) or not isinstance(rotary_dim, int) or not 0 < rotary_dim <= head_size:
            raise ValueError(
                f"RotaryEmbedding: rotary_dim={rotary_dim!r} must be an int in (0, head_size={head_size!r}]."
            )
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox = is_neox
        self.cos_sin_cache = nn.Buffer(rotary_cos_sin(max_position, rotary_dim, base, dtype, device),
                                       persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotate ``query`` and ``key`` (layouts as in :func:`apply_rotary`).

        Returns:
            ``(query, key)``: the same tensors rotated in place, or new ones when grad is needed.
        """
        needs_grad = torch.is_grad_enabled() and (
            query.requires_grad or (key is not None and key.requires_grad))
        op = rotary_embedding if needs_grad else apply_rotary
        return op(query, key, self.cos_sin_cache, positions, head_size=self.head_size,
                  rotary_dim=self.rotary_dim, is_neox=self.is_neox)

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
                f"max_position={self.cos_sin_cache.shape[0]}, is_neox={self.is_neox}")
