"""Sharded construction keeps the user's initialisation: a model built under ``sharded_init``
(the modules' own constructors, sliced as they are built) consolidates to bitwise the weights of
the same model built normally from the same seed, for every parameter-owning ``torch.nn`` module
and for HF models, at world sizes 1, 2 and 3; and the first losses equal DDP's."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait.kernels.testing import global_batch, rank_slice, run_distributed
from plait.zero_sharding import ZeroConfig, sharded_init, zero_shard
from plait.zero_sharding.construction import ConstructedParameter

VOCAB = 259  # plait.kernels.testing's byte tokenizer


class StandardLM(nn.Module):
    """A language model made only of standard torch modules (what a Lightning user writes)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=258)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.block = nn.TransformerEncoderLayer(dim, heads, 2 * dim, batch_first=True, dropout=0.0)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        x = self.embed(input_ids)
        mask = nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1])
        x = self.norm(x + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0])
        logits = self.head(self.block(x, src_mask=mask, is_causal=True))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return type("Output", (), {"loss": loss})()


MODULES: dict[str, Callable[[], nn.Module]] = {
    "Linear": lambda: nn.Linear(7, 5),
    "Embedding(padding_idx)": lambda: nn.Embedding(11, 6, padding_idx=3),
    "LayerNorm": lambda: nn.LayerNorm(6),
    "RMSNorm": lambda: nn.RMSNorm(6),
    "BatchNorm1d": lambda: nn.BatchNorm1d(6),
    "Conv1d": lambda: nn.Conv1d(3, 4, 3),
    "Conv2d": lambda: nn.Conv2d(3, 4, 3),
    "MultiheadAttention": lambda: nn.MultiheadAttention(8, 2),
    "TransformerEncoderLayer": lambda: nn.TransformerEncoderLayer(8, 2, 16),
    "TransformerDecoderLayer": lambda: nn.TransformerDecoderLayer(8, 2, 16),
    "LSTM": lambda: nn.LSTM(5, 6, num_layers=2),
    "GRU": lambda: nn.GRU(5, 6),
    "StandardLM": StandardLM,
}


def _hf_models() -> dict[str, Callable[[], nn.Module]]:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    small = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    return {
        "Llama": lambda: LlamaForCausalLM(LlamaConfig(**small, pad_token_id=258)),
        "Qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**small, head_dim=8)),
        "GPT-2 (tied)": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                           n_positions=64, bos_token_id=256, eos_token_id=257,
                                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    }


def _builders(family: str) -> dict[str, Callable[[], nn.Module]]:
    return MODULES if family == "torch" else _hf_models()  # by name: workers cannot unpickle lambdas


def _consolidated_equal(family: str) -> dict[str, list[str]]:
    """Per model: the names whose consolidated value differs from the normal construction's."""
    out = {}
    for name, build in _builders(family).items():
        torch.manual_seed(1234)
        reference = build().state_dict()
        torch.manual_seed(1234)
        with sharded_init():
            model = build()
        params = list(model.parameters())
        assert params and all(isinstance(p, ConstructedParameter) for p in params), name
        world = dist.get_world_size()
        assert all(p._plait_slice.numel() * world < p.numel() + world for p in params), "each rank keeps a slice"
        model, _ = zero_shard(model, torch.optim.SGD, ZeroConfig(stage=3, param_persistence_threshold=0), lr=0.1)
        got = model.state_dict()  # a tied parameter appears once, under its first name
        tied = {k: next(t for t in got if torch.equal(reference[t], reference[k])) for k in reference if k not in got}
        out[name] = [k for k in reference if not torch.equal(reference[k], got[tied.get(k, k)])]
    return out


def _first_losses_equal_ddp(families: list[str], steps: int = 5) -> dict[str, tuple]:
    rank, world = dist.get_rank(), dist.get_world_size()
    builders = {"StandardLM": StandardLM}
    if "hf" in families:
        builders.update(_hf_models())
    out = {}
    for name, build in builders.items():
        torch.manual_seed(7)
        ddp = nn.parallel.DistributedDataParallel(build())
        ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        torch.manual_seed(7)
        with sharded_init():
            model = build()
        model, optimizer = zero_shard(model, torch.optim.SGD, ZeroConfig(stage=3, param_persistence_threshold=0),
                                      lr=0.1)
        ours, theirs = [], []
        for step in range(steps):
            batch = rank_slice(global_batch(step, 2 * world, 16), rank, world)
            for net, opt, losses in ((ddp, ddp_opt, theirs), (model, optimizer, ours)):
                loss = net(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                loss.backward()
                losses.append(loss.item())
                opt.step()
                opt.zero_grad()
        out[name] = (ours, theirs)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_torch_modules_keep_their_initialisation(world):
    for rank_result in run_distributed(_consolidated_equal, world, "torch", timeout=180):
        assert rank_result == {name: [] for name in MODULES}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_hf_models_keep_their_initialisation(world):
    pytest.importorskip("transformers")
    for rank_result in run_distributed(_consolidated_equal, world, "hf", timeout=180):
        assert rank_result == {name: [] for name in _hf_models()}


def test_first_losses_equal_ddp():
    # plait-zero-sharding installed alone has no transformers: the standard-module model still runs
    families = ["torch", "hf"] if importlib.util.find_spec("transformers") else ["torch"]
    for result in run_distributed(_first_losses_equal_ddp, 2, families, timeout=180):
        for name, (ours, theirs) in result.items():
            assert ours[0] == theirs[0], f"{name}: the first loss must be bitwise DDP's (same weights, same data)"
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")


def _divergent_seeds() -> str:
    torch.manual_seed(dist.get_rank())
    with sharded_init():
        model = nn.Linear(8, 8)
    try:
        zero_shard(model, torch.optim.SGD, ZeroConfig(stage=3), lr=0.1)
    except ValueError as error:
        return str(error)
    return "no error"


def test_ranks_seeded_differently_are_refused_naming_the_parameter():
    for message in run_distributed(_divergent_seeds, 2, timeout=60):
        assert "'weight'" in message and "seed every rank the same" in message


def test_unknown_init_mode_is_refused():
    with pytest.raises(ValueError, match="init='lazy'"), sharded_init(init="lazy"):
        pass


def test_meta_mode_stays_available():
    with sharded_init(init="meta"):
        model = nn.Linear(4, 4)
    assert model.weight.is_meta
