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
    with pytest.raises(ValueError, match="average=True is for replicated tensors"):
        TensorLayout(dim=0, average=True)
    assert TensorLayout.from_json(TensorLayout(average=True).to_json()) == TensorLayout(average=True)
    assert layouts.describe({"dim": None, "group": "tp", "average": True}) == "tp:replicated averaged"
    # A TP size that does not divide the heads: refused when the state is described, before any save.
    model = mp.gpt2(0)
    with pytest.raises(ValueError, match=r"a tp size of 3 does not divide 4 heads"):
        uc.model_parallel(model, config=uc.ModelParallelConfig(groups={"tp": (0, 1, 2)}, rules=mp.rules(3)[2:]))


def test_layer_offset_maps_stage_names():
    stage = uc.layer_offset("transformer.h.", 2)
    assert stage("transformer.h.0.attn.c_attn.weight") == "transformer.h.2.attn.c_attn.weight"
    assert stage("transformer.h.11") == "transformer.h.13"
    assert stage("lm_head.weight") == "lm_head.weight"


def _inspect(root, capsys) -> str:
    """``plait ckpt inspect ROOT --limit 0``'s output."""
    parser = argparse.ArgumentParser(prog="plait")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["ckpt", "inspect", str(root), "--limit", "0"])
    capsys.readouterr()
    assert args.func(args) == 0
    return capsys.readouterr().out


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


