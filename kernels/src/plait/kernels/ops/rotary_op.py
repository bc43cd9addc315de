"""RoPE as ``torch.library`` custom ops, for torch.compile.

``plait::rotary`` rotates one ``[..., heads, head_size]`` tensor out of place (by ``theta``, or by
``-theta`` with ``inverse``) and is its own backward: the gradient of a rotation is the inverse
rotation of the gradient. ``plait::rotary_`` rotates in place (inference). Both have shape-only
fakes, so dynamo and inductor keep each as one opaque call with no data-dependent guard.

Positions are checked against the angle table inside the ops, on the real tensors, when asked:
under torch.compile the public functions cannot read the positions' range while tracing (a
data-dependent value), so the check moves to run time, still before anything is written.

On the CPU path the ops run :func:`~plait.kernels.ops.rotary.rotate_reference` (and its in-place
forms); the backward is that same arithmetic on the gradient with the sines negated, which is the
order eager autograd computes the reference's gradient in, so compiled and eager gradients are
equal bit for bit.
"""

from __future__ import annotations

import torch

from plait.kernels.ops import rotary


def check_position_range(positions: torch.Tensor, rows: int) -> None:
    """Refuse positions outside ``[0, rows)`` (one device sync on CUDA).

    Raises:
        ValueError: a position indexes outside the angle table.
    """
    if positions.numel():
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= rows:
            raise ValueError(
                f"rotary: positions span [{low}, {high}] but the angle table has {rows} rows; "
                "build a larger cache (rotary_cos_sin(max_positions=...)).")


def _rows(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, token_shape: torch.Size,
          inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    cos_rows = cos[positions].view(*token_shape, -1)
    sin_rows = sin[positions].view(*token_shape, -1)
    return cos_rows, (-sin_rows if inverse else sin_rows)


@torch.library.custom_op("plait::rotary", mutates_args=())
def _rotary_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, rotary_dim: int,
               is_neox: bool, inverse: bool, check_positions: bool, use_triton: bool) -> torch.Tensor:
    if check_positions:
        check_position_range(positions, cos.shape[0])
    if use_triton:
        from plait.kernels.ops.rotary_triton import rotate_copy

        return rotate_copy(x, cos, sin, positions, rotary_dim, is_neox, inverse=inverse)
    cos_rows, sin_rows = _rows(cos, sin, positions, x.shape[:-2], inverse)
    return rotary.rotate_reference(x, cos_rows, sin_rows, rotary_dim, is_neox).contiguous()  # the fake's strides


@_rotary_op.register_fake
def _rotary_fake(x, cos, sin, positions, rotary_dim, is_neox, inverse, check_positions, use_triton):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output) -> None:
    _, cos, sin, positions, rotary_dim, is_neox, inverse, _, use_triton = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.config = (rotary_dim, is_neox, not inverse, use_triton)


def _backward(ctx, grad):
    cos, sin, positions = ctx.saved_tensors
    rotary_dim, is_neox, inverse, use_triton = ctx.config
    # The angle table and the positions are constants: no gradient, as in every RoPE model.
    d_x = torch.ops.plait.rotary(grad, cos, sin, positions, rotary_dim, is_neox, inverse, False, use_triton)
    return d_x, None, None, None, None, None, None, None, None


_rotary_op.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("plait::rotary_", mutates_args=("x",))
def _rotary_inplace_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       rotary_dim: int, is_neox: bool, check_positions: bool, use_triton: bool) -> None:
    if check_positions:
        check_position_range(positions, cos.shape[0])
    if use_triton:
        from plait.kernels.ops.rotary_triton import rotary_inplace_triton

        rotary_inplace_triton(x, None, cos, sin, positions, rotary_dim, is_neox)
        return
    cos_rows, sin_rows = _rows(cos, sin, positions, x.shape[:-2], inverse=False)
    rotary.rotate_in_place_reference(x, cos_rows.unsqueeze(-2), sin_rows.unsqueeze(-2), rotary_dim, is_neox)


@_rotary_inplace_op.register_fake
def _rotary_inplace_fake(x, cos, sin, positions, rotary_dim, is_neox, check_positions, use_triton):
    return None


def rotary_custom(q4: torch.Tensor, k4: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, rotary_dim: int, is_neox: bool, *, in_place: bool, check_positions: bool,
                  use_triton: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RoPE on validated ``[..., heads, head_size]`` views through the custom ops.

    Args:
        q4, k4: the heads of q and k (``k4`` may be None).
        cos, sin: ``[max_positions, rotary_dim/2]`` tables.
        positions: int64 positions, one per token.
        rotary_dim, is_neox: as :func:`~plait.kernels.ops.rotary.apply_rotary`.
        in_place: rotate ``q4``/``k4`` themselves (inference) instead of returning new tensors.
        check_positions: refuse positions outside the table, at run time, before any write.
        use_triton: run the Triton kernel.

    Returns:
        ``(q_out, k_out)``: ``q4``/``k4`` themselves when ``in_place``, else new tensors of their shapes.

    Raises:
        ValueError: a position outside the table (with ``check_positions``).
    """
    # q's op checks the positions before it writes anything, so a bad position leaves q and k as they were.
    if in_place:
        torch.ops.plait.rotary_(q4, cos, sin, positions, rotary_dim, is_neox, check_positions, use_triton)
        if k4 is not None:
            torch.ops.plait.rotary_(k4, cos, sin, positions, rotary_dim, is_neox, False, use_triton)
        return q4, k4
    q_out = torch.ops.plait.rotary(q4, cos, sin, positions, rotary_dim, is_neox, False, check_positions, use_triton)
    k_out = None if k4 is None else torch.ops.plait.rotary(k4, cos, sin, positions, rotary_dim, is_neox, False,
                                                           False, use_triton)
    return q_out, k_out
