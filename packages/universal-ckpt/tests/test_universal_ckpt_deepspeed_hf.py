"""A DeepSpeed ZeRO run of an HF model -> `plait ckpt convert --to hf` -> `from_pretrained`.

DeepSpeed's own `zero_to_fp32` is the oracle: the export must hold exactly its fp32 weights under the
model's own names, so `LlamaForCausalLM.from_pretrained` finds every weight (no missing or unexpected
keys) and gives the logits of the model loaded from `zero_to_fp32`'s state dict, bitwise.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from plait.kernels.testing import run_distributed

transformers = pytest.importorskip("transformers")
STAGES = (2, 3)


def _config():
    return transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))


def train_with_deepspeed(root: str) -> bool:
    """Two bf16 steps of a tiny Llama under DeepSpeed ZeRO-2 and ZeRO-3 at W=2, each saved."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.ops

    # The CPU accelerator JIT-compiles a shared-memory all-reduce on init; gloo needs none of it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed("gloo")
    for stage in STAGES:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(_config())
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                  "bf16": {"enabled": True}, "steps_per_print": 10**6}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                          config=config)
        for _ in range(2):
            engine.backward(engine(input_ids=_tokens(), labels=_tokens()).loss)
            engine.step()
        engine.save_checkpoint(f"{root}/zero{stage}", tag="step2")
    return True


@pytest.fixture(scope="module")
def ds_root(tmp_path_factory):
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("ds_llama")
    run_distributed(train_with_deepspeed, 2, str(root), timeout=240, env={"DS_ACCELERATOR": "cpu"})
    return root


def _plait(*argv: str) -> int:
    from plait.universal_ckpt.cli import register

    parser = argparse.ArgumentParser(prog="plait")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.func(args)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_llama_exports_to_from_pretrained(ds_root, tmp_path, stage):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    src = ds_root / f"zero{stage}"
    assert _plait("ckpt", "convert", str(src), str(tmp_path / "hf"), "--to", "hf") == 0
    _config().save_pretrained(tmp_path / "hf")
    model, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    reference = transformers.LlamaForCausalLM(_config())
    reference.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(src)), strict=True)
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=_tokens()).logits, reference.eval()(input_ids=_tokens()).logits)
