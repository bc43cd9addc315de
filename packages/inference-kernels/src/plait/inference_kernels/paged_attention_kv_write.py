"""Rotate the new tokens' keys (and optionally queries) and write k and v into the paged cache.

At decode time a step produces one new k and v per sequence; they must be rotated (RoPE) and
stored in the sequence's cache slot before attention reads them. :func:`write_kv_rotary` does
both in one kernel on the Triton path, so the rotated key is written once, straight into the
cache. The cos/sin table uses vLLM's layout: ``cos_sin_cache[position] = [cos(θ_0..θ_{r/2-1}),
sin(θ_0..θ_{r/2-1})]`` with ``r = rot_dim <= D`` (dims past ``rot_dim`` are not rotated).
``slot_mapping`` gives each token's flat slot ``block * block_size + offset``; ``-1`` (vLLM's
padding marker) skips the write for that token.
"""

from __future__ import annotations

import torch

from plait.inference_kernels.input_checks import check_float, check_index, check_ranges, check_same
from plait.inference_kernels.paged_attention import check_cache
from plait.kernels.dispatch import TRITON, select_backend


def _rotation_factors(positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool):
    """Per-token factors ``(C, S)`` of ``[T, 1, rot_dim]`` (fp32) with ``rot(x) = x*C + swap(x)*S``.

    ``swap`` exchanges each channel with its rotation partner; ``S`` carries the sign. Building
    the factors once per call and sharing them between q and k leaves two multiplies, one add
    and one swap per tensor - fewer ops than the textbook ``x1*c - x2*s, x2*c + x1*s`` form.
    """
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions.long())
    if cos_sin.dtype != torch.float32:
        cos_sin = cos_sin.float()
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    if is_neox:
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    return (torch.stack((cos, cos), dim=-1).flatten(-2), torch.stack((-sin, sin), dim=-1).flatten(-2))


