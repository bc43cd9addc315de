"""A universal checkpoint as vLLM's ``(name, tensor)`` weight stream: names, values, hashes (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.universal_ckpt import CheckpointIntegrityError, CheckpointLayoutError, save
from plait.universal_ckpt.reader import read_manifest
from plait.vllm.checkpoint_weights import CheckpointWeights


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6)
        self.norm = nn.LayerNorm(6)
        self.register_buffer("scale", torch.arange(3.0))


def _saved(tmp_path):
    torch.manual_seed(0)
    model = _Block()
    save({"model": model}, tmp_path / "ckpt", step=3)
    return model


@pytest.mark.timeout(60)
def test_vllm_checkpoint_weights_stream_state_dict_names_and_values(tmp_path):
    model = _saved(tmp_path)
    weights = CheckpointWeights(tmp_path / "ckpt")  # a root: its latest step is used
    got = dict(weights)
    expected = model.state_dict()
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)
    assert len(weights) == len(expected)


@pytest.mark.timeout(60)
def test_vllm_checkpoint_weights_flipped_byte_names_the_file(tmp_path):
    _saved(tmp_path)
    step = tmp_path / "ckpt" / "step-0000000003"
    manifest = read_manifest(step)
    piece = next(iter(manifest.tensors.values())).pieces[0]
    data = step / piece.file
    raw = bytearray(data.read_bytes())
    raw[piece.offset] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointIntegrityError) as info:
        list(CheckpointWeights(step))
    assert piece.file in str(info.value) and "corrupt" in str(info.value)
    assert info.value.file == piece.file


@pytest.mark.timeout(60)
def test_vllm_checkpoint_weights_unknown_key_says_which_keys_exist(tmp_path):
    _saved(tmp_path)
    with pytest.raises(CheckpointLayoutError, match="'model'"):
        CheckpointWeights(tmp_path / "ckpt", key="policy")
