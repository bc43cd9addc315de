"""``SequenceParallelExtension`` (the ``sp_size`` extension of the Lightning and HF Trainer integrations) on
gloo, sp=2, with a tiny HF Llama: ``apply`` + ``split`` + the model's own ``.loss`` give the loss and
gradients of the model without SP, for batches every sp rank shares and for per-rank micro-batches
(gathered, with the host's ``num_items_in_batch``); ``remove_sequence_parallel`` undoes it; what it
cannot do is refused with the host's setting named."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from plait.kernels.mesh import make_mesh  # noqa: E402
from plait.kernels.testing.distributed import run_distributed  # noqa: E402
from plait.kernels.tolerances import tolerance  # noqa: E402
from plait.ulysses_sp import DistributedAttention, sum_sp_gradients  # noqa: E402
from plait.ulysses_sp.hf import ATTN_NAME, is_ulysses  # noqa: E402
from plait.ulysses_sp.zero_extension import SequenceParallelExtension, remove_sequence_parallel  # noqa: E402

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=128)


class _Holder(nn.Module):
    """What a host hands the extension: a module holding the HF model (a LightningModule)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**COMMON)
        config._attn_implementation = "sdpa"
        self.model = transformers.AutoModelForCausalLM.from_config(config)


def _batch(seed: int, seq: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, COMMON["vocab_size"], (2, seq), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, seq - 3:] = 0  # one right-padded row
    return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _shared_and_per_rank() -> list[str]:
    rank = torch.distributed.get_rank()
    tol = tolerance("ulysses_model_grad", torch.float32)
    mesh = make_mesh(dp=-1, sp=2)
    checked = []
    for batches in ("shared", "per_rank"):
        holder = _Holder()
        reference = copy.deepcopy(holder.model)
        ext = SequenceParallelExtension(mesh, setting="sp_size", batches=batches)
        assert ext.apply(holder, mesh) is holder and is_ulysses(holder.model)
        if batches == "shared":  # every sp rank holds the same batch; the loss is the group mean x sp
            batch, whole = _batch(1, 21), _batch(1, 21)
            ref = reference(**whole).loss
            ref.backward()
            loss = holder.model(**ext.split(batch)).loss / ext.sp  # ZeRO would average over dp x sp
        else:  # each rank loaded its own micro-batch (odd lengths); HF's divisor is their valid-token count
            batch, whole = _batch(10 + rank, 19 + 2 * rank), [_batch(10, 19), _batch(11, 21)]
            items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in whole)
            ref = sum(_summed_loss(reference, b) for b in whole) / items
            ref.backward()
            loss = holder.model(**ext.split(batch), num_items_in_batch=torch.tensor(items)).loss
        loss.backward()
        sum_sp_gradients(holder.model, mesh)
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=ext.group)
        tol.assert_close(total, ref.detach(), what=f"{batches} loss")
        ref_grads = _grads(reference)
        for name, grad in _grads(holder.model).items():
            tol.assert_close(grad, ref_grads[name], what=f"{batches} grad {name}")
        remove_sequence_parallel(holder)
        assert not is_ulysses(holder.model) and "_loss_function" not in vars(holder.model)
        assert holder.model.config._attn_implementation != ATTN_NAME
        checked.append(batches)
    return checked


def _summed_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                             ignore_index=-100, reduction="sum")


def test_split_and_loss_equal_the_model_without_sp_for_shared_and_per_rank_batches():
    for checked in run_distributed(_shared_and_per_rank, 2, timeout=180):
        assert checked == ["shared", "per_rank"]


def _refusals() -> list[str]:
    mesh = make_mesh(dp=-1, sp=2)
    ext = SequenceParallelExtension(mesh, setting="PlaitConfig.sp_size")
    assert (ext.order, repr(ext), ext.zero_kwargs()) == (10, "SequenceParallel(sp=2)", {})
    messages = []
    with pytest.raises(ValueError) as info:
        ext.apply(nn.Linear(4, 4), mesh)  # neither an HF model nor a DistributedAttention
    messages.append(str(info.value))
    custom = nn.ModuleDict({"attn": DistributedAttention(mesh=mesh)})
    assert ext.apply(custom, mesh) is custom  # a custom model that wrapped its own attention passes
    with pytest.raises(ValueError) as info:
        ext.split([1, 2, 3])
    messages.append(str(info.value))
    with pytest.raises(ValueError, match="batches='both'"):
        SequenceParallelExtension(mesh, batches="both")
    with pytest.raises(ValueError, match="UlyssesConfig"):
        SequenceParallelExtension(mesh, config={"tiled_mlp_chunks": 2})
    per_rank = SequenceParallelExtension(mesh, setting="PlaitConfig.sp_size", batches="per_rank")
    with pytest.raises(ValueError) as info:
        per_rank.split({"input_ids": torch.zeros(1, 4, dtype=torch.long), "pixel_values": torch.zeros(1)})
    messages.append(str(info.value))
    torch.distributed.barrier()  # no rank leaves while another still builds its groups
    return messages


def test_refusals_name_the_hosts_setting():
    no_model, not_a_batch, extra_key = run_distributed(_refusals, 2, timeout=120)[0]
    assert no_model.startswith("PlaitConfig.sp_size=2: Linear holds no Hugging Face model")
    assert not_a_batch.startswith("PlaitConfig.sp_size=2 splits batches") and "list" in not_a_batch
    assert extra_key.startswith("PlaitConfig.sp_size=2 splits causal-LM batches") and "pixel_values" in extra_key
