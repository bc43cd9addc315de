"""The layout language: how a tensor's consolidated form maps to model-parallel pieces.

A universal checkpoint stores every tensor in its consolidated form (the shape a single-process
model has, vocabulary padding stripped). A :class:`TensorLayout` says how a rank of a
model-parallel group (tensor-, expert- or pipeline-parallel) holds part of it, and
:func:`pieces` turns that into boxes of the consolidated tensor and of the rank's local tensor,
which is all the checkpoint needs: saving writes those boxes, loading reads them back from
whatever boxes another layout wrote. The forms covered:

* replicated (``dim=None``): every rank of the group holds the whole tensor (norms, biases of
  row-parallel layers, and every state of a sequence-parallel run: sequence parallelism splits
  activations, not state). The lowest rank's copy is saved, or with ``average=True`` the mean of
  the group's copies (with its optimizer state), as DeepSpeed's universal checkpoints do for
  TP-replicated tensors that drift apart (``parameter_to_average_patterns``): every rank then
  loads that mean;
* split along ``dim`` (column-parallel: the output dim, 0 of an ``nn.Linear`` weight; row-parallel:
  the input dim, 1), in ``size`` contiguous blocks; the expert dimension of stacked expert weights
  is the same with ``group="ep"``;
* fused sub-parameters (``parts``): GPT-2's ``c_attn`` ``[q|k|v]``, ``gate_up_proj``, GQA's unequal
  ``q``/``k``/``v`` widths; each part is split separately, so rank r holds ``[q_r|k_r|v_r]``;
  splitting such a tensor as one block puts ``q`` and ``k`` rows on the wrong ranks;
* head-interleaved fused QKV (BLOOM's ``query_key_value``: per head ``[q|k|v]``) is a plain split
  whose blocks must fall on head boundaries: ``unit`` (the rows of one head) guards it;
* vocabulary padding (``padded_size``, ``vocab_size``): the model-parallel tensor is
  ``padded_size`` long along ``dim`` (divisible by the group size), the consolidated one
  ``vocab_size``; the rows past it are not saved (stripped) and are zeroed on load (re-padded).
"""

from __future__ import annotations

import dataclasses
from typing import Any

