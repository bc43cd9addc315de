"""Pretrained weights streamed into the store: ``load_safetensors`` on a model built under
``sharded_init(placement=...)`` reads an HF ``save_pretrained`` checkpoint (sharded safetensors)
tensor by tensor into the placement's shard storage.

Checked here: the values are bitwise those transformers' own ``from_pretrained`` loads (tied and
untied heads, a bf16 checkpoint into an fp32 model), a mismatched checkpoint is refused before any
value changes, and loading raises the peak resident set by about the largest tensor, not the model (measured in a
fresh process, ``VmHWM`` reset first).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from plait.kernels.testing import run_distributed
from plait.offload_io import IOConfig, OffloadConfig, zero_placement
from plait.zero_sharding import sharded_init
from plait.zero_sharding.construction import ConstructedParameter, whole_value
from plait.zero_sharding.pretrained import load_safetensors

transformers = pytest.importorskip("transformers")

IO = IOConfig(block_size=1 << 20, queue_depth=4, workers=2, fsync=False, min_free_bytes=0)
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
# Many layers of small tensors: the model (about 44 MB) is far larger than its largest tensor (1 MiB).
DEEP = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=16, num_attention_heads=4,
            num_key_value_heads=4)


def _placement(root: str):
    return zero_placement(OffloadConfig(device="nvme", param_device="nvme", path=os.path.join(root, "offload"),
                                        io=IO, sub_group_size=1 << 14))


def _save(root: str, shape: dict, *, tie: bool = False, dtype=torch.float32, shard: str = "200KB") -> tuple:
    """A Llama saved by ``save_pretrained`` in several safetensors shards; (directory, config)."""
    config = transformers.LlamaConfig(**shape, tie_word_embeddings=tie)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    directory = os.path.join(root, "checkpoint")
    model.save_pretrained(directory, max_shard_size=shard)
    return directory, config


@pytest.mark.parametrize("tie,dtype", [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)])
def test_values_are_transformers_own_load(tmp_path, tie, dtype) -> None:
    directory, config = _save(str(tmp_path), SMALL, tie=tie, dtype=dtype)
    with open(os.path.join(directory, "model.safetensors.index.json")) as handle:
        assert len(set(json.load(handle)["weight_map"].values())) > 1  # really sharded
    reference = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    placement = _placement(str(tmp_path))
    torch.manual_seed(0)  # a different seed: every value must come from the checkpoint
    with sharded_init(placement=placement):
        built = transformers.LlamaForCausalLM(config)
    report = load_safetensors(built, directory)
    stored = dict(built.named_parameters())
    assert set(stored) <= set(report.loaded)
    for name, p in reference.named_parameters():
        assert isinstance(stored[name], ConstructedParameter) and stored[name]._plait_slice is None, name
        value = whole_value(stored[name])
        assert value.dtype == torch.float32 and torch.equal(value, p.detach()), name
    if tie:
        assert built.lm_head.weight is built.model.embed_tokens.weight
    placement.close()


def test_a_mismatched_checkpoint_is_refused_before_any_change(tmp_path) -> None:
    directory, config = _save(str(tmp_path), SMALL)
    placement = _placement(str(tmp_path))
    wider = transformers.LlamaConfig(**{**SMALL, "intermediate_size": 192}, tie_word_embeddings=False)
    torch.manual_seed(0)
    with sharded_init(placement=placement):
        other = transformers.LlamaForCausalLM(wider)
    before = {name: whole_value(p) for name, p in other.named_parameters()}
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight' is \["):
        load_safetensors(other, directory)
    fewer = transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": 1}, tie_word_embeddings=False)
    with sharded_init(placement=placement):
        short = transformers.LlamaForCausalLM(fewer)
    with pytest.raises(ValueError, match="tensors the model does not.*strict=False"):
        load_safetensors(short, directory)
    assert all(torch.equal(whole_value(p), before[name]) for name, p in other.named_parameters())
    assert load_safetensors(short, directory, strict=False).loaded  # the layer it has is loaded
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_safetensors(short, str(tmp_path))
    placement.close()


def _load_peak(root: str, directory: str, shape: dict) -> dict:
    """The rise of the peak resident set while ``load_safetensors`` streams ``directory`` into a
    model built straight to the store (after the build, ``VmHWM`` reset)."""
    import ctypes

    from plait.kernels.bench import reset_peak_rss, rss_bytes

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: freed tensors go back (see the phases test)
    placement = _placement(root)
    config = transformers.LlamaConfig(**shape, tie_word_embeddings=False)
    with sharded_init(placement=placement):
        model = transformers.LlamaForCausalLM(config)
    start = reset_peak_rss()
    report = load_safetensors(model, directory)
    rise = rss_bytes()[1] - start
    placement.close()
    return {"rise": rise, "largest": report.largest_tensor_bytes}


@pytest.mark.timeout(180)
def test_loading_holds_the_largest_tensor_not_the_model(tmp_path) -> None:
    directory, config = _save(str(tmp_path), DEEP, shard="20MB")
    model_bytes = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
                      if f.endswith(".safetensors"))
    result = run_distributed(_load_peak, 1, str(tmp_path), directory, DEEP, timeout=150)[0]
    # the tensor being read and a fixed margin for the I/O engine's threads and allocator slack
    # (the rise measured 4.6 MB with a 1 MiB largest tensor and a 97 MB model)
    bound = result["largest"] + (12 << 20)
    assert bound < model_bytes / 3  # the shape separates the two claims
    assert result["rise"] < bound, (result, model_bytes)
