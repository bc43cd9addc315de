"""R6: ours -> DCP -> ours and ours -> HF safetensors -> ours, bitwise; HF weights loaded per piece."""

from __future__ import annotations

import pytest
import torch

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed
from plait.universal_ckpt.interop.dcp import export_dcp, import_dcp
from plait.universal_ckpt.interop.hf import export_hf, import_hf, load_hf_weights
from plait.universal_ckpt.testing import ToyZero, ToyZeroConfig, small_model, train_steps


def _consolidated(path) -> dict[str, torch.Tensor]:
    ckpt = uc.latest(path) or path
    manifest = uc.read_manifest(ckpt)
    return {name: uc.read_full(ckpt, manifest, entry) for name, entry in manifest.tensors.items()}


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)), name


def save_sharded(root: str) -> None:
    model = small_model(0)
    engine = ToyZero(model, ToyZeroConfig(stage=3))
    train_steps(model, engine, range(2))
    uc.save({"zero": engine, "rng": uc.RNGState(), "extra": {"pos": 2}}, root, step=2, layout=engine.layout())


def test_dcp_round_trip(tmp_path):
    run_distributed(save_sharded, 2, str(tmp_path / "ours"), timeout=90)
    export_dcp(tmp_path / "ours", tmp_path / "dcp")
    back = import_dcp(tmp_path / "dcp", tmp_path / "back")
    _assert_bitwise(_consolidated(tmp_path / "back"), _consolidated(tmp_path / "ours"))
    original, restored = uc.read_manifest(uc.latest(tmp_path / "ours")), uc.read_manifest(back)
    assert restored.step == 2 and restored.user_meta["source_layout"]["zero_stage"] == 3
    assert {k: e.kind for k, e in restored.tensors.items()} == {k: e.kind for k, e in original.tensors.items()}
    assert sorted(restored.objects) == [0, 1]  # every rank's RNG state survives
    engine = ToyZero(small_model(3), ToyZeroConfig(stage=3))
    state = {"zero": engine, "rng": uc.RNGState(), "extra": None}
    uc.load(state, back)
    assert state["extra"] == {"pos": 2}
    # A plain DCP checkpoint written by torch itself imports too.
    import torch.distributed.checkpoint as dcp

    plain = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    dcp.save(plain, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    imported = _consolidated(import_dcp(tmp_path / "plain", tmp_path / "plain_back"))
    _assert_bitwise(imported, {"dcp/w": plain["w"], "dcp/b": plain["b"]})


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers, config, transformers.LlamaForCausalLM(config)


def test_hf_export_from_pretrained_and_back(tmp_path):
    transformers, config, model = _hf_llama()
    uc.save({"model": model}, tmp_path / "ours", step=1)
    export_hf(tmp_path / "ours", tmp_path / "hf", config=config, max_shard_bytes=60_000)
    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    _assert_bitwise(dict(loaded.state_dict()), dict(model.state_dict()))
    from safetensors.torch import load_file

    first = load_file(tmp_path / "hf" / shards[0])
    for name, tensor in first.items():
        assert torch.equal(tensor, model.state_dict()[name])
    import_hf(tmp_path / "hf", tmp_path / "back", key="model")
    _assert_bitwise(_consolidated(tmp_path / "back"), _consolidated(tmp_path / "ours"))
    export_hf(tmp_path / "ours", tmp_path / "hf16", dtype=torch.bfloat16, config=config)
    half = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf16", torch_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())


def load_hf_sharded(hf_dir: str) -> bool:
    engine = ToyZero(small_model(seed=77), ToyZeroConfig(stage=3))
    load_hf_weights(engine, hf_dir)
    reference = small_model(0)
    flat = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    own = torch.equal(engine.master, flat[engine.range[0]:engine.range[1]])
    full = all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), reference.parameters()))
    return own and full


def test_hf_weights_load_into_sharded_producer(tmp_path):
    uc.save({"model": small_model(0)}, tmp_path / "ours", step=0)
    export_hf(tmp_path / "ours", tmp_path / "hf")
    assert all(run_distributed(load_hf_sharded, 2, str(tmp_path / "hf"), timeout=90))
