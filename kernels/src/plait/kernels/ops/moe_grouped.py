"""The Mixture-of-Experts grouped gated-MLP GEMM, forward and backward, for training and serving.

After the token permutation (:mod:`plait.kernels.ops.moe_permute`) the rows of one expert form one
contiguous segment. :func:`grouped_gated_mlp` runs every expert's gated MLP
``down(act(gate(x)) * up(x))`` on its segment, with the stacked weight layout of vLLM, Liger and
HF transformers 5.x (``w_gate_up [E, 2I, H]``: gate rows then up rows; ``w_down [E, H, I]``).
plait-moe-layers (training) and plait-inference-kernels (serving) both call it.

**Precision of the activation** (``precision``, the one place training and serving differ):

* ``"input"`` (training, the default): gate and up are the GEMM outputs in the input dtype, and
  ``act(gate) * up`` is computed as eager torch computes it there (each op rounded to the input
  dtype). This is what HF transformers' experts compute, so converted models keep their logits.
* ``"fp32"`` (serving): ``act(gate) * up`` is computed in fp32 and rounded once to the input dtype
  before the down GEMM. The Triton kernel applies it to its fp32 accumulators; the reference to
  the GEMM outputs upcast. This is plait-inference-kernels' and vLLM's fused-MoE numerics.

For fp32 inputs the two are the same computation. The backward takes the local derivative of the
same formula on both paths: :func:`gate_product_backward`, the ops autograd runs for
:func:`gate_product`, written into one gradient buffer (bitwise autograd's result).

**Paths.** CUDA tensors run the Triton kernels of :mod:`plait.kernels.ops.moe_grouped_triton`
(two grouped GEMMs forward with the activation fused into the first one's epilogue; three
grouped GEMMs and two per-expert weight-gradient reductions backward). Elsewhere (and with
``PLAIT_KERNEL_BACKEND=reference``) torch runs (:func:`grouped_gated_mlp_torch`): on CPU one GEMM
pair per expert (fp32 on oneDNN, which uses AVX-512 where torch's fp32 ``mm`` calls MKL, and MKL
runs only its AVX2 code on non-Intel CPUs: see :func:`linear_nt`) with that expert's activation
between them, and a hand-written backward, also expert by expert, that writes each expert's weight
gradient into one stacked gradient; on
CUDA without Triton torch's grouped GEMM (``F.grouped_mm``) over the
segments' offsets where its 16-byte stride rule holds, else the segments zero-padded into one
``[E, max_rows, H]`` buffer run as two ``torch.bmm`` (falling back to the loop once the padding
would exceed ``MAX_PADDING_FACTOR`` times the real rows). The reference
(:func:`grouped_gated_mlp_reference`, the test oracle) loops over the experts with ``F.linear``
and takes autograd's backward. Every path gives an expert that got no rows a zero weight
gradient rather than none (distributed gradient reductions then see the same tensors on every
rank).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from plait.kernels import dispatch

MAX_PADDING_FACTOR = 4
"""The grouped path pads to at most this many times the real rows, else it loops (see module doc)."""

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes torch's grouped GEMM and the Triton kernels take; others (float64 in tests) use torch."""

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
"""Gate activations: SwiGLU (``silu``), GeGLU with erf (``gelu``) or tanh (``gelu_tanh``) GELU."""

PRECISIONS = ("input", "fp32")
"""Where ``act(gate) * up`` is computed: in the input dtype (training) or fp32 (serving); see above."""


def _activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


def gate_product(gate_up: torch.Tensor, activation: str = "silu", precision: str = "input") -> torch.Tensor:
    """``act(gate) * up`` of ``gate_up`` ``[..., 2I]`` (gate columns first), in ``gate_up``'s dtype.

    Args:
        gate_up: the first GEMM's output.
        activation: one of :data:`ACTIVATIONS`.
        precision: one of :data:`PRECISIONS` (see the module docstring).

    Returns:
        ``[..., I]`` in ``gate_up.dtype``.
    """
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if precision == "fp32" and gate_up.dtype != torch.float32:
        return (_activate(gate.float(), activation) * up.float()).to(gate_up.dtype)
    return _activate(gate, activation) * up


