"""Tensor- and pipeline-parallel layouts: the layout language, and a Megatron-style TP GPT-2
(fused c_attn, vocabulary padding) saved at TP=2 and loaded at TP=1, TP=4 and as an HF export,
every tensor bitwise, logits equal to HF's; a pipeline split saved per stage and loaded whole."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed
from plait.universal_ckpt import TensorLayout, layouts, reader
from plait.universal_ckpt.cli import register
from plait.universal_ckpt.interop import hf

sys.path.insert(0, str(Path(__file__).parent))
import mp_models as mp

pytest.importorskip("transformers")


def test_layout_pieces_fused_gqa_and_padding():
    gqa = TensorLayout(dim=0, parts=(8, 4, 4), unit=2)  # q: 4 heads of 2 rows, k/v: 2 heads each
    assert layouts.local_shape(gqa, (16, 3), 2) == (8, 3)
    assert layouts.pieces(gqa, (16, 3), 1, 2) == [
        (((4, 8), (0, 3)), ((0, 4), (0, 3))), (((10, 12), (0, 3)), ((4, 6), (0, 3))),
        (((14, 16), (0, 3)), ((6, 8), (0, 3)))]
    vocab = TensorLayout(dim=0, padded_size=56, vocab_size=50)
    assert layouts.pieces(vocab, (50, 4), 1, 2) == [(((28, 50), (0, 4)), ((0, 22), (0, 4)))]
    assert layouts.padding_box(vocab, (50, 4), 1, 2) == ((22, 28), (0, 4))
    assert layouts.padding_box(vocab, (50, 4), 0, 2) is None
    assert layouts.global_shape(vocab, (28, 4), 2) == (50, 4)
    assert TensorLayout.from_json(gqa.to_json()) == gqa


def test_layout_bad_input_names_tensor_and_fix():
    with pytest.raises(ValueError, match=r"attn.w: TensorLayout.parts=\[8, 4\] sum to 12.*widths"):
        layouts.pieces(TensorLayout(dim=0, parts=(8, 4)), (16, 3), 0, 2, name="attn.w")
    with pytest.raises(ValueError, match=r"qkv: a tp size of 3 does not divide 4 heads of 2 rows.*pick a tp size"):
        layouts.local_shape(TensorLayout(dim=0, unit=2), (8, 3), 3, name="qkv")
    with pytest.raises(ValueError, match="padded_size and vocab_size together"):
        TensorLayout(dim=0, padded_size=56)
    with pytest.raises(ValueError, match="need a split dim"):
        TensorLayout(parts=(1, 2))
    # A TP size that does not divide the heads: refused when the state is described, before any save.
    model = mp.gpt2(0)
    with pytest.raises(ValueError, match=r"a tp size of 3 does not divide 4 heads"):
        uc.model_parallel(model, config=uc.ModelParallelConfig(groups={"tp": (0, 1, 2)}, rules=mp.rules(3)[2:]))


def test_layer_offset_maps_stage_names():
    stage = uc.layer_offset("transformer.h.", 2)
    assert stage("transformer.h.0.attn.c_attn.weight") == "transformer.h.2.attn.c_attn.weight"
    assert stage("transformer.h.11") == "transformer.h.13"
    assert stage("lm_head.weight") == "lm_head.weight"


def save_tp(root: str, wrong_root: str) -> torch.Tensor:
    """TP=2 (world 2): shard HF GPT-2 by hand, check its logits, save right and wrongly described."""
    rank, tp = torch.distributed.get_rank(), torch.distributed.get_world_size()
    reference = mp.gpt2(0)
    expected = reference(mp.tokens()).logits
    model = mp.tensor_parallel(mp.gpt2(0), rank, tp)
    torch.testing.assert_close(mp.tp_logits(model, mp.tokens(), rank, tp), expected, atol=1e-5, rtol=1e-5)
    uc.save({"model": uc.model_parallel(model, config=mp.config(tp))}, root, step=1)
    uc.save({"model": uc.model_parallel(model, config=mp.config(tp, fused_as_one_block=True))}, wrong_root, step=1)
    return expected


def load_tp(root: str, out_root: str) -> dict:
    """TP=4 (world 4): load a checkpoint of another layout into fresh shards and save again."""
    rank, tp = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = mp.tensor_parallel(mp.gpt2(1), rank, tp)  # other weights, overwritten by the load
    with torch.no_grad():
        model.lm_head.weight.fill_(7.0)  # padding rows must come back zero
    counted, original = [], reader.read_verified

    def counting(*args, **kwargs):
        counted.append(kwargs["stop"] - kwargs["start"])
        return original(*args, **kwargs)

    reader.read_verified = counting  # verify=False: the bytes asked for are the bytes read
    try:
        uc.load({"model": uc.model_parallel(model, config=mp.config(tp))}, root, verify=False)
    finally:
        reader.read_verified = original
    pieces = uc.model_parallel(model, config=mp.config(tp)).sharded_state_dict().values()
    share = sum(piece.local.numel() * piece.local.element_size() for piece in pieces)
    reference = mp.gpt2(0)
    bitwise = all(torch.equal(param, mp.shard(reference.state_dict()[name], name, rank, tp))
                  for name, param in model.named_parameters())
    logits = mp.tp_logits(model, mp.tokens(), rank, tp)
    uc.save({"model": uc.model_parallel(model, config=mp.config(tp))}, out_root, step=2)
    return {"bitwise": bitwise, "logits": logits, "read": sum(counted), "share": share}


def _single(root) -> torch.nn.Module:
    model = mp.gpt2(1)
    uc.load({"model": uc.model_parallel(model)}, root)
    return model


def test_tp2_to_tp1_tp4_and_hf_export(tmp_path, capsys):
    root, wrong, root4 = (str(tmp_path / n) for n in ("tp2", "wrong", "tp4"))
    expected = run_distributed(save_tp, 2, root, wrong, timeout=120)[0]
    manifest = uc.read_manifest(uc.latest(root))
    assert manifest.tensors["model/model.transformer.h.0.attn.c_attn.weight"].pattern == {
        "dim": 1, "group": "tp", "parts": [32, 32, 32], "unit": 8}
    assert manifest.tensors["model/model.lm_head.weight"].global_shape == (mp.VOCAB, mp.HIDDEN)  # stripped
    assert manifest.layout.mesh == {"tp": 2}
    parser = argparse.ArgumentParser(prog="plait")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["ckpt", "inspect", root, "--limit", "0"])
    assert args.func(args) == 0
    shown = capsys.readouterr().out
    assert "mesh={'tp': 2}" in shown and "tp:dim1 parts=32+32+32 unit=8" in shown
    assert "tp:dim0 vocab=50 padded=56" in shown and "tp:replicated" in shown

    reference = mp.gpt2(0)
    single = _single(root)  # TP=2 -> one process: every tensor bitwise, so the logits are bitwise too
    for name, tensor in reference.state_dict().items():
        assert torch.equal(single.state_dict()[name], tensor), name
    # Bitwise weights give bitwise logits in this process; the ranks' logits (another thread
    # count, so another matmul blocking) agree to float32 rounding.
    local = reference(mp.tokens()).logits
    assert torch.equal(single(mp.tokens()).logits, local)
    torch.testing.assert_close(local, expected, atol=1e-6, rtol=1e-5)

    results = run_distributed(load_tp, 4, root, root4, timeout=150)  # TP=2 -> TP=4 (other padding)
    for result in results:
        assert result["bitwise"]
        assert result["read"] == result["share"]  # only its own pieces' bytes (padding excluded)
        torch.testing.assert_close(result["logits"], expected, atol=1e-5, rtol=1e-5)
    back = _single(root4)  # TP=4 -> one process
    assert all(torch.equal(back.state_dict()[n], t) for n, t in reference.state_dict().items())

    from transformers import GPT2LMHeadModel

    hf.export_hf(root, tmp_path / "hf", key="model", config=reference.config,
                 rename=lambda name: name.removeprefix("model."))
    exported, info = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", output_loading_info=True,
                                                    attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.equal(exported.eval()(mp.tokens()).logits, local)

    # The same shards described as one [q|k|v] block: the round trip through TP=1 must break.
    broken = _single(wrong)
    assert not torch.allclose(broken(mp.tokens()).logits, local, atol=1e-2)


def save_stages(root: str) -> None:
    """Two pipeline stages (world 2), each holding half of the layers numbered from 0."""
    rank = torch.distributed.get_rank()
    full = mp.gpt2(0, layers=4)
    stage = torch.nn.Module()
    stage.transformer = torch.nn.Module()
    stage.transformer.h = torch.nn.ModuleList(full.transformer.h[2 * rank:2 * rank + 2])
    if rank == 0:
        stage.transformer.wte, stage.transformer.wpe = full.transformer.wte, full.transformer.wpe
    else:
        stage.transformer.ln_f, stage.lm_head = full.transformer.ln_f, full.lm_head
    config = uc.ModelParallelConfig(name_map=uc.layer_offset("transformer.h.", 2 * rank))
    uc.save({"model": uc.model_parallel(stage, config=config)}, root, step=1)


def test_pipeline_stages_load_into_one_process(tmp_path):
    run_distributed(save_stages, 2, str(tmp_path), timeout=90)
    assert uc.read_manifest(uc.latest(tmp_path)).layout.mesh == {"pp": 2}
    reference, model = mp.gpt2(0, layers=4), mp.gpt2(1, layers=4)
    uc.load({"model": uc.model_parallel(model)}, tmp_path)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def _moe(seed: int, experts: int) -> torch.nn.Module:
    """Stacked expert weights plus a ModuleList of experts and a replicated router."""
    torch.manual_seed(seed)
    moe = torch.nn.Module()
    moe.router = torch.nn.Linear(8, 4)
    moe.stacked = torch.nn.Parameter(torch.randn(experts, 8, 6))
    moe.experts = torch.nn.ModuleList(torch.nn.Linear(8, 6) for _ in range(experts))
    return moe


def save_experts(root: str) -> None:
    """Expert parallelism at EP=2: each rank holds 2 of 4 experts, numbered from 0 locally."""
    rank = torch.distributed.get_rank()
    full = _moe(0, 4)
    local = _moe(1, 2)
    with torch.no_grad():
        local.router.load_state_dict(full.router.state_dict())
        local.stacked.copy_(full.stacked[2 * rank:2 * rank + 2])
        for index in range(2):
            local.experts[index].load_state_dict(full.experts[2 * rank + index].state_dict())
    rules = ((r"stacked", TensorLayout(dim=0, group="ep")),  # the expert dim of stacked weights
             (r"experts\..*", TensorLayout(group="ep", owned=True)))  # whole experts, one set per rank
    config = uc.ModelParallelConfig(groups={"ep": (0, 1)}, rules=rules, name_map=uc.layer_offset("experts.", 2 * rank))
    uc.save({"model": uc.model_parallel(local, config=config)}, root, step=1)


def test_expert_parallel_offsets_load_into_one_process(tmp_path):
    run_distributed(save_experts, 2, str(tmp_path), timeout=90)
    manifest = uc.read_manifest(uc.latest(tmp_path))
    assert manifest.layout.expert_parallel_size == 2
    assert len(manifest.tensors["model/model.router.weight"].pieces) == 1  # replicated over ep: once
    assert manifest.tensors["model/model.experts.3.bias"].pattern == {"dim": None, "group": "ep", "owned": True}
    reference, model = _moe(0, 4), _moe(1, 4)
    uc.load({"model": uc.model_parallel(model)}, tmp_path)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
