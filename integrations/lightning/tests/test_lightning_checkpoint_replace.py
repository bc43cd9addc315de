"""Rewriting a checkpoint path never leaves it empty: the old checkpoint stays until the new commits.

Lightning saves ``last.ckpt`` (``ModelCheckpoint(save_last=True)``) and a user's fixed
``trainer.save_checkpoint(path)`` to the same path again and again; a job killed during that save
must still find the previous checkpoint there.
"""

from __future__ import annotations

import pytest
import torch

from plait import universal_ckpt
from plait.lightning import checkpoint as ckpt


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((4, 3), value)}, "meta": {"value": value}}


def _loaded(path) -> float:
    state = _state(0.0)
    ckpt.load_directory(path, state)
    assert torch.equal(state["model"]["w"], torch.full((4, 3), state["meta"]["value"]))
    return state["meta"]["value"]


def _leftovers(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("atomic", [True, False], ids=["renameat2", "two-renames"])
def test_a_rewrite_replaces_the_checkpoint_and_leaves_nothing_beside_it(tmp_path, monkeypatch, atomic):
    if not atomic:
        monkeypatch.setattr(ckpt, "_exchange", lambda a, b: False)
    path = tmp_path / "last.ckpt"
    ckpt.save_directory(path, _state(1.0), step=1)
    step_dir = ckpt.save_directory(path, _state(2.0), step=2)
    assert step_dir.parent == path and step_dir.is_dir()
    assert _loaded(path) == 2.0 and [p.name for p in path.glob("step-*")] == [step_dir.name]
    ckpt.save_directory(path, _state(3.0), step=2)  # the same step again (end of training after validation)
    assert _loaded(path) == 3.0
    assert _leftovers(tmp_path) == []


def test_a_save_that_fails_part_way_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    ckpt.save_directory(path, _state(1.0), step=1)
    real_save = universal_ckpt.save

    def dies_after_writing(state, root, **kwargs):
        handle = real_save(state, root, **kwargs)
        handle.wait()
        raise OSError("killed after writing, before the swap")

    monkeypatch.setattr(universal_ckpt, "save", dies_after_writing)
    with pytest.raises(OSError, match="before the swap"):
        ckpt.save_directory(path, _state(2.0), step=2)
    assert _loaded(path) == 1.0  # what was there is still there, whole
    monkeypatch.setattr(universal_ckpt, "save", real_save)
    ckpt.save_directory(path, _state(3.0), step=3)  # the next save clears the half-done one
    assert _loaded(path) == 3.0 and _leftovers(tmp_path) == []


def test_a_file_or_link_at_the_path_is_replaced_too(tmp_path):
    target = tmp_path / "epoch=0-step=1.ckpt"
    ckpt.save_directory(target, _state(1.0), step=1)
    link = tmp_path / "last.ckpt"
    link.symlink_to(target)  # what save_last="link" leaves
    ckpt.save_directory(link, _state(2.0), step=2)
    assert not link.is_symlink() and _loaded(link) == 2.0
    assert _loaded(target) == 1.0  # the link's target is not touched
    plain = tmp_path / "weights.ckpt"
    torch.save({"w": 1}, plain)
    ckpt.save_directory(plain, _state(4.0), step=4)
    assert _loaded(plain) == 4.0 and _leftovers(tmp_path) == []


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="renameat2 is Linux's")
def test_the_swap_is_one_atomic_exchange_on_linux(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "from-a").touch()
    assert ckpt._exchange(a, b)  # so the renameat2 case above really took the one-step path
    assert (b / "from-a").exists() and not (a / "from-a").exists()


def _two_ranks_rewrite(root: str) -> float:
    import time

    import torch.distributed as dist

    path = __import__("pathlib").Path(root) / "last.ckpt"
    for step in (1, 2):
        if dist.get_rank() == 1:  # look only once rank 0 has begun writing the new directory,
            deadline = time.monotonic() + 3.0  # or after 3 s where rank 0 waits for this rank first
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        ckpt.save_directory(path, _state(float(step)), step=step)
    return _loaded(path)


def test_two_ranks_take_the_same_branch_whoever_looks_first(tmp_path):
    from plait.kernels.testing import run_distributed

    assert run_distributed(_two_ranks_rewrite, 2, str(tmp_path), timeout=90) == [2.0, 2.0]
    assert _leftovers(tmp_path / "last.ckpt") == [] and _leftovers(tmp_path) == []