def _activation_backward(grad: torch.Tensor, gate: torch.Tensor, activation: str) -> torch.Tensor:
    """torch's own backward of :func:`_activate` (what autograd runs for it)."""
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, gate)
    return torch.ops.aten.gelu_backward(grad, gate, approximate="tanh" if activation == "gelu_tanh" else "none")


def gate_product_backward(gate_up: torch.Tensor, d_act: torch.Tensor, activation: str = "silu",
                          precision: str = "input") -> tuple[torch.Tensor, torch.Tensor]:
    """The activation's backward: ``(act, d_gate_up)`` for ``act = gate_product(gate_up)``.

    The ops autograd runs for :func:`gate_product` (``d_up = d_act * act(gate)``,
    ``d_gate = act'(gate) * (d_act * up)`` by torch's own ``silu_backward``/``gelu_backward``), each
    written straight into its half of one ``[N, 2I]`` gradient: autograd's slice backward would
    allocate and zero-fill two ``[N, 2I]`` tensors and add them, the largest non-GEMM cost of the
    CPU backward at hundreds of rows per expert. ``act`` (needed by the down weight's gradient)
    reuses ``act(gate)``. The ``"fp32"`` precision on a lower dtype runs the same steps in fp32.

    Args:
        gate_up: ``[N, 2I]`` the first GEMM's output (gate columns first).
        d_act: ``[N, I]`` gradient of ``act``.
        activation, precision: as :func:`gate_product`.

    Returns:
        ``act`` ``[N, I]`` and ``d_gate_up`` ``[N, 2I]``, both in ``gate_up``'s dtype.
    """
    inter = d_act.shape[-1]
    d_gate_up = torch.empty_like(gate_up)
    if precision == "fp32" and gate_up.dtype != torch.float32:
        # autograd's steps of the fp32 formula, in fp32, each half rounded once into d_gate_up (no
        # autograd here: this also runs inside the custom op's backward, where autograd is off).
        gate, up, d_act = gate_up[..., :inter].float(), gate_up[..., inter:].float(), d_act.float()
        activated = _activate(gate, activation)
        d_gate_up[..., inter:] = d_act * activated
        d_gate_up[..., :inter] = _activation_backward(d_act * up, gate, activation)
        return (activated * up).to(gate_up.dtype), d_gate_up
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    activated = _activate(gate, activation)
    torch.mul(d_act, activated, out=d_gate_up[..., inter:])
    d_activated = d_act * up
    if activation == "silu":
        torch.ops.aten.silu_backward.grad_input(d_activated, gate, grad_input=d_gate_up[..., :inter])
    else:
        torch.ops.aten.gelu_backward.grad_input(d_activated, gate, approximate="tanh" if activation == "gelu_tanh"
                                                else "none", grad_input=d_gate_up[..., :inter])
    return activated.mul_(up), d_gate_up


def check_grouped_inputs(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                         w_down: torch.Tensor, activation: str, precision: str = "input") -> None:
    """Refuse inconsistent grouped-MLP inputs before any work (see :func:`grouped_gated_mlp`)."""
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(
            f"x must be [N, H], w_gate_up [E, 2I, H] and w_down [E, H, I]; got {tuple(x.shape)}, "
            f"{tuple(w_gate_up.shape)}, {tuple(w_down.shape)}."
        )
    experts, two_inter, hidden = w_gate_up.shape
    if two_inter % 2 or hidden != x.shape[1] or tuple(w_down.shape) != (experts, hidden, two_inter // 2):
        raise ValueError(
            f"w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} do not fit x {tuple(x.shape)}: "
            f"need w_gate_up [E, 2I, H={x.shape[1]}] (gate rows first) and w_down [E, H, I]."
        )
    if counts.dim() != 1 or counts.numel() != experts:
        raise ValueError(f"counts must be [E={experts}] rows per expert, got shape {tuple(counts.shape)}.")
    if not torch.compiler.is_compiling():  # a data-dependent read: under compile the op checks it on real data
        check_counts_sum(counts, x.shape[0])
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; use one of {', '.join(ACTIVATIONS)}.")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported; use 'input' (training numerics) or "
                         "'fp32' (serving numerics).")


def check_counts_sum(counts: torch.Tensor, rows: int) -> None:
    """Refuse counts that do not add up to the rows of ``x`` (one read of the counts)."""
    total = int(counts.sum())
    if total != rows:
        raise ValueError(f"counts sum to {total} but x has {rows} rows; they must match.")


