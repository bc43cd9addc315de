"""HF BLOOM and GPT-2 trained under torch tensor parallelism (``parallelize_module``, DTensor) at TP=2,
saved with ``uc.save``, loaded at TP=1 and TP=4 and exported to HF.

Every parameter and AdamW moment loaded at TP=1 is bitwise the TP=2 run's, assembled by hand
(``hf_torch_tp.consolidated``, which undoes GPT-2's per-part c_attn split itself); logits at TP=1,
TP=4 and from the HF export match the TP=2 model's. The fused-QKV mistakes are caught: GPT-2's
c_attn saved by its DTensor placement alone (one ``[q|k|v]`` block) and BLOOM's interleaved QKV
described as ``[q|k|v]`` parts both give other logits; a TP size that does not divide the heads
is refused naming the tensor.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed
from plait.universal_ckpt.interop.hf import export_hf

sys.path.insert(0, str(Path(__file__).parent))
import hf_torch_tp as ht

pytest.importorskip("transformers")
pytest.importorskip("torch.distributed.tensor.parallel")

MODELS = {"bloom": (ht.bloom, ht.bloom_tp, ht.bloom_rules), "gpt2": (ht.gpt2, ht.gpt2_tp, ht.gpt2_rules)}
# The wrong description of each fused QKV (see ht.bloom_rules / ht.gpt2_rules).
WRONG = {"bloom": {"as_gpt2_parts": True}, "gpt2": {"fused_as_one_block": True}}
# TP sums row-parallel halves in another order than one matmul does: float32 rounding of the logits.
LOGITS_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _parallel(name: str, seed: int):
    from torch.distributed.device_mesh import init_device_mesh

    build, parallelize, _ = MODELS[name]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    return parallelize(build(seed), mesh)


def save_tp2(name: str, root: str, wrong_root: str) -> dict:
    """TP=2: train 3 steps, save (right and wrong QKV description); the state by hand and the logits."""
    model = _parallel(name, 0)
    optimizer = torch.optim.AdamW(model.parameters(), **ht.ADAMW)
    ht.train(model, optimizer, 3)
    rules = MODELS[name][2]
    uc.save({"model": uc.model_parallel(model, optimizer, config=ht.tp_config(2, rules()))}, root, step=3)
    uc.save({"model": uc.model_parallel(model, optimizer, config=ht.tp_config(2, rules(**WRONG[name])))},
            wrong_root, step=3)
    return {"states": ht.consolidated(model, optimizer, 2), "logits": ht.logits(model)}


def load_tp4(name: str, root: str) -> torch.Tensor:
    """TP=4: load into a differently initialised model; its logits."""
    model = _parallel(name, 1)
    optimizer = torch.optim.AdamW(model.parameters(), **ht.ADAMW)
    uc.load({"model": uc.model_parallel(model, optimizer, config=ht.tp_config(4, MODELS[name][2]()))}, root)
    return ht.logits(model)


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_torch_tp2_to_tp1_tp4_and_hf_export(tmp_path, name):
    build = MODELS[name][0]
    saved = run_distributed(save_tp2, 2, name, str(tmp_path / "tp2"), str(tmp_path / "wrong"), timeout=150)[0]

    model = build(1)  # TP=1: other initial weights, a fresh optimizer
    optimizer = torch.optim.AdamW(model.parameters(), **ht.ADAMW)
    uc.load({"model": uc.model_parallel(model, optimizer)}, tmp_path / "tp2")
    loaded = ht.consolidated(model, optimizer, 1)
    assert loaded.keys() == saved["states"].keys()
    for key, tensor in saved["states"].items():
        assert torch.equal(loaded[key], tensor), key
    ones = ht.logits(model)
    torch.testing.assert_close(ones, saved["logits"], **LOGITS_TOLERANCE)

    export_hf(tmp_path / "tp2", tmp_path / "hf", config=model.config, rename=lambda n: n.removeprefix("model."))
    exported, info = type(model).from_pretrained(tmp_path / "hf", output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.equal(ht.logits(exported), ones)  # the same fp32 weights

    for logits in run_distributed(load_tp4, 4, name, str(tmp_path / "tp2"), timeout=180):
        torch.testing.assert_close(logits, saved["logits"], **LOGITS_TOLERANCE)

    wrong = build(1)
    uc.load({"model": uc.model_parallel(wrong)}, tmp_path / "wrong")
    assert not torch.allclose(ht.logits(wrong), saved["logits"], rtol=1e-2, atol=1e-2)  # q/k/v rows misplaced


def test_tp_size_that_splits_a_head_is_refused():
    """BLOOM's 4 heads at TP=3: refused when the state is described, naming the tensor and the fix."""
    model = ht.bloom(0)
    shard = 3 * ht.HIDDEN // 3  # the rows torch's Shard(0) gives each of 3 ranks: 1 1/3 heads
    model.transformer.h[0].self_attention.query_key_value.weight.data = torch.zeros(shard, ht.HIDDEN)
    config = uc.ModelParallelConfig(groups={"tp": (0, 1, 2)}, rules=ht.bloom_rules())
    with pytest.raises(ValueError, match=r"query_key_value.weight.*tp size of 3.*pick a tp size"):
        uc.model_parallel(model, config=config)


def conv1d_style_errors() -> list[str]:
    """The package's Conv1D styles on what they must refuse (W=2): an nn.Linear, and fused parts
    that 2 ranks cannot split."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers.pytorch_utils import Conv1D

    from plait.universal_ckpt.parallel_styles import Conv1DColwiseParallel, Conv1DRowwiseParallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    messages = []
    for module, style in ((torch.nn.Linear(4, 4), Conv1DRowwiseParallel()),
                          (Conv1D(9, 4), Conv1DColwiseParallel(parts=(3, 3, 3)))):
        with pytest.raises(ValueError) as info:
            parallelize_module(module, mesh, style)
        messages.append(str(info.value))
    return messages


def test_conv1d_styles_refuse_bad_input():
    from plait.universal_ckpt.parallel_styles import Conv1DColwiseParallel

    linear, parts = run_distributed(conv1d_style_errors, 2, timeout=60)[0]
    assert "Conv1DRowwiseParallel is for HF Conv1D layers" in linear and "torch's ColwiseParallel" in linear, linear
    assert "parts=[3, 3, 3]" in parts and "divisible by the mesh size 2" in parts, parts
    with pytest.raises(ValueError, match=r"parts=\(\)"):
        Conv1DColwiseParallel(parts=())
    assert Conv1DColwiseParallel().checkpoint_rules("c_fc") == ()  # placements describe themselves
    assert dict(Conv1DColwiseParallel(parts=(8, 8)).checkpoint_rules(r"a\.c", unit=4)) == {
        r"a\.c\.weight": uc.TensorLayout(dim=1, parts=(8, 8), unit=4),
        r"a\.c\.bias": uc.TensorLayout(dim=0, parts=(8, 8), unit=4)}
