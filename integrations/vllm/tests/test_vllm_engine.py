"""End to end on vLLM's CPU platform: greedy tokens equal HF ``generate`` for a tiny random Llama,
Mixtral, Gemma (GeGLU: vLLM's ``GeluAndMul``) and Qwen2-MoE (routed experts plus a gated shared
expert in the fused-MoE method), all head_dim 64, with the plugin on (plait's layers, weights from universal
checkpoints through ``load_format="plait_universal"``) and off (vLLM's layers, the same weights as
safetensors); a flipped byte in a checkpoint stops start-up with an error naming the file.

Two engine processes in all, each starting its engines one after the other (an ``LLM()`` start-up
costs 5-40 s here), shared by every assertion.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from plait.universal_ckpt import save  # noqa: E402
from plait.universal_ckpt.reader import read_manifest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_testing import hf_tokens, run_engine, tiny_model  # noqa: E402

FAMILIES = ("llama", "mixtral", "gemma", "qwen2_moe")
PLAIT_LAYERS = {  # plait's layers each family must run with the plugin on, and vLLM's they replace
    "llama": {"PlaitRMSNorm": "RMSNorm", "PlaitRotaryEmbedding": "RotaryEmbedding", "PlaitSiluAndMul": "SiluAndMul"},
    "mixtral": {"PlaitRMSNorm": "RMSNorm", "PlaitRotaryEmbedding": "RotaryEmbedding",
                "PlaitUnquantizedFusedMoEMethod": "UnquantizedFusedMoEMethod"},
    "gemma": {"PlaitGeluAndMul": "GeluAndMul", "PlaitRotaryEmbedding": "RotaryEmbedding"},  # GemmaRMSNorm is vLLM's
    "qwen2_moe": {"PlaitRMSNorm": "RMSNorm", "PlaitRotaryEmbedding": "RotaryEmbedding",
                  "PlaitSiluAndMul": "SiluAndMul", "PlaitUnquantizedFusedMoEMethod": "UnquantizedFusedMoEMethod"},
    "qwen3_moe": {"PlaitRMSNorm": "RMSNorm", "PlaitRotaryEmbedding": "RotaryEmbedding",
                  "PlaitUnquantizedFusedMoEMethod": "UnquantizedFusedMoEMethod"},
}


def _save_both(model, tmp: Path, family: str) -> tuple[Path, Path]:
    """The model as an HF directory (safetensors) and as a universal checkpoint root with config.json."""
    hf_dir, universal = tmp / f"{family}-hf", tmp / f"{family}-universal"
    model.save_pretrained(hf_dir)
    save({"model": model}, universal, step=1)
    model.config.save_pretrained(universal)  # vLLM reads config.json beside the checkpoint
    return hf_dir, universal


def _corrupted_copy(universal: Path, tmp: Path) -> tuple[Path, str]:
    corrupt = tmp / "corrupt"
    shutil.copytree(universal, corrupt)
    step = corrupt / "step-0000000001"
    piece = read_manifest(step).tensors["model/lm_head.weight"].pieces[0]
    raw = bytearray((step / piece.file).read_bytes())
    raw[piece.offset + 5] ^= 0x01
    (step / piece.file).write_bytes(bytes(raw))
    return corrupt, piece.file


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_e2e")
    expected, on_jobs, off_jobs = {}, [], []
    for family in FAMILIES:
        model = tiny_model(family)
        hf_dir, universal = _save_both(model, tmp, family)
        expected[family] = hf_tokens(model)
        on_jobs += ["--job", f"{family}={universal}@plait_universal"]
        off_jobs += ["--job", f"{family}={hf_dir}@safetensors"]
    corrupt, corrupt_file = _corrupted_copy(tmp / "llama-universal", tmp)
    on = run_engine(tmp, *on_jobs, "--corrupt", str(corrupt), name="plugin_on",
                    env={"PLAIT_VLLM": "1", "PLAIT_VLLM_CPU_PATH": "plait"})
    off = run_engine(tmp, *off_jobs, name="plugin_off", env={"PLAIT_VLLM": "0"})
    return {"hf": expected, "on": on, "off": off, "corrupt_file": corrupt_file}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_plugin_on_universal_checkpoint_tokens_equal_hf(runs, family):
    assert runs["on"][family]["tokens"] == runs["hf"][family]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_plugin_on_builds_plaits_layers(runs, family):
    layers = set(runs["on"][family]["layers"])
    # MoE experts run plait's fused_experts (PLAIT_VLLM_CPU_PATH=plait), Qwen2-MoE's shared expert beside them.
    assert set(PLAIT_LAYERS[family]) <= layers, sorted(layers)
    assert not set(PLAIT_LAYERS[family].values()) & layers, sorted(layers)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_plugin_off_tokens_equal_hf_with_vllms_layers(runs, family):
    assert runs["off"][family]["tokens"] == runs["hf"][family]
    layers = set(runs["off"][family]["layers"])
    assert set(PLAIT_LAYERS[family].values()) <= layers and not any(n.startswith("Plait") for n in layers), sorted(
        layers)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_plait_universal_checks_every_byte_once_inside_the_copy(runs, family):
    """One process, no TP: the loader's report says every byte of the checkpoint's tensors was checked
    (one tensor ahead of vLLM's copies on a worker thread, or before each is handed over) and says
    which of the two ran; vLLM's safetensors load leaves no report."""
    (report,) = runs["on"][family]["load_reports"]
    assert report["tensor_parallel"] is None and report["checked_bytes"] == report["mapped_bytes"] > 0, report
    assert report["check_worker"] in (True, False), report
    assert runs["off"][family]["load_reports"] == [None]


@pytest.mark.timeout(900)
def test_vllm_flipped_byte_fails_startup_naming_the_file(runs):
    error = runs["on"]["corrupt_error"]
    assert error is not None, "the engine started on a corrupted checkpoint"
    assert "CheckpointIntegrityError" in error and runs["corrupt_file"] in error, error[-3000:]


TP_CHUNK = 4096  # small checksum chunks, so that a rank's rows and the others' fall in different chunks


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """One engine at tensor_parallel_size=2 (vLLM's CPU workers, one core each) on a universal checkpoint."""
    tmp = tmp_path_factory.mktemp("vllm_tp2")
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    universal = tmp / "llama-universal"
    save({"model": model}, universal, step=1, chunk_bytes=TP_CHUNK)
    config.save_pretrained(universal)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"vLLM's CPU engine at TP=2 needs two cores (one per rank); this process may use {cpus}")
    # One core per rank: vLLM cannot bind its two workers' threads by NUMA node on a one-node machine.
    env = {"PLAIT_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"}
    run = run_engine(tmp, "--tp", "2", "--job", f"llama={universal}@plait_universal", name="tp2", env=env)
    return {"hf": hf_tokens(model), "run": run["llama"], "universal": universal}