def grouped_gated_mlp_reference(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                                w_down: torch.Tensor, activation: str = "silu",
                                precision: str = "input") -> torch.Tensor:
    """Per-expert loop over contiguous segments (the oracle; inputs not validated).

    Args and Returns: as :func:`grouped_gated_mlp`.
    """
    outputs = []
    start = 0
    # unbind: one gradient stack per weight in backward (indexing w[e] would add a full-size
    # zero gradient per expert).
    for count, w_gu, w_d in zip(counts.tolist(), w_gate_up.unbind(0), w_down.unbind(0)):
        if count == 0:
            continue
        act = gate_product(F.linear(x[start:start + count], w_gu), activation, precision)
        outputs.append(F.linear(act, w_d))
        start += count
    if not outputs:
        # No rows: keep x and the weights in the graph so their gradients are zeros, not None.
        return x.new_zeros(0, w_down.shape[1]) + 0 * (x.sum() + w_gate_up.sum() + w_down.sum())
    return torch.cat(outputs)


def _padded_rows(counts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Row index of each segment row inside the ``[E * max_rows]`` padded buffer."""
    max_rows = int(counts.max()) if counts.numel() else 0
    starts = torch.cumsum(counts, 0) - counts
    expert_of_row = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    position = torch.arange(expert_of_row.numel(), device=counts.device) - starts[expert_of_row]
    return expert_of_row * max_rows + position, max_rows


def _grouped_mm_fits(x: torch.Tensor, inter: int) -> bool:
    """torch's grouped GEMM exists here and its operands meet its 16-byte stride rule."""
    size = x.element_size()
    return (hasattr(F, "grouped_mm") and x.dtype in GROUPED_MM_DTYPES and x.is_contiguous()
            and (x.shape[1] * size) % 16 == 0 and (inter * size) % 16 == 0)


def _segments(counts: list[int]) -> list[tuple[int, int, int]]:
    """``(expert, start, end)`` of every non-empty segment."""
    bounds, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            bounds.append((expert, start, start + count))
        start += count
    return bounds


def _onednn_linear() -> Any:
    """oneDNN's dense fp32 ``x @ w.T`` (``torch.ops.mkldnn._linear_pointwise``), or ``None``.

    Why: torch's fp32 ``mm`` on CPU calls MKL's sgemm, which on non-Intel CPUs runs its AVX2 code
    (on the benchmark machine, an AMD EPYC with AVX-512, about 100 GFLOP/s per core); oneDNN uses
    AVX-512 there (about 230 GFLOP/s). Both are IEEE fp32 (no TF32/BF32 shortcut); they sum in
    different orders, so results differ by fp32 rounding. bf16/fp16 ``mm`` already runs oneDNN.
    """
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):  # a torch built without the op
        return None


_ONEDNN_LINEAR = _onednn_linear()