def _rotate_with(x: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor], is_neox: bool) -> torch.Tensor:
    cos, sin = factors
    rot_dim = cos.shape[-1]
    head = x[..., :rot_dim]
    if head.dtype != torch.float32:
        head = head.float()
    if is_neox:
        swapped = torch.cat((head[..., rot_dim // 2:], head[..., : rot_dim // 2]), dim=-1)
    else:
        swapped = head.unflatten(-1, (rot_dim // 2, 2)).flip(-1).flatten(-2)
    rotated = torch.mul(head, cos).addcmul_(swapped, sin).to(x.dtype)  # addcmul_: one op for * and +
    return rotated if rot_dim == x.shape[-1] else torch.cat((rotated, x[..., rot_dim:]), dim=-1)


def _slot_rows(cache: torch.Tensor) -> torch.Tensor | None:
    """``cache`` as ``[num_blocks * block_size, Hkv, D]`` when its blocks are laid out back to back."""
    if cache.stride(0) != cache.shape[1] * cache.stride(1):
        return None
    return cache.view(-1, cache.shape[2], cache.shape[3])


def write_kv_rotary_reference(k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q=None,
                              is_neox=True):
    """Rotate, then copy into the cache slots (the CPU path; inputs not validated).

    Args and Returns: as :func:`write_kv_rotary`.
    """
    factors = _rotation_factors(positions, cos_sin_cache, is_neox)
    if q is None:
        q_rot, k_rot = None, _rotate_with(k, factors, is_neox)
    else:
        # One rotation over [q | k] heads: half the element-wise ops of rotating them apart.
        both = _rotate_with(torch.cat((q, k), dim=1), factors, is_neox)
        q_rot, k_rot = both[:, : q.shape[1]], both[:, q.shape[1]:]
    k_rot = k_rot.to(k_cache.dtype)
    slots = slot_mapping.long()
    # One host read decides whether any token is skipped (-1); the usual batch has none.
    if slots.numel() and int(slots.min()) < 0:
        keep = (slots >= 0).nonzero().squeeze(1)
        k_rot, v, slots = k_rot[keep], v[keep], slots[keep]
    k_rows, v_rows = _slot_rows(k_cache), _slot_rows(v_cache)
    if k_rows is not None and v_rows is not None:
        k_rows.index_copy_(0, slots, k_rot)
        v_rows.index_copy_(0, slots, v.to(v_cache.dtype))
    else:
        block_size = k_cache.shape[1]
        index = (slots // block_size, slots % block_size)
        k_cache.index_put_(index, k_rot)
        v_cache.index_put_(index, v.to(v_cache.dtype))
    return q_rot


def _validate(k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q, check_bounds) -> None:
    num_blocks, block_size, kv_heads, head_dim = check_cache(k_cache, v_cache)
    check_float("k", k, ndim=3)
    check_float("v", v, ndim=3)
    check_float("cos_sin_cache", cos_sin_cache, ndim=2)
    check_index("positions", positions, ndim=1)
    check_index("slot_mapping", slot_mapping, ndim=1)
    check_same("dtype", k=k, v=v, k_cache=k_cache)
    tensors = {"k": k, "v": v, "positions": positions, "cos_sin_cache": cos_sin_cache,
               "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    if q is not None:
        check_float("q", q, ndim=3)
        check_same("dtype", q=q, k=k)
        tensors["q"] = q
    check_same("device", **tensors)
    num_tokens = k.shape[0]
    if tuple(k.shape) != (num_tokens, kv_heads, head_dim) or k.shape != v.shape:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [T, num_kv_heads, head_size] = "
            f"[T, {kv_heads}, {head_dim}] to match the cache."
        )
    if positions.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} must have "
            f"one entry per token (T={num_tokens})."
        )
    if q is not None and (q.shape[0] != num_tokens or q.shape[2] != head_dim):
        raise ValueError(f"q {tuple(q.shape)} must be [T, num_q_heads, head_size] with T={num_tokens}, "
                         f"head_size={head_dim}.")
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or not 2 <= rot_dim <= head_dim:
        raise ValueError(
            f"cos_sin_cache has {rot_dim} columns; it must be an even rot_dim in [2, head_size={head_dim}] "
            f"(rot_dim/2 cos values then rot_dim/2 sin values per position)."
        )
    if check_bounds:
        check_ranges(
            ("positions", positions, 0, cos_sin_cache.shape[0],
             f"extend cos_sin_cache beyond {cos_sin_cache.shape[0]} positions."),
            ("slot_mapping", slot_mapping, -1, num_blocks * block_size,
             f"slots are block * block_size + offset < {num_blocks * block_size}, or -1 to skip."),
        )


def write_kv_rotary(
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q: torch.Tensor | None = None,
    is_neox: bool = True,
    check_bounds: bool = True,
) -> torch.Tensor | None:
    """Rotate ``k`` (and ``q``) by RoPE and write rotated ``k`` and ``v`` into their cache slots.

    Args:
        k, v: ``[T, Hkv, D]`` the new tokens' keys (unrotated) and values, the cache's dtype.
        positions: ``[T]`` int32/int64 token positions (rows of ``cos_sin_cache``).
        cos_sin_cache: ``[max_position, rot_dim]``, cos half then sin half, ``rot_dim`` even and
            ``<= D``; any float dtype (math in fp32).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, written in place.
        slot_mapping: ``[T]`` int32/int64 flat slots ``block * block_size + offset``; ``-1`` skips.
        q: optional ``[T, Hq, D]`` queries to rotate in the same kernel (not modified).
        is_neox: NeoX (halves, Llama/Mistral/Qwen) or GPT-J (interleaved pairs) rotation.
        check_bounds: verify positions and slots are in range (a small device-to-host read on CUDA;
            skipped during CUDA-graph capture).

    Returns:
        The rotated queries (a new tensor) when ``q`` is given, else ``None``.

    Raises:
        ValueError: unsupported dtype, head size or block size, inconsistent shapes, dtypes or
            devices, an odd or too long ``rot_dim``, out-of-range positions or slots.
    """
    _validate(k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q, check_bounds)
    if k.shape[0] == 0:
        return q.clone() if q is not None else None
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v))
    # The kernel has no backward: when autograd needs gradients the (differentiable) reference runs.
    if select_backend(k, k_cache, v_cache) == TRITON and not needs_grad:
        from plait.inference_kernels.paged_attention_triton import write_kv_rotary_triton

        return write_kv_rotary_triton(k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q,
                                      is_neox)
    return write_kv_rotary_reference(k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q,
                                     is_neox)