def _rank_bytes(universal: Path, rank: int, size: int) -> tuple[int, int]:
    """(bytes a rank must read and check, bytes of the checkpoint): the chunks its dim-0 rows span
    (plait.vllm.tensor_parallel), whole tensors elsewhere (o_proj/down_proj are split along dim 1)."""
    from plait.vllm.checkpoint_weights import CheckpointWeights
    from plait.vllm.tensor_parallel import TensorParallelRank, rank_rows

    weights = CheckpointWeights(universal)
    tp = TensorParallelRank(rank=rank, size=size, num_key_value_heads=2)
    want = total = 0
    for entry in weights.entries():
        rows = rank_rows(weights.name_of(entry), entry.global_shape, tp)
        row = entry.nbytes // entry.global_shape[0]
        start, stop = (0, entry.nbytes) if rows is None else (rows[0] * row, rows[1] * row)
        want += min(entry.nbytes, -(-stop // TP_CHUNK) * TP_CHUNK) - start // TP_CHUNK * TP_CHUNK
        total += entry.nbytes
    return want, total


@pytest.mark.timeout(900)
def test_vllm_tp2_serves_the_checkpoint_with_hf_tokens(tp_run):
    assert tp_run["run"]["tokens"] == tp_run["hf"]


@pytest.mark.timeout(900)
def test_vllm_tp2_each_rank_reads_and_checks_only_its_byte_ranges(tp_run):
    """vLLM's own TP=2 engine: each rank's loader checked (and, through the mapped file, read) exactly
    the chunks its rows span of the dim-0-split weights and the whole of the others: less than the
    checkpoint, and the two ranks different parts of it."""
    reports = tp_run["run"]["load_reports"]
    assert sorted(tuple(r["tensor_parallel"]) for r in reports) == [(0, 2), (1, 2)], reports
    for report in reports:
        rank = report["tensor_parallel"][0]
        want, total = _rank_bytes(tp_run["universal"], rank, 2)
        assert report["mapped_bytes"] == total, report
        assert report["checked_bytes"] == want < total, (rank, report, want)
        assert report["check_worker"] is None, report  # ranks check inside vLLM's copies, no worker


# Every family plait-vllm serves, MoE included (plait's grouped-GEMM custom op inside vLLM's graph),
# and Qwen3-MoE, whose compiled start-up once failed on a data-dependent guard in plait's MoE op.
COMPILED_FAMILIES = (*FAMILIES, "qwen3_moe")
COMPILED_OPT_IN = "PLAIT_TEST_VLLM_COMPILED"
"""vLLM's compiled start-up takes 1-2 minutes per engine on the 2-core CI machine (dynamo tracing and
vLLM's warm-up, with or without inductor's code generation), so these run only with this set to 1."""


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory):
    """Each family with vLLM's compilation on (its default, inductor), plugin on and off."""
    if os.environ.get(COMPILED_OPT_IN) != "1":
        pytest.skip(f"vLLM's compiled engines take minutes to start; set {COMPILED_OPT_IN}=1 to run them")
    tmp = tmp_path_factory.mktemp("vllm_compiled")
    expected, jobs = {}, []
    for family in COMPILED_FAMILIES:
        model = tiny_model(family)
        hf_dir = tmp / f"{family}-hf"
        model.save_pretrained(hf_dir)
        expected[family] = hf_tokens(model)
        jobs += ["--job", f"{family}={hf_dir}@safetensors"]
    # No compile cache: a cached graph would skip the tracing these tests are about.
    common = {"VLLM_DISABLE_COMPILE_CACHE": "1"}
    on = run_engine(tmp, *jobs, "--compile-backend", "inductor", name="compiled_on",
                    env={**common, "PLAIT_VLLM": "1", "PLAIT_VLLM_CPU_PATH": "plait"}, timeout=1200)
    off = run_engine(tmp, *jobs, "--compile-backend", "inductor", name="compiled_off",
                     env={**common, "PLAIT_VLLM": "0"}, timeout=1200)
    return {"hf": expected, "on": on, "off": off}


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("family", COMPILED_FAMILIES)
def test_vllm_compiled_plugin_on_tokens_equal_plugin_off_and_hf(compiled_runs, family):
    """vLLM's default compiled engine with plait's layers (MoE included) starts and serves the tokens
    of the same engine without the plugin, and HF's."""
    assert compiled_runs["on"][family]["tokens"] == compiled_runs["off"][family]["tokens"]
    assert compiled_runs["on"][family]["tokens"] == compiled_runs["hf"][family]
    layers = set(compiled_runs["on"][family]["layers"])
    assert set(PLAIT_LAYERS[family]) <= layers, sorted(layers)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_compiled_plugin_on_tokens_equal_the_eager_engine(compiled_runs, runs, family):
    """The compiled engine with the plugin serves the tokens of the eager one (``enforce_eager=True``)."""
    assert compiled_runs["on"][family]["tokens"] == runs["on"][family]["tokens"]
