"""A split master as a whole: reading, assembling and storing the :class:`MasterPiece` s of one
fp32 master that the ZeRO placement on NVMe cut into pieces of ``sub_group_size`` elements.

Between steps each piece lives in the store (or, after a failed write, in its
:attr:`MasterPiece.own`). Readers outside the step (checkpoints, ``optimizer.state_dict()``,
``masters()``) get the master and its state assembled whole in tensors of their own; the next
step (or ``flush``) stores the pieces' slices of it again and drops the whole.
"""

from __future__ import annotations

import torch
from torch import Tensor

from plait.offload_io.buffers import aligned_like
from plait.offload_io.errors import OffloadDiskFullError, OffloadIOError
from plait.offload_io.store import StateStore
from plait.offload_io.subgroups import MASTER_KEY, MasterPiece


def piece_views(store: StateStore, piece: MasterPiece) -> tuple[dict[str, Tensor], bool]:
    """A piece's tensors, from :attr:`MasterPiece.own` or borrowed from ``store`` (then the
    second value is True and the caller puts it back)."""
    if piece.own is not None:
        return piece.own, False
    return store.get(piece.id), True


def read_pieces(store: StateStore, pieces: list[MasterPiece], out: Tensor, stepping: object) -> None:
    """Copy a split master into ``out`` piece by piece; ``stepping`` is the piece installed now
    (its values are the master's data, not the store's)."""
    flat = out.view(-1)
    for piece in pieces:
        if piece is stepping:
            flat[piece.start:piece.end].copy_(piece.masters[0].data)
            continue
        views, borrowed = piece_views(store, piece)
        flat[piece.start:piece.end].copy_(views[f"0.{MASTER_KEY}"])
        if borrowed:
            store.put(piece.id, dirty=False)


def assemble(store: StateStore, pieces: list[MasterPiece], *, with_state: bool = True) -> None:
    """Bring a split master (and with ``with_state`` its optimizer state) into memory whole, in
    tensors of its own; its pieces then slice it (:meth:`MasterPiece.tensor_state`)."""
    first = pieces[0]
    master = first.masters[0]
    whole = aligned_like(torch.empty(first.full_shape, dtype=torch.float32))
    state: dict[str, Tensor] = {}
    for piece in pieces:
        views, borrowed = piece_views(store, piece)
        for name, tensor in views.items():
            key = name.split(".", 1)[1]
            if key == MASTER_KEY:
                whole.view(-1)[piece.start:piece.end].copy_(tensor)
            elif not with_state:
                continue
            elif tensor.shape == (piece.numel,):  # elementwise state, a slice of the whole
                if key not in state:
                    state[key] = torch.empty(first.full_shape, dtype=tensor.dtype)
                state[key].view(-1)[piece.start:piece.end].copy_(tensor)
            else:  # a per-piece scalar (the step counter): equal in every piece
                state.setdefault(key, tensor.clone())
        if borrowed:
            store.put(piece.id, dirty=False)
    master.data = whole
    if with_state:
        first.inner.state[master].update(state)
    for piece in pieces:
        piece.installed, piece.own, piece.masters_out = False, None, False


def store_whole(store: StateStore, pieces: list[MasterPiece], held: set,
                errors: list[OffloadIOError] | None) -> None:
    """Register every piece of a split master held whole in memory, then drop the whole.

    A piece the store cannot take (disk full) keeps clones of its slice in
    :attr:`MasterPiece.own` and its id stays in ``held``; the error is appended to ``errors``, or
    raised after the other pieces were handled when ``errors`` is None.
    """
    failure: OffloadDiskFullError | None = None
    for piece in pieces:
        current = piece.tensor_state()
        try:
            store.register(piece.id, current)
        except OffloadDiskFullError as exc:
            piece.own = {name: tensor.clone() for name, tensor in current.items()}
            held.add(piece.id)
            failure = failure or exc
            continue
        held.discard(piece.id)
    drop_whole(pieces)
    if failure is not None:
        if errors is None:
            raise failure
        errors.append(failure)


def drop_whole(pieces: list[MasterPiece]) -> None:
    """Forget a split master's whole value and state (its pieces hold them): the placeholder
    again, without touching a piece's :attr:`MasterPiece.own`."""
    master = pieces[0].masters[0]
    entry = pieces[0].inner.state.get(master)
    if entry:
        for key in [k for k, v in entry.items() if torch.is_tensor(v)]:
            del entry[key]
    master.data = torch.zeros((), dtype=master.dtype).expand(pieces[0].full_shape)
    for piece in pieces:
        piece.installed, piece.masters_out = False, True


__all__ = ["assemble", "drop_whole", "piece_views", "read_pieces", "store_whole"]
