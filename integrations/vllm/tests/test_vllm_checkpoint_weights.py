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


@pytest.mark.timeout(120)
def test_vllm_checkpoint_weights_fused_experts_stream_as_hf_files_hold_them(tmp_path):
    """transformers keeps Mixtral's experts fused in memory; the stream must carry what its
    save_pretrained writes (per-expert w1/w3/w2 under block_sparse_moe), name for name, bit for bit."""
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        num_local_experts=3, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    model.save_pretrained(tmp_path / "hf")
    save({"model": model}, tmp_path / "ckpt", step=0)
    on_disk = safetensors_torch.load_file(tmp_path / "hf" / "model.safetensors")
    streamed = dict(CheckpointWeights(tmp_path / "ckpt", model_type="mixtral"))
    assert sorted(streamed) == sorted(on_disk)
    for name, tensor in on_disk.items():
        torch.testing.assert_close(streamed[name], tensor, rtol=0, atol=0, msg=name)


def test_vllm_checkpoint_weights_unknown_fused_family_is_refused():
    from plait.vllm.checkpoint_weights import on_disk_weights

    weights = torch.zeros(2, 4, 3)
    assert on_disk_weights("model.layers.0.mlp.experts.gate_up_proj", weights, None)[0][0].endswith("gate_up_proj")
    with pytest.raises(CheckpointLayoutError, match="model_type='qwen9_moe'"):
        on_disk_weights("model.layers.0.mlp.experts.gate_up_proj", weights, "qwen9_moe")
