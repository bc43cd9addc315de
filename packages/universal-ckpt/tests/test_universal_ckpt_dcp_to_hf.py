"""A torch DCP checkpoint of a sharded HF model -> universal -> HF export that `from_pretrained` loads.

An export must carry the model's own tensor names for every source. This is the DCP source
as users write it: FSDP2 (`fully_shard`) at W=2, `get_state_dict` for model and optimizer, `dcp.save`
under one `"model"`/`"optim"` key each. The export must load with no missing or unexpected keys and
give the trained model's logits bitwise.
"""

from __future__ import annotations

import pytest
import torch

from plait.kernels.testing import run_distributed
from plait.universal_ckpt.interop.dcp import import_dcp
from plait.universal_ckpt.interop.hf import export_hf

transformers = pytest.importorskip("transformers")


def _config():
    return transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))


def train_fsdp2_and_save(root: str) -> torch.Tensor:
    """Two AdamW steps of a tiny Llama under FSDP2, then a DCP save; returns the trained logits."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(input_ids=_tokens(), labels=_tokens()).loss.backward()
        optim.step()
        optim.zero_grad()
    model_state, optim_state = get_state_dict(model, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=root)
    with torch.no_grad():
        return model.eval()(input_ids=_tokens()).logits


@pytest.mark.timeout(180)
def test_fsdp2_dcp_checkpoint_exports_to_from_pretrained(tmp_path):
    logits = run_distributed(train_fsdp2_and_save, 2, str(tmp_path / "dcp"), timeout=150)[0]
    ckpt = import_dcp(tmp_path / "dcp", tmp_path / "uc")
    export_hf(ckpt, tmp_path / "hf", config=_config())
    model, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        ours = model.eval()(input_ids=_tokens()).logits
    assert torch.equal(ours, logits)
