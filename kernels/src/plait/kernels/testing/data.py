"""The project's built-in default data: a small original text corpus and a byte-level tokenizer.

The corpus (``data/corpus.txt``) was written for plait and ships as package data, so training
runs anywhere without downloading anything. Batches are a pure function of ``(seed, step)``,
so a distributed run and its single-process reference see exactly the same global batch and
each rank can take its own slice of it.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Sequence
from importlib import resources

import torch
from torch.utils.data import Dataset


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255, plus ``bos`` (256), ``eos`` (257) and ``pad`` (258)."""

    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Text -> token ids."""
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Token ids -> text; special and out-of-range ids are dropped, broken UTF-8 replaced."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return bytes(i for i in values if 0 <= i < 256).decode("utf-8", errors="replace")


@functools.cache
def corpus_text() -> str:
    """The built-in corpus as text."""
    return resources.files("plait.kernels.testing").joinpath("data/corpus.txt").read_text(encoding="utf-8")


@functools.cache
def corpus_tokens() -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of byte tokens."""
    return torch.tensor(ByteTokenizer().encode(corpus_text()), dtype=torch.long)


def conditional_entropy(tokens: Sequence[int], *, context: int = 0) -> float:
    """Entropy in nats of the next token given the ``context`` tokens before it, measured on ``tokens``.

    ``context=0`` is the unigram entropy: the loss of a model that knows only how often each token
    occurs (for text, the letter frequencies). ``context=1`` is the bigram entropy: the best a model
    that looks at one previous token can do. A language model's mean loss on the same text falls
    below these only once it uses more than that.

    Args:
        tokens: the token sequence.
        context: tokens of history (>= 0).

    Returns:
        ``-sum p(h, t) ln p(t | h)`` over the (history, token) pairs of ``tokens``.

    Raises:
        ValueError: ``context`` is negative, or ``tokens`` has no more than ``context`` tokens.
    """
    values = list(tokens)
    if context < 0 or len(values) <= context:
        raise ValueError(f"context={context} needs 0 <= context < len(tokens)={len(values)}.")
    pairs = Counter(tuple(values[i - context: i + 1]) for i in range(context, len(values)))
    histories: Counter[tuple[int, ...]] = Counter()
    for pair, count in pairs.items():
        histories[pair[:-1]] += count
    total = sum(pairs.values())
    return -sum(count / total * math.log(count / histories[pair[:-1]]) for pair, count in pairs.items())


_WORD = re.compile(r"[a-z]+")


def text_words(text: str, *, drop_cut_off: bool = False) -> list[str]:
    """The lower-case words of ``text`` (runs of ASCII letters), in order.

    Args:
        text: any text.
        drop_cut_off: leave out a last word that runs to the end of ``text`` (a generated sample
            stops mid-word; only words something follows are complete).

    Returns:
        The words, repeats included.
    """
    lowered = text.lower()
    words = _WORD.findall(lowered)
    if drop_cut_off and words and _WORD.fullmatch(lowered[-1]):
        words.pop()
    return words


@functools.cache
def corpus_words() -> frozenset[str]:
    """Every distinct word of the built-in corpus, lower-case (see :func:`text_words`)."""
    return frozenset(text_words(corpus_text()))


def global_batch(step: int, batch_size: int, seq_len: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """The global batch of a training step: random windows of the corpus, a function of (seed, step).

    Args:
        step: the optimizer step (or micro-batch) number.
        batch_size: sequences in the global batch.
        seq_len: tokens per sequence.
        seed: data seed.

    Returns:
        ``{"input_ids": [batch, seq], "labels": [batch, seq]}`` (labels are inputs shifted by one).
    """
    tokens = corpus_tokens()
    if seq_len + 1 > tokens.numel():
        raise ValueError(
            f"seq_len={seq_len} is longer than the corpus ({tokens.numel()} tokens); use a shorter seq_len.")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([tokens[s: s + seq_len + 1] for s in starts.tolist()])
    return {"input_ids": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous()}


def rank_slice(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's contiguous share of a global batch (batch size must divide by ``world_size``)."""
    size = next(iter(batch.values())).shape[0]
    if size % world_size:
        raise ValueError(f"global batch size {size} is not divisible by world size {world_size}.")
    per = size // world_size
    return {key: value[rank * per: (rank + 1) * per] for key, value in batch.items()}


class CorpusDataset(Dataset):
    """Non-overlapping ``seq_len`` windows of the corpus, for DataLoader-driven training."""

    def __init__(self, seq_len: int, *, stride: int | None = None) -> None:
        self.tokens = corpus_tokens()
        self.seq_len = seq_len
        self.stride = stride or seq_len
        if seq_len + 1 > self.tokens.numel():
            raise ValueError(f"seq_len={seq_len} is longer than the corpus; use a shorter seq_len.")

    def __len__(self) -> int:
        return (self.tokens.numel() - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.stride
        window = self.tokens[start: start + self.seq_len + 1]
        return {"input_ids": window[:-1], "labels": window[1:]}
