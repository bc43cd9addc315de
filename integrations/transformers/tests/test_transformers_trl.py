"""TRL's ``SFTTrainer`` on plait ZeRO-3 (``with_plait(SFTTrainer)``) against its own DDP run, 2 gloo
processes, a tiny random Llama and an offline word-level tokenizer (no hub access).

TRL's ``SFTConfig`` defaults to ``bf16=True``; both precisions are compared.
"""

from __future__ import annotations

import math
import tempfile
from typing import Any

import pytest

from plait.kernels.testing import run_distributed

pytest.importorskip("trl")

RTOL_FP32 = 1e-5  # same data and seed; only the order of the cross-rank sums differs from DDP
RTOL_BF16 = 5e-4  # see test_transformers_distributed.RTOL_BF16 (bf16 compute parameters vs autocast only)


def _tokenizer() -> Any:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(250)} | {"<pad>": 250, "<eos>": 251, "<unk>": 252}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def _dataset() -> Any:
    import datasets
    import torch

    generator = torch.Generator().manual_seed(5)
    lengths = torch.randint(8, 24, (64,), generator=generator)
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(0, 250, (int(n),), generator=generator)) for n in lengths]
    return datasets.Dataset.from_dict({"text": texts})  # uneven lengths: padded batches


def _sft(route: str, bf16: bool) -> tuple[float, ...]:
    import transformers
    import trl

    from plait.transformers import with_plait
    from plait.transformers.demo import quiet, tiny_llama_model

    quiet()
    transformers.logging.set_verbosity_error()
    config = trl.SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=4,
                           learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
                           use_cpu=True, seed=0, data_seed=0, max_length=32, gradient_accumulation_steps=2,
                           bf16=bf16)
    cls = with_plait(trl.SFTTrainer, {"zero": {"stage": 3}}) if route == "plait" else trl.SFTTrainer
    trainer = cls(model=tiny_llama_model(), args=config, train_dataset=_dataset(), processing_class=_tokenizer())
    trainer.train()
    assert type(trainer).__name__ == ("PlaitSFTTrainer" if route == "plait" else "SFTTrainer")
    return tuple(float(h["loss"]) for h in trainer.state.log_history if "loss" in h)


def _runs() -> dict[str, tuple[float, ...]]:
    return {f"{route}_{'bf16' if bf16 else 'fp32'}": _sft(route, bf16)
            for route in ("ddp", "plait") for bf16 in (False, True)}


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[float, ...]]:
    return run_distributed(_runs, 2, timeout=300)[0]


@pytest.mark.parametrize(("precision", "rtol"), [("fp32", RTOL_FP32), ("bf16", RTOL_BF16)])
def test_sft_trainer_on_zero3_equals_its_ddp_run(runs: dict[str, tuple[float, ...]], precision: str,
                                                 rtol: float) -> None:
    ours, ddp = runs[f"plait_{precision}"], runs[f"ddp_{precision}"]
    assert len(ours) == len(ddp) == 4
    for a, e in zip(ours, ddp):
        assert math.isclose(a, e, rel_tol=rtol), (ours, ddp)