Box = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorLayout:
    """How one tensor is divided over a model-parallel group.

    Attributes:
        dim: the split dimension, or None when every rank of the group holds the whole tensor.
        group: the mesh dimension the split runs over (``"tp"``, ``"ep"``, ...).
        parts: widths along ``dim`` of fused sub-parameters, each split separately (their sum
            is the consolidated size); None for one block.
        unit: split boundaries must be multiples of this many rows of each part (a head's
            rows for fused or interleaved attention weights), so a group size that does not
            divide the heads is refused.
        padded_size: size along ``dim`` of the model-parallel tensor when it carries padding
            (vocabulary-parallel embeddings); None for no padding. Not with ``parts``.
        vocab_size: the consolidated size along ``dim`` of a padded tensor (set with
            ``padded_size``, at most it).
        owned: with ``dim=None``: each rank of ``group`` holds a different whole tensor (experts
            of a ModuleList, renamed to global indices by the ``name_map``), so the group's ranks
            are not replicas of one another.
        average: with ``dim=None``: the group's copies may drift apart (TP-replicated norms whose
            gradients are not all-reduced), and the checkpoint holds their mean, the parameter's
            optimizer state likewise; False saves the lowest rank's copy.
    """

    dim: int | None = None
    group: str = "tp"
    parts: tuple[int, ...] | None = None
    unit: int = 1
    padded_size: int | None = None
    vocab_size: int | None = None
    owned: bool = False
    average: bool = False

    def __post_init__(self) -> None:
        if self.dim is not None and (not isinstance(self.dim, int) or self.dim < 0):
            raise ValueError(f"TensorLayout.dim={self.dim!r} must be a non-negative int or None (replicated).")
        if not isinstance(self.group, str) or not self.group:
            raise ValueError(f"TensorLayout.group={self.group!r} must name a mesh dimension, e.g. 'tp'.")
        if self.parts is not None and (not self.parts or any(not isinstance(w, int) or w < 1 for w in self.parts)):
            raise ValueError(f"TensorLayout.parts={self.parts!r} must be positive widths, e.g. (q, k, v).")
        if not isinstance(self.unit, int) or self.unit < 1:
            raise ValueError(f"TensorLayout.unit={self.unit!r} must be a positive int (rows of one head).")
        if self.padded_size is not None and (not isinstance(self.padded_size, int) or self.padded_size < 1):
            raise ValueError(f"TensorLayout.padded_size={self.padded_size!r} must be a positive int or None.")
        if (self.padded_size is None) != (self.vocab_size is None):
            raise ValueError("TensorLayout: set padded_size and vocab_size together (the padded and the real size).")
        if self.padded_size is not None and (not isinstance(self.vocab_size, int)
                                             or not 1 <= self.vocab_size <= self.padded_size):
            raise ValueError(f"TensorLayout.vocab_size={self.vocab_size!r} must be an int in [1, padded_size="
                             f"{self.padded_size}].")
        if self.padded_size is not None and self.parts is not None:
            raise ValueError("TensorLayout: set padded_size or parts, not both (padding is for one block).")
        if self.owned and self.dim is not None:
            raise ValueError("TensorLayout.owned=True is for whole tensors; leave dim=None (or owned=False).")
        if self.average and (self.dim is not None or self.owned):
            raise ValueError("TensorLayout.average=True is for replicated tensors; leave dim=None and owned=False.")
        if self.dim is None and (self.parts or self.padded_size or self.unit != 1):
            raise ValueError("TensorLayout: parts, unit and padded_size need a split dim; set dim.")

    def to_json(self) -> dict[str, Any]:
        """The layout as a JSON object for the manifest (defaults left out)."""
        body: dict[str, Any] = {"dim": self.dim, "group": self.group}
        if self.parts is not None:
            body["parts"] = list(self.parts)
        if self.unit != 1:
            body["unit"] = self.unit
        if self.padded_size is not None:
            body["padded_size"] = self.padded_size
            body["vocab_size"] = self.vocab_size
        if self.owned:
            body["owned"] = True
        if self.average:
            body["average"] = True
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> TensorLayout:
        """Inverse of :meth:`to_json`."""
        parts = body.get("parts")
        return cls(dim=body.get("dim"), group=body.get("group", "tp"), parts=tuple(parts) if parts else None,
                   unit=body.get("unit", 1), padded_size=body.get("padded_size"), vocab_size=body.get("vocab_size"),
                   owned=body.get("owned", False), average=body.get("average", False))


def describe(pattern: dict | None) -> str:
    """A short human form of a manifest pattern: ``tp:dim1 parts=32+32+32 unit=8``, ``tp:replicated``,
    a DTensor's placements (``dp:_StridedShard(dim=0, sf=2) tp:Shard(dim=0)``), the pipeline stage
    (``pp:stage1``), ``-`` for none."""
    if pattern is None:
        return "-"
    stage = f"pp:stage{'+'.join(map(str, pattern['stages']))}" if pattern.get("stages") else ""
    if "placements" in pattern:
        text = " ".join(f"{dim}:{placement}" for dim, placement in pattern["placements"])
    elif "dim" in pattern:
        text = _describe_layout(TensorLayout.from_json(pattern))
    else:
        text = ""
    return " ".join(t for t in (text, stage) if t) or "-"


def _describe_layout(layout: TensorLayout) -> str:
    if layout.dim is None:
        return f"{layout.group}:{'owned' if layout.owned else 'replicated'}{' averaged' if layout.average else ''}"
    text = f"{layout.group}:dim{layout.dim}"
    if layout.parts:
        text += " parts=" + "+".join(map(str, layout.parts))
    if layout.unit != 1:
        text += f" unit={layout.unit}"
    if layout.padded_size is not None:
        text += f" vocab={layout.vocab_size} padded={layout.padded_size}"
    return text


def global_shape(layout: TensorLayout, local: tuple[int, ...], size: int, *, name: str = "tensor") -> tuple[int, ...]:
    """The consolidated shape of a tensor whose rank-local shape is ``local`` in a group of ``size``.

    Raises:
        ValueError: the local shape does not fit the layout (names the tensor and the fix).
    """
    if layout.dim is None:
        return tuple(local)
    if layout.dim >= len(local):
        raise ValueError(f"{name}: TensorLayout.dim={layout.dim} but the local tensor has shape {list(local)}.")
    out = list(local)
    out[layout.dim] = (layout.vocab_size if layout.padded_size is not None
                       else sum(layout.parts) if layout.parts is not None else local[layout.dim] * size)
    shape = tuple(out)
    if local_shape(layout, shape, size, name=name) != tuple(local):
        raise ValueError(f"{name}: local shape {list(local)} does not match {layout.to_json()} at a "
                         f"{layout.group} size of {size}; fix the layout rule or the group.")
    return shape


