"""FPDT's attention: sequence chunks with an online softmax, the chunks' q/k/v/out on the host, prefetched.

FPDT (the "Fully Pipelined Distributed Transformer") computes attention one block of query
chunk x key chunk at a time, so no ``[S, S]`` score matrix ever exists, and keeps the chunks of
``q``, ``k``, ``v`` and the output in host memory between forward and backward, copying each back
just before it is needed while the next one is already on its way (a side CUDA stream).

* forward, per query chunk: a running max, a running sum and an fp32 accumulator over the key
  chunks it may see (flash attention's online softmax); the row's log-sum-exp is kept
  (``[B, H, S]`` in fp32 or wider, on the device) for the backward;
* backward, per key chunk: the scores are rebuilt block by block from ``q``, ``k`` and the
  log-sum-exp, giving ``dk``/``dv`` for that chunk and adding into ``dq`` (flash attention's
  backward); causal blocks above the diagonal are skipped in both passes.

Here it runs on the head-sharded tensors Ulysses' all-to-all produced (``inner_attention="fpdt"``
in :class:`plait.ulysses_sp.UlyssesConfig`, or as ``DistributedAttention``'s callable); FPDT's
own chunking of the projections and of the all-to-all is not reproduced. On a CPU-only machine
"host" and "device" are the same memory: the chunks stay where they are (no copy), and only the
block-wise computation (no score matrix) is left to measure.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from plait.ulysses_sp.tiled import active_replay, chunk_sizes


class HostChunks:
    """Sequence chunks (dim 2) of a ``[B, H, S, D]`` tensor held in host memory, fetched one at a time.

    On CUDA each chunk is copied to pinned host memory (asynchronously) and :meth:`get` brings it
    back; :meth:`prefetch` starts the next chunk's copy on a side stream so it overlaps the
    current block's compute. On CPU the tensor already is in host memory: the chunks are views,
    nothing is copied.

    Args:
        tensor: ``[B, H, S, D]``.
        sizes: chunk lengths along dim 2 (they sum to ``S``).
    """

    def __init__(self, tensor: torch.Tensor, sizes: list[int]) -> None:
        self.device = tensor.device
        parts = tensor.detach().split(sizes, dim=2)
        self.cuda = tensor.device.type == "cuda"
        if self.cuda:
            self.host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p, non_blocking=True)
                         for p in parts]
            self.stream = torch.cuda.Stream(device=tensor.device)
        else:
            self.host = list(parts)
        self.pending: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.host)

    def prefetch(self, index: int) -> None:
        """Start copying chunk ``index`` back to the device (a no-op on CPU or past the end)."""
        if not self.cuda or index >= len(self.host) or index in self.pending:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the host copy is complete
        with torch.cuda.stream(self.stream):
            self.pending[index] = self.host[index].to(self.device, non_blocking=True)

    def get(self, index: int) -> torch.Tensor:
        """Chunk ``index`` on the device (waits for its prefetch; fetches it now if none was started)."""
        if not self.cuda:
            return self.host[index]
        self.prefetch(index)
        chunk = self.pending.pop(index)
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        chunk.record_stream(current)  # allocated on the side stream, used on this one
        return chunk


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(s, s + n) for s, n in zip(starts, sizes, strict=True)]


def _block_keep(mask: torch.Tensor | None, causal: bool, rows: tuple[int, int], cols: tuple[int, int],
                device: torch.device) -> torch.Tensor | None:
    """The boolean keep-mask of one block (``None``: every score of it counts)."""
    keep = None if mask is None else mask[..., rows[0]:rows[1], cols[0]:cols[1]]
    if causal and cols[1] - 1 > rows[0]:  # the block reaches above the diagonal
        q_pos = torch.arange(rows[0], rows[1], device=device)[:, None]
        k_pos = torch.arange(cols[0], cols[1], device=device)[None, :]
        triangle = k_pos <= q_pos
        keep = triangle if keep is None else keep & triangle
    return keep


def _visible(causal: bool, rows: tuple[int, int], cols: tuple[int, int]) -> bool:
    return not causal or cols[0] <= rows[1] - 1


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for half precisions (the softmax and the sums), the tensor's own dtype when wider."""
    return torch.promote_types(t.dtype, torch.float32)


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                causal: bool, scale: float, sizes: list[int]) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        ks, vs = HostChunks(k, sizes), HostChunks(v, sizes)
        replay, key = active_replay(), ("fpdt", tuple(q.shape), tuple(k.shape), q.dtype, causal, sizes)
        known = replay.take(key, q) if replay is not None and replay.replaying else None
        if known is not None:  # a checkpoint's recompute: the first run's output and log-sum-exp, no blocks
            out, lse = known[0], known[1]
        else:
            out, lse = _forward_blocks(q, ks, vs, mask, causal, scale, sizes)
            if replay is not None and not replay.replaying:
                replay.put(key, (out, lse))
        ctx.chunks = (HostChunks(q, sizes), ks, vs, HostChunks(out, sizes))
        ctx.save_for_backward(lse, *([] if mask is None else [mask]))
        ctx.causal, ctx.scale, ctx.sizes, ctx.groups = causal, scale, sizes, groups
        ctx.shapes = (q.shape, k.shape, q.dtype, k.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _backward_blocks(ctx, grad)


def _forward_blocks(q: torch.Tensor, ks: HostChunks, vs: HostChunks, mask: torch.Tensor | None, causal: bool,
                    scale: float, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax attention, query chunk by query chunk: the output and each row's log-sum-exp."""
    groups, work = q.shape[1] // ks.host[0].shape[1], _work_dtype(q)
    bounds = _bounds(sizes)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=work, device=q.device)
    for rows in bounds:
        qi = q[:, :, rows[0]:rows[1]].to(work)
        m = torch.full(qi.shape[:3], -math.inf, dtype=work, device=q.device)
        total = torch.zeros(qi.shape[:3], dtype=work, device=q.device)
        acc = torch.zeros(qi.shape, dtype=work, device=q.device)
        cols_seen = [j for j, cols in enumerate(bounds) if _visible(causal, rows, cols)]
        for n, j in enumerate(cols_seen):
            if n + 1 < len(cols_seen):  # the next key chunk is on its way while this block computes
                ks.prefetch(cols_seen[n + 1])
                vs.prefetch(cols_seen[n + 1])
            kj, vj = _expand(ks.get(j), groups).to(work), _expand(vs.get(j), groups).to(work)
            scores = _block_scores(qi, kj, scale, mask, causal, rows, bounds[j])
            new_m = torch.maximum(m, scores.amax(-1))
            safe = torch.where(new_m == -math.inf, 0.0, new_m)  # a block with every score masked
            probs = (scores - safe[..., None]).exp_()
            rescale = (m - safe).exp_()
            total = total * rescale + probs.sum(-1)
            acc = acc * rescale[..., None] + probs @ vj
            m = new_m
        out[:, :, rows[0]:rows[1]] = (acc / total[..., None]).to(q.dtype)
        lse[:, :, rows[0]:rows[1]] = m + total.log()
    return out, lse


def _block_scores(qi: torch.Tensor, kj: torch.Tensor, scale: float, mask: torch.Tensor | None, causal: bool,
                  rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    """One block's scaled scores, masked positions at -inf."""
    scores = (qi @ kj.transpose(-1, -2)).mul_(scale)
    keep = _block_keep(mask, causal, rows, cols, qi.device)
    return scores if keep is None else scores.masked_fill_(~keep, -math.inf)


def _backward_blocks(ctx: Any, grad: torch.Tensor) -> tuple:
    """Flash attention's backward, key chunk by key chunk: dk/dv per chunk, dq summed over them."""
    lse, *rest = ctx.saved_tensors
    mask = rest[0] if rest else None
    qs, ks, vs, outs = ctx.chunks
    ctx.chunks = None
    q_shape, k_shape, q_dtype, k_dtype = ctx.shapes
    bounds, work = _bounds(ctx.sizes), lse.dtype
    grad = grad.to(work)
    delta = torch.cat([(grad[:, :, r[0]:r[1]] * outs.get(i).to(work)).sum(-1) for i, r in enumerate(bounds)],
                      dim=2)  # rowsum(dO * O), flash attention's D
    dq = torch.zeros(q_shape, dtype=work, device=grad.device)
    dk = torch.empty(k_shape, dtype=k_dtype, device=grad.device)
    dv = torch.empty(k_shape, dtype=k_dtype, device=grad.device)
    for j, cols in enumerate(bounds):
        ks.prefetch(j + 1)
        vs.prefetch(j + 1)
        kj, vj = _expand(ks.get(j), ctx.groups).to(work), _expand(vs.get(j), ctx.groups).to(work)
        dkj, dvj = torch.zeros_like(kj), torch.zeros_like(vj)
        rows_seen = [i for i, rows in enumerate(bounds) if _visible(ctx.causal, rows, cols)]
        for n, i in enumerate(rows_seen):
            if n + 1 < len(rows_seen):
                qs.prefetch(rows_seen[n + 1])
            rows = bounds[i]
            qi, gi = qs.get(i).to(work), grad[:, :, rows[0]:rows[1]]
            scores = _block_scores(qi, kj, ctx.scale, mask, ctx.causal, rows, cols)
            probs = (scores - lse[:, :, rows[0]:rows[1], None]).exp_()
            dvj += probs.transpose(-1, -2) @ gi
            dscores = probs.mul_((gi @ vj.transpose(-1, -2)).sub_(delta[:, :, rows[0]:rows[1], None]))
            dq[:, :, rows[0]:rows[1]] += (dscores @ kj).mul_(ctx.scale)
            dkj += (dscores.transpose(-1, -2) @ qi).mul_(ctx.scale)
        if ctx.groups > 1:  # each kv head served `groups` query heads: their gradients add up
            dkj = dkj.unflatten(1, (-1, ctx.groups)).sum(2)
            dvj = dvj.unflatten(1, (-1, ctx.groups)).sum(2)
        dk[:, :, cols[0]:cols[1]] = dkj.to(k_dtype)
        dv[:, :, cols[0]:cols[1]] = dvj.to(k_dtype)
    return dq.to(q_dtype), dk, dv, None, None, None, None


def chunked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                      scale: float | None = None, *, chunk: int = 1024, **kwargs: Any) -> torch.Tensor:
    """FPDT's attention with ``F.scaled_dot_product_attention``'s signature; never holds an ``[S, S]`` matrix.

    Args:
        query: ``[B, H, S, D]``.
        key: ``[B, H_kv, S, D]``, ``H_kv`` dividing ``H`` (GQA/MQA: each kv head serves ``H / H_kv``
            query heads, without expanding the whole tensor).
        value: like ``key``.
        attn_mask: boolean ``[B or 1, 1 or H, S, S]`` (True = attend); every query must see at
            least one key (as :func:`plait.ulysses_sp.masks.global_mask` builds it).
        dropout_p: must be 0 (attention dropout is not supported).
        is_causal: the causal triangle (combined with ``attn_mask`` if both are given).
        scale: softmax scale (default ``1/sqrt(D)``).
        chunk: tokens per sequence chunk (the block is ``chunk x chunk`` scores per head).
        **kwargs: ``enable_gqa`` is accepted (GQA is always on); anything else is refused.

    Returns:
        ``[B, H, S, D]`` in ``query``'s dtype (softmax and accumulation in fp32).

    Raises:
        ValueError: dropout, a float mask, shapes that disagree, or ``chunk`` < 1 (named).
    """
    _check(query, key, value, attn_mask, dropout_p, chunk, kwargs)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    sizes = chunk_sizes(query.shape[2], math.ceil(query.shape[2] / chunk))
    return _ChunkedAttention.apply(query, key, value, attn_mask, bool(is_causal), float(scale), sizes)


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           dropout_p: float, chunk: int, kwargs: dict[str, Any]) -> None:
    unknown = set(kwargs) - {"enable_gqa"}
    if unknown:
        raise ValueError(f"chunked_attention got unsupported arguments {sorted(unknown)}.")
    if dropout_p:
        raise ValueError(f"chunked_attention(dropout_p={dropout_p}) is not supported; set the model's "
                         "attention dropout to 0 or use inner_attention='sdpa'.")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunked_attention(chunk={chunk!r}) must be a positive int (tokens per chunk).")
    if query.dim() != 4 or key.shape != value.shape or key.dim() != 4 or query.shape[2] != key.shape[2] \
            or query.shape[1] % key.shape[1] or query.shape[0] != key.shape[0]:
        raise ValueError(f"chunked_attention wants q [B, H, S, D] and k, v [B, H_kv, S, D] with H_kv dividing H; "
                         f"got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}.")
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"chunked_attention's attn_mask must be boolean (True = attend), got {mask.dtype}.")


def fpdt_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, *, chunk: int = 1024,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """:func:`chunked_attention` in transformers' attention-function form (``[B, S, H, D]`` out).

    Args:
        module: the HF attention module (its ``is_causal`` is the default).
        query: ``[B, H, S, D]``.
        key: ``[B, H_kv, S, D]``.
        value: like ``key``.
        attention_mask: boolean ``[B, 1, S, S]`` or ``None``.
        dropout: must be 0.
        scaling: softmax scale.
        is_causal: overrides ``module.is_causal``.
        chunk: tokens per sequence chunk.
        **kwargs: transformers' extra arguments (ignored).
    """
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = chunked_attention(query, key, value, attention_mask, dropout, causal, scaling, chunk=chunk)
    return out.transpose(1, 2), None