def load_tp(root: str, out_root: str, hf_dir: str) -> dict:
    """TP=4 (world 4): load a checkpoint of another layout into fresh shards and save again; load
    the HF export (no padding) into other fresh shards (TP=4's own padding)."""
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
    from_hf = mp.tensor_parallel(mp.gpt2(1), rank, tp)
    with torch.no_grad():
        from_hf.lm_head.weight.fill_(7.0)
    hf.load_hf_weights(uc.model_parallel(from_hf, config=mp.config(tp)), hf_dir,
                       rename=lambda name: name.removeprefix("model."))
    hf_bitwise = all(torch.equal(param, mp.shard(reference.state_dict()[name], name, rank, tp))
                     for name, param in from_hf.named_parameters())  # padding rows zero, as mp.shard pads
    return {"bitwise": bitwise, "logits": logits, "read": sum(counted), "share": share, "hf_bitwise": hf_bitwise,
            "hf_logits": mp.tp_logits(from_hf, mp.tokens(), rank, tp)}


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
    shown = _inspect(root, capsys)
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

    from transformers import GPT2LMHeadModel

    # TP=2 (padded to 56 rows) -> HF without padding (50 rows) -> TP=4 (padded to 64) below.
    hf.export_hf(root, tmp_path / "hf", key="model", config=reference.config,
                 rename=lambda name: name.removeprefix("model."))
    exported, info = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", output_loading_info=True,
                                                    attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert exported.lm_head.weight.shape == (mp.VOCAB, mp.HIDDEN)
    assert torch.equal(exported.eval()(mp.tokens()).logits, local)

    # TP=2 -> TP=4 (other padding), from the checkpoint and from the HF export
    results = run_distributed(load_tp, 4, root, root4, str(tmp_path / "hf"), timeout=150)
    for result in results:
        assert result["bitwise"] and result["hf_bitwise"]
        assert result["read"] == result["share"]  # only its own pieces' bytes (padding excluded)
        torch.testing.assert_close(result["logits"], expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(result["hf_logits"], result["logits"])
    back = _single(root4)  # TP=4 -> one process
    assert all(torch.equal(back.state_dict()[n], t) for n, t in reference.state_dict().items())

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
    config = uc.ModelParallelConfig(name_map=uc.layer_offset("transformer.h.", 2 * rank), stage=rank)
    uc.save({"model": uc.model_parallel(stage, config=config)}, root, step=1)


def test_pipeline_stages_load_into_one_process(tmp_path, capsys):
    run_distributed(save_stages, 2, str(tmp_path), timeout=90)
    manifest = uc.read_manifest(uc.latest(tmp_path))
    assert manifest.layout.mesh == {"pp": 2}
    # pipeline placement: which stage held each module
    assert manifest.tensors["model/model.transformer.h.1.attn.c_attn.weight"].pattern["stages"] == [0]
    assert manifest.tensors["model/model.transformer.h.2.attn.c_attn.weight"].pattern["stages"] == [1]
    assert manifest.tensors["model/model.lm_head.weight"].pattern["stages"] == [1]
    assert _inspect(tmp_path, capsys).count("pp:stage1") == 2 * 12 + 3  # layers 2-3: 12 tensors each; ln_f, head
    with pytest.raises(ValueError, match="stage=-1 must be this rank's pipeline stage"):
        uc.ModelParallelConfig(stage=-1)
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


def test_expert_parallel_offsets_load_into_one_process(tmp_path, capsys):
    run_distributed(save_experts, 2, str(tmp_path), timeout=90)
    manifest = uc.read_manifest(uc.latest(tmp_path))
    assert manifest.layout.expert_parallel_size == 2
    shown = _inspect(tmp_path, capsys)
    assert "model parallel: tp=1 pp=1 dp=1 ep=2 sp=1" in shown and "ep:dim0" in shown and "ep:owned" in shown
    assert len(manifest.tensors["model/model.router.weight"].pieces) == 1  # replicated over ep: once
    assert manifest.tensors["model/model.experts.3.bias"].pattern == {"dim": None, "group": "ep", "owned": True}
    reference, model = _moe(0, 4), _moe(1, 4)
    uc.load({"model": uc.model_parallel(model)}, tmp_path)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def _drifting(seed: int) -> torch.nn.Module:
    """A TP-replicated norm before a column-parallel Linear (this rank's 3 of 6 output rows)."""
    torch.manual_seed(seed)
    module = torch.nn.Module()
    module.norm = torch.nn.LayerNorm(4)
    module.fc = torch.nn.Linear(4, 3)
    return module


DRIFT_RULES = ((r"fc\..*", TensorLayout(dim=0)), (r"norm\..*", TensorLayout(average=True)))


def save_drifted(root: str, lowest_root: str) -> dict:
    """TP=2: the norm's replicas drift apart (each rank steps it with its own gradient); saved
    averaged and as the lowest rank's copy, then loaded back at TP=2 into fresh modules."""
    rank = torch.distributed.get_rank()
    module = _drifting(rank)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(2):
        module.fc(module.norm(torch.randn(2, 4, generator=generator))).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    config = uc.ModelParallelConfig(groups={"tp": (0, 1)}, rules=DRIFT_RULES)
    before = {name: t.detach().clone() for name, t in module.state_dict().items()}
    uc.save({"model": uc.model_parallel(module, optimizer, config=config)}, root, step=2)
    assert all(torch.equal(before[n], t) for n, t in module.state_dict().items())  # the live run is untouched
    lowest = uc.ModelParallelConfig(groups={"tp": (0, 1)}, rules=DRIFT_RULES[:1])
    uc.save({"model": uc.model_parallel(module, optimizer, config=lowest)}, lowest_root, step=2)
    fresh = _drifting(5)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    uc.load({"model": uc.model_parallel(fresh, fresh_optimizer, config=config)}, root)
    return {"norm": {n: p.detach().clone() for n, p in module.norm.named_parameters()},
            "moments": {n: {f: v.clone() for f, v in optimizer.state[p].items()}
                        for n, p in module.norm.named_parameters()},
            "loaded": {n: p.detach().clone() for n, p in fresh.norm.named_parameters()},
            "loaded_moments": {n: {f: v.clone() for f, v in fresh_optimizer.state[p].items()}
                               for n, p in fresh.norm.named_parameters()}}


def test_replicas_averaged_on_save_as_ucp_does(tmp_path, capsys):
    """``TensorLayout(average=True)``: drifted TP replicas of a norm are saved as their mean (DeepSpeed's
    ``sum(slices) / len(slices)``), moments too, and every rank loads that mean; without it, the
    lowest rank's copy."""
    root, lowest = tmp_path / "averaged", tmp_path / "lowest"
    ranks = run_distributed(save_drifted, 2, str(root), str(lowest), timeout=90)
    assert not torch.equal(ranks[0]["norm"]["weight"], ranks[1]["norm"]["weight"])  # they did drift
    ckpt, manifest = uc.latest(root), uc.read_manifest(uc.latest(root))
    base, first = uc.latest(lowest), uc.read_manifest(uc.latest(lowest))
    for name in ("weight", "bias"):
        entry = manifest.tensors[f"model/model.norm.{name}"]
        assert entry.pattern == {"dim": None, "group": "tp", "average": True}
        mean = (ranks[0]["norm"][name] + ranks[1]["norm"][name]) / 2
        assert torch.equal(uc.read_full(ckpt, manifest, entry), mean)
        assert torch.equal(uc.read_full(base, first, first.tensors[f"model/model.norm.{name}"]), ranks[0]["norm"][name])
        for field in ("exp_avg", "exp_avg_sq"):
            saved = uc.read_full(ckpt, manifest, manifest.tensors[f"model/optim.{field}.norm.{name}"])
            assert torch.equal(saved, (ranks[0]["moments"][name][field] + ranks[1]["moments"][name][field]) / 2)
        for rank in ranks:  # loaded at TP=2: every replica gets the mean
            assert torch.equal(rank["loaded"][name], mean)
            assert torch.equal(rank["loaded_moments"][name]["exp_avg"],
                               uc.read_full(ckpt, manifest, manifest.tensors[f"model/optim.exp_avg.norm.{name}"]))
            assert torch.equal(rank["loaded_moments"][name]["step"], ranks[0]["moments"][name]["step"])
    assert "tp:replicated averaged" in _inspect(root, capsys)