def local_shape(layout: TensorLayout, shape: tuple[int, ...], size: int, *, name: str = "tensor") -> tuple[int, ...]:
    """Shape of one rank's tensor when the consolidated ``shape`` is divided ``size`` ways.

    Raises:
        ValueError: the layout does not fit the shape or the group size (names the tensor and fix).
    """
    if layout.dim is None:
        return tuple(shape)
    _check(layout, shape, size, name)
    out = list(shape)
    out[layout.dim] = sum(width // size for width in _widths(layout, shape))
    return tuple(out)


def pieces(layout: TensorLayout, shape: tuple[int, ...], rank: int, size: int, *,
           name: str = "tensor") -> list[tuple[Box, Box]]:
    """The boxes rank ``rank`` of ``size`` holds: ``(box in the consolidated tensor, box in its local tensor)``.

    Padding rows are in no box (they are not part of the consolidated tensor).

    Raises:
        ValueError: the layout does not fit the shape or the group size.
    """
    full = tuple((0, n) for n in shape)
    if layout.dim is None:
        return [(full, full)]
    _check(layout, shape, size, name)
    dim, out, local_at, global_at = layout.dim, [], 0, 0
    for width in _widths(layout, shape):
        chunk = width // size
        start = global_at + rank * chunk
        stop = min(start + chunk, shape[dim]) if layout.padded_size else start + chunk
        if stop > start:
            out.append((_with(full, dim, (start, stop)), _with(full, dim, (local_at, local_at + stop - start))))
        local_at += chunk
        global_at += width
    return out


def padding_box(layout: TensorLayout, shape: tuple[int, ...], rank: int, size: int) -> Box | None:
    """The box of rank ``rank``'s local tensor that is vocabulary padding, or None."""
    if layout.padded_size is None or layout.dim is None:
        return None
    local = local_shape(layout, shape, size)
    held = sum(g[layout.dim][1] - g[layout.dim][0] for g, _ in pieces(layout, shape, rank, size))
    if held == local[layout.dim]:
        return None
    return _with(tuple((0, n) for n in local), layout.dim, (held, local[layout.dim]))


def _widths(layout: TensorLayout, shape: tuple[int, ...]) -> tuple[int, ...]:
    if layout.padded_size is not None:
        return (layout.padded_size,)
    return layout.parts or (shape[layout.dim],)


def _with(box: Box, dim: int, span: tuple[int, int]) -> Box:
    return box[:dim] + (span,) + box[dim + 1:]


def _check(layout: TensorLayout, shape: tuple[int, ...], size: int, name: str) -> None:
    dim = layout.dim
    if dim >= len(shape):
        raise ValueError(f"{name}: TensorLayout.dim={dim} but the tensor has shape {list(shape)}; "
                         f"use a dim below {len(shape)}.")
    if layout.parts is not None and sum(layout.parts) != shape[dim]:
        raise ValueError(f"{name}: TensorLayout.parts={list(layout.parts)} sum to {sum(layout.parts)}, "
                         f"dim {dim} of shape {list(shape)} is {shape[dim]}; give the widths of the fused parts.")
    if layout.padded_size is not None and layout.vocab_size != shape[dim]:
        raise ValueError(f"{name}: TensorLayout.vocab_size={layout.vocab_size} but dim {dim} of the consolidated "
                         f"shape {list(shape)} is {shape[dim]}; give the real (unpadded) size.")
    for width in _widths(layout, shape):
        if width % (size * layout.unit):
            what = f"{width // layout.unit} heads of {layout.unit} rows" if layout.unit > 1 else f"{width} rows"
            raise ValueError(f"{name}: a {layout.group} size of {size} does not divide {what} along dim {dim} "
                             f"(shape {list(shape)}); pick a {layout.group} size that divides it, or pad.")
