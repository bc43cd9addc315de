"""Testing tools shared by every plait package: the gloo harness, fault injection, parity helpers,
tiny-llama and data."""

from plait.kernels.testing.data import (
    ByteTokenizer,
    CorpusDataset,
    corpus_text,
    corpus_tokens,
    global_batch,
    rank_slice,
)
from plait.kernels.testing.distributed import (
    DistributedTestError,
    DistributedTimeoutError,
    free_port,
    run_distributed,
)
from plait.kernels.testing.faults import Fault, InjectedFaultError, lift_disk_full
from plait.kernels.testing.parity import assert_close_maps, assert_replicas_equal, state_digest, tensor_digest
from plait.kernels.testing.tiny_llama import CausalLMOutput, TinyLlama, TinyLlamaConfig, tiny_llama, tiny_llama_moe
from plait.kernels.testing.train import train_losses

__all__ = [
    "ByteTokenizer", "CausalLMOutput", "CorpusDataset", "DistributedTestError", "DistributedTimeoutError", "Fault",
    "InjectedFaultError",
    "TinyLlama", "TinyLlamaConfig", "assert_close_maps", "assert_replicas_equal", "corpus_text", "corpus_tokens",
    "free_port", "global_batch", "lift_disk_full", "rank_slice", "run_distributed", "state_digest", "tensor_digest",
    "tiny_llama",
    "tiny_llama_moe", "train_losses",
]
