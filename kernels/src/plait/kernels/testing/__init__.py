"""Testing tools shared by every plait package: the gloo harness, fault injection, parity helpers,
tiny-llama and data."""

from plait.kernels.testing.data import (
    ByteTokenizer,
    CorpusDataset,
    conditional_entropy,
    corpus_text,
    corpus_tokens,
    corpus_words,
    global_batch,
    rank_slice,
    text_words,
)
from plait.kernels.testing.distributed import (
    DistributedTestError,
    DistributedTimeoutError,
    free_port,
    run_distributed,
)
from plait.kernels.testing.faults import Fault, InjectedFaultError, lift_disk_full
from plait.kernels.testing.parity import assert_close_maps, assert_replicas_equal, state_digest, tensor_digest
from plait.kernels.testing.processes import (
    SessionRun,
    SessionTimeoutError,
    live_processes_mentioning,
    run_in_session,
    torchrun_command,
)
from plait.kernels.testing.tiny_llama import CausalLMOutput, TinyLlama, TinyLlamaConfig, tiny_llama, tiny_llama_moe
from plait.kernels.testing.train import train_losses

__all__ = [
    "ByteTokenizer", "CausalLMOutput", "CorpusDataset", "DistributedTestError", "DistributedTimeoutError", "Fault",
    "InjectedFaultError", "SessionRun", "SessionTimeoutError",
    "TinyLlama", "TinyLlamaConfig", "assert_close_maps", "assert_replicas_equal", "conditional_entropy", "corpus_text",
    "corpus_tokens", "corpus_words",
    "free_port", "global_batch", "lift_disk_full", "live_processes_mentioning",
    "rank_slice", "run_distributed", "run_in_session", "state_digest", "tensor_digest",
    "text_words", "tiny_llama", "torchrun_command",
    "tiny_llama_moe", "train_losses",
]