def linear_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` (any strides), the CPU path's GEMM: oneDNN for CPU fp32 where torch has it (see
    :func:`_onednn_linear`) unless ``torch.backends.mkldnn`` is switched off, else torch's ``matmul``."""
    if (_ONEDNN_LINEAR is not None and a.dtype == torch.float32 and a.device.type == "cpu" and a.numel()
            and torch._C._get_mkldnn_enabled()):
        return _ONEDNN_LINEAR(a, b, None, "none", [], "")
    return a @ b.t()


def _rows(parts: list[torch.Tensor], like: torch.Tensor, width: int) -> torch.Tensor:
    """The segments' outputs as one ``[N, width]`` tensor."""
    return torch.cat(parts) if parts else like.new_empty(0, width)


def _expert_forward(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: str,
                    precision: str, in_place: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's ``(out, gate_up)`` on its rows. ``in_place`` (no autograd) runs SiLU-and-multiply
    on the GEMM output itself where that gives the same bits (two fewer ``[n, I]`` temporaries)."""
    gate_up = linear_nt(x, w_gate_up)
    inter = w_down.shape[1]
    if in_place and activation == "silu" and (precision == "input" or x.dtype == torch.float32):
        act = F.silu(gate_up[:, :inter], inplace=True).mul_(gate_up[:, inter:])
    else:
        act = gate_product(gate_up, activation, precision)
    return linear_nt(act, w_down), gate_up


def _segment_forward(x: torch.Tensor, segments: list[tuple[int, int, int]], w_gate_up: torch.Tensor,
                     w_down: torch.Tensor, activation: str, precision: str,
                     in_place: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The CPU forward: ``(out, gate_up of each segment)``, one expert after another (its rows'
    ``[n, 2I]`` intermediates stay in cache between its two GEMMs; only ``[N, H]`` is concatenated)."""
    outs, gate_ups = [], []
    for expert, start, end in segments:
        out, gate_up = _expert_forward(x[start:end], w_gate_up[expert], w_down[expert], activation, precision,
                                       in_place)
        outs.append(out)
        gate_ups.append(gate_up)
    return _rows(outs, x, w_down.shape[1]), gate_ups


class _SegmentGatedMLP(torch.autograd.Function):
    """The CPU path: one expert after another, its GEMM pair on its segment (oneDNN for fp32, see
    :func:`_onednn_linear`) with the activation between them, and a backward that writes each
    expert's weight gradient into one stacked gradient (no per-expert zero tensors, gathers or sums).

    Per expert rather than per op over all rows: the ``[n, 2I]`` and ``[n, I]`` intermediates of one
    expert stay in cache between the GEMMs and their activation, and only the ``[N, H]`` outputs
    (and input gradients) are concatenated, not ``[N, 2I]`` buffers (oneDNN writes every GEMM into
    its own new tensor).

    torch's CPU ``grouped_mm`` runs one MKL ``mm`` per group too, on strided views with extra
    copies and zero fills, and its backward does the same: measured 1.3x slower than the MKL
    version of this path on the benchmark shape (``plait bench moe-layers``).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: list[int], w_gate_up: torch.Tensor, w_down: torch.Tensor,
                activation: str, precision: str) -> torch.Tensor:
        segments = _segments(counts)
        out, gate_ups = _segment_forward(x, segments, w_gate_up, w_down, activation, precision, in_place=False)
        ctx.save_for_backward(x, w_gate_up, w_down, *gate_ups)
        ctx.segments, ctx.activation, ctx.precision = segments, activation, precision
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, None, None]:
        x, w_gate_up, w_down, *gate_ups = ctx.saved_tensors
        d_x, d_w_gate_up, d_w_down = segment_backward(grad, x, ctx.segments, w_gate_up, w_down, gate_ups,
                                                      ctx.activation, ctx.precision)
        return d_x, None, d_w_gate_up, d_w_down, None, None


def segment_backward(grad: torch.Tensor, x: torch.Tensor, segments: list[tuple[int, int, int]],
                     w_gate_up: torch.Tensor, w_down: torch.Tensor, gate_ups: list[torch.Tensor], activation: str,
                     precision: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU backward, expert by expert, from each segment's forward ``gate_up``.

    Returns:
        ``(d_x, d_w_gate_up, d_w_down)``; an expert without rows gets a zero weight gradient.
    """
    grad = grad.contiguous()
    d_w_gate_up, d_w_down = _stacked_grad(w_gate_up, segments), _stacked_grad(w_down, segments)
    d_x = []
    for (expert, start, end), gate_up in zip(segments, gate_ups):
        rows_grad = grad[start:end]
        d_act = linear_nt(rows_grad, w_down[expert].t())
        act, d_gate_up = gate_product_backward(gate_up, d_act, activation, precision)
        _weight_grad(d_w_down[expert], rows_grad, act)
        d_x.append(linear_nt(d_gate_up, w_gate_up[expert].t()))
        _weight_grad(d_w_gate_up[expert], d_gate_up, x[start:end])
    return _rows(d_x, x, x.shape[1]), d_w_gate_up, d_w_down


ONEDNN_MIN_ROWS = 32
"""Weight-gradient GEMMs over fewer rows run as torch ``mm`` straight into the stacked gradient:
there the GEMM is small and copying oneDNN's separate output in would cost more than oneDNN
saves (the two break even near 32 rows on the benchmark machine)."""


def _stacked_grad(weight: torch.Tensor, segments: list[tuple[int, int, int]]) -> torch.Tensor:
    """``weight``-shaped gradient to fill expert by expert; zeros only where an expert got no rows."""
    return weight.new_empty(weight.shape) if len(segments) == weight.shape[0] else weight.new_zeros(weight.shape)


def _weight_grad(out: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """``out = left.T @ right`` (one expert's weight gradient, written into the stacked gradient)."""
    if left.shape[0] < ONEDNN_MIN_ROWS:
        torch.mm(left.t(), right, out=out)
    else:
        out.copy_(linear_nt(left.t(), right.t()))


TORCH_METHODS = ("segments", "grouped_mm", "padded_bmm")
"""The torch path's ways of running the GEMMs (see :func:`grouped_gated_mlp_torch`)."""


def grouped_gated_mlp_torch(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                            activation: str = "silu", precision: str = "input", *,
                            method: str | None = None) -> torch.Tensor:
    """The torch path of :func:`grouped_gated_mlp` whatever the device (inputs not validated).

    Args:
        x, w_gate_up, w_down, activation, precision: as :func:`grouped_gated_mlp`.
        counts: ``[E]`` int64 rows per expert.
        method: ``"segments"`` (one GEMM pair per expert into shared buffers; the default on CPU),
            ``"grouped_mm"`` (torch's grouped GEMM where its stride rule holds, else the padded
            path; the default on CUDA) or ``"padded_bmm"`` (zero-padded batched GEMMs, falling back to the loop past
            ``MAX_PADDING_FACTOR``; CUDA otherwise). ``None`` picks the default.

    Returns:
        ``[N, H]`` in ``x``'s dtype.
    """
    experts, hidden, inter = w_down.shape
    if method is None:
        method = "grouped_mm" if x.is_cuda else "segments"
    if method == "segments":
        if torch.is_grad_enabled() and (x.requires_grad or w_gate_up.requires_grad or w_down.requires_grad):
            return _SegmentGatedMLP.apply(x, counts.tolist(), w_gate_up, w_down, activation, precision)
        return _segment_forward(x, _segments(counts.tolist()), w_gate_up, w_down, activation, precision,
                                in_place=True)[0]
    if method == "grouped_mm" and _grouped_mm_fits(x, inter):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        gate_up = F.grouped_mm(x, w_gate_up.transpose(1, 2), offs=offsets)
        return F.grouped_mm(gate_product(gate_up, activation, precision), w_down.transpose(1, 2), offs=offsets)
    rows, max_rows = _padded_rows(counts)
    if experts * max_rows > MAX_PADDING_FACTOR * max(x.shape[0], 1):
        return grouped_gated_mlp_reference(x, counts, w_gate_up, w_down, activation, precision)
    padded = x.new_zeros(experts * max_rows, hidden).index_copy(0, rows, x).view(experts, max_rows, hidden)
    act = gate_product(torch.bmm(padded, w_gate_up.transpose(1, 2)), activation, precision)
    out = torch.bmm(act, w_down.transpose(1, 2)).reshape(experts * max_rows, hidden)
    return out.index_select(0, rows)


@torch.library.custom_op("plait::grouped_gated_mlp", mutates_args=())
def _grouped_op(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                activation: str, precision: str, use_triton: bool) -> torch.Tensor:
    # A custom op, opaque to torch.compile: the CPU path reads the counts on the host.
    check_counts_sum(counts, x.shape[0])
    if use_triton:
        from plait.kernels.ops.moe_grouped_triton import grouped_forward_triton

        return grouped_forward_triton(x, counts, w_gate_up, w_down, activation, precision)
    with torch.no_grad():  # the backward is registered below; nothing to record here
        return grouped_gated_mlp_torch(x, counts, w_gate_up, w_down, activation, precision)


@_grouped_op.register_fake
def _grouped_fake(x, counts, w_gate_up, w_down, activation, precision, use_triton):
    return x.new_empty(x.shape[0], w_down.shape[1])


@torch.library.custom_op("plait::grouped_gated_mlp_backward", mutates_args=())
def _grouped_backward_op(grad: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                         w_down: torch.Tensor, activation: str, precision: str,
                         use_triton: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton:
        from plait.kernels.ops.moe_grouped_triton import grouped_backward_triton

        return grouped_backward_triton(grad, x, counts, w_gate_up, w_down, activation, precision)
    # The op keeps no intermediates, so each segment's gate_up is recomputed: the same GEMM on the
    # same operands, hence the same bits as the forward's (CUDA without Triton gets the same formula,
    # not the bits of autograd through grouped_mm).
    segments = _segments(counts.tolist())
    gate_ups = [linear_nt(x[start:end], w_gate_up[expert]) for expert, start, end in segments]
    return segment_backward(grad, x, segments, w_gate_up, w_down, gate_ups, activation, precision)


@_grouped_backward_op.register_fake
def _grouped_backward_fake(grad, x, counts, w_gate_up, w_down, activation, precision, use_triton):
    return torch.empty_like(x), torch.empty_like(w_gate_up), torch.empty_like(w_down)


def _grouped_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, counts, w_gate_up, w_down, activation, precision, use_triton = inputs
    ctx.save_for_backward(x, counts, w_gate_up, w_down)
    ctx.config = (activation, precision, use_triton)


def _grouped_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    x, counts, w_gate_up, w_down = ctx.saved_tensors
    d_x, d_w_gate_up, d_w_down = torch.ops.plait.grouped_gated_mlp_backward(grad, x, counts, w_gate_up, w_down,
                                                                            *ctx.config)
    return d_x, None, d_w_gate_up, d_w_down, None, None, None


_grouped_op.register_autograd(_grouped_backward, setup_context=_grouped_setup)


def run_grouped(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                activation: str, precision: str, *, use_triton: bool) -> torch.Tensor:
    """Run validated inputs through ``plait::grouped_gated_mlp``, or in eager training its autograd Function.

    Eager with gradients keeps the autograd Functions (:class:`_SegmentGatedMLP` keeps each segment's
    ``gate_up``: one GEMM fewer than the op's recompute, same bits). Otherwise the op runs.

    Args:
        x, counts, w_gate_up, w_down, activation, precision: as :func:`grouped_gated_mlp`
            (``counts`` int64 on ``x``'s device).
        use_triton: run the Triton kernels (else the torch path).

    Returns:
        ``[N, H]`` in ``x``'s dtype.
    """
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or w_gate_up.requires_grad or w_down.requires_grad)
    if needs_grad and not torch.compiler.is_compiling():
        if use_triton:
            from plait.kernels.ops import moe_grouped_triton

            return moe_grouped_triton.grouped_gated_mlp_triton(x, counts, w_gate_up, w_down, activation, precision)
        return grouped_gated_mlp_torch(x, counts, w_gate_up, w_down, activation, precision)
    return torch.ops.plait.grouped_gated_mlp(x, counts, w_gate_up, w_down, activation, precision, use_triton)


def grouped_gated_mlp(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                      *, activation: str = "silu", precision: str = "input") -> torch.Tensor:
    """Every expert's gated MLP on its contiguous segment of ``x``, as grouped GEMMs.

    ``out[rows of e] = down_e(act(gate_e(x)) * up_e(x))`` where the rows of expert ``e`` are
    ``x[sum(counts[:e]) : sum(counts[:e+1])]`` (see
    :func:`~plait.kernels.ops.moe_permute.permute_by_expert`).

    Args:
        x: ``[N, H]`` rows sorted by expert.
        counts: ``[E]`` integer rows per expert, summing to ``N``.
        w_gate_up: ``[E, 2I, H]``, gate rows then up rows, ``x``'s dtype.
        w_down: ``[E, H, I]``, ``x``'s dtype.
        activation: one of :data:`ACTIVATIONS`.
        precision: ``"input"`` (training: HF's eager numerics) or ``"fp32"`` (serving: the
            activation in fp32); see the module docstring.

    Returns:
        ``[N, H]`` in ``x``'s dtype; differentiable in ``x`` and both weights.

    Raises:
        ValueError: inconsistent shapes, counts that do not sum to ``N``, an unknown activation
            or precision.
    """
    check_grouped_inputs(x, counts, w_gate_up, w_down, activation, precision)
    counts = counts.to(device=x.device, dtype=torch.int64)
    # No rows: nothing to launch (a zero-size grid); the torch path returns the empty graph.
    use_triton = (dispatch.select_backend(x, w_gate_up, w_down) == dispatch.TRITON and x.dtype in GROUPED_MM_DTYPES
                  and w_gate_up.dtype == x.dtype == w_down.dtype and x.shape[0] > 0)
    return run_grouped(x, counts, w_gate_up, w_down, activation, precision, use_triton=use_triton)
