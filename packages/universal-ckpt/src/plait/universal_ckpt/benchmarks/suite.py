"""``plait bench universal-ckpt``: save/load against PyTorch DCP, bytes on disk, DeepSpeed import.

Setup: tiny-llama (8 layers, 8.4M parameters; 2 layers with ``--quick``) sharded ZeRO-3 style over
two gloo ranks by the package's toy producer, so each rank holds a third of parameters plus Adam
moments as flat fp32 pieces. DCP saves the very same per-rank tensors (as distinct keys, so it too
writes each rank's bytes once, in parallel). Both fsync (DCP's FileSystemWriter does by default).
Every save goes to a fresh directory; ours and DCP alternate (A B A B) and the median is reported.
Loads read what was just written (page cache for both). The DeepSpeed row converts one ZeRO-2
checkpoint written by deepspeed itself with ``ds_to_universal`` and with our importer; the
model-parallel rows (``suite_mp``) do the same for a DeepSpeed AutoTP=2 and a 2-stage
``PipelineModule`` checkpoint of about 100M parameters (tiny with ``--quick``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import itertools
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from plait.kernels.bench import BenchRow, TimingStats, interleaved_timing, timing_row

TARGET_TIME = 1.2
TARGET_BYTES = 1.02


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _hash_rows() -> list[BenchRow]:
    data = os.urandom(32 << 20)

    def digest(name: str) -> None:
        hashlib.new(name, data).digest()

    stats = interleaved_timing({"sha256": lambda: digest("sha256"), "blake2b": lambda: digest("blake2b")},
                               warmup=1, steps=10)
    mbps = {name: len(data) / s.median / 2**20 for name, s in stats.items()}
    return [BenchRow(benchmark="hash 32 MiB (chosen: sha256)", figure="throughput (MiB/s)", ours=mbps["sha256"],
                     peer="blake2b", peer_value=mbps["blake2b"], ratio=mbps["sha256"] / mbps["blake2b"],
                     note="higher is better; the faster one here is the format's hash")]


def save_load_rank(tmp: str, quick: bool) -> list[BenchRow] | None:
    """Runs on each of 2 ranks; rank 0 returns the rows."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import plait.universal_ckpt as uc
    from plait.kernels.testing import tiny_llama
    from plait.universal_ckpt.testing import ToyZero, ToyZeroConfig

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = tiny_llama(num_layers=2 if quick else 8)
    engine = ToyZero(model, ToyZeroConfig(stage=3))
    engine.exp_avg.normal_()
    engine.exp_avg_sq.uniform_()
    pieces = engine.sharded_state_dict()
    # DCP gets the same live pieces (aliases), and after loading it refreshes the producer exactly as
    # our load does (load_sharded_state_dict), so both arms do the same work around the I/O.
    peer_state = {f"rank{rank}/{name}": p.local for name, p in pieces.items() if p.spec.writer_rank == rank}

    def load_dcp() -> None:
        dcp.load(peer_state, checkpoint_id=str(dcp_dir))
        engine.load_sharded_state_dict(pieces)

    counter = itertools.count()
    ours_root, dcp_root = Path(tmp, "ours"), Path(tmp, "dcp")

    def save_ours() -> None:
        uc.save({"zero": engine}, ours_root, step=next(counter))

    def save_dcp() -> None:
        dcp.save(peer_state, checkpoint_id=str(dcp_root / str(next(counter))))

    warmup, steps = (1, 5) if quick else (3, 10)
    saves = interleaved_timing({"ours": save_ours, "dcp": save_dcp}, warmup=warmup, steps=steps)
    ours_ckpt = uc.latest(ours_root)
    dcp_dir = max(dcp_root.iterdir(), key=lambda p: int(p.name))
    dist.barrier()
    loads = interleaved_timing({
        "ours": lambda: uc.load({"zero": engine}, ours_ckpt),
        "ours_noverify": lambda: uc.load({"zero": engine}, ours_ckpt, verify=False),
        "dcp": load_dcp,
    }, warmup=warmup, steps=steps)
    dist.barrier()
    if rank != 0:
        return None
    manifest = uc.read_manifest(ours_ckpt)
    raw = sum(e.nbytes for e in manifest.tensors.values())
    ours_bytes, dcp_bytes = _dir_bytes(ours_ckpt), _dir_bytes(dcp_dir)
    label = f"tiny-llama {'2' if quick else '8'} layers ZeRO-3 W=2, {raw / 2**20:.0f} MiB"
    return [
        timing_row(f"save {label}", saves["ours"], "torch DCP", saves["dcp"], target_ratio=TARGET_TIME),
        timing_row(f"load (verify) {label}", loads["ours"], "torch DCP", loads["dcp"], target_ratio=TARGET_TIME),
        timing_row(f"load (verify=False) {label}", loads["ours_noverify"], "torch DCP", loads["dcp"],
                   target_ratio=TARGET_TIME),
        BenchRow(benchmark=f"bytes on disk {label}", figure="bytes / raw tensor bytes", ours=ours_bytes / raw,
                 peer="torch DCP", peer_value=dcp_bytes / raw, ratio=ours_bytes / raw, target=f"<= {TARGET_BYTES}",
                 passed=ours_bytes / raw <= TARGET_BYTES,
                 note=f"ours {ours_bytes} B incl. manifest, raw {raw} B, DCP {dcp_bytes} B"),
    ]


def make_deepspeed_checkpoint(root: str, layers: int) -> bool:
    """Write a DeepSpeed ZeRO-2 checkpoint of tiny-llama with deepspeed itself (2 CPU ranks)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.ops

    from plait.kernels.testing import global_batch, rank_slice, tiny_llama

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of a shm all-reduce
    deepspeed.init_distributed("gloo")
    torch.manual_seed(0)
    model = tiny_llama(num_layers=layers)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    batch = rank_slice(global_batch(0, 2, 16), engine.global_rank, 2)
    engine.backward(engine(batch["input_ids"], batch["labels"]).loss)
    engine.step()
    engine.save_checkpoint(root, tag="step1", client_state={"universal_checkpoint_info": {}})
    return True


def _deepspeed_rows(tmp: Path, quick: bool) -> list[BenchRow]:
    try:
        import deepspeed  # noqa: F401
        from deepspeed.checkpoint import ds_to_universal
    except ImportError as exc:
        return [BenchRow(benchmark="DeepSpeed import", figure="time (ms)", ours=float("nan"),
                         peer="ds_to_universal", note=f"deepspeed not installed: {exc}")]
    from plait.kernels.testing import run_distributed
    from plait.universal_ckpt.interop.deepspeed import import_deepspeed

    layers = 2 if quick else 8
    src = tmp / "ds"
    run_distributed(make_deepspeed_checkpoint, 2, str(src), layers, timeout=300, env={"DS_ACCELERATOR": "cpu"})
    counter = itertools.count()

    def theirs() -> None:
        argv, sys.argv = sys.argv, ["ds_to_universal", "--input_folder", str(src / "step1"), "--output_folder",
                                    str(tmp / f"dsu{next(counter)}"), "--num_extract_workers", "1",
                                    "--num_merge_workers", "1"]
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                ds_to_universal.main(ds_to_universal.parse_arguments())
        finally:
            sys.argv = argv

    def ours() -> None:
        import_deepspeed(src, tmp / f"ucu{next(counter)}")

    stats: dict[str, TimingStats] = interleaved_timing({"ours": ours, "ds": theirs}, warmup=1, steps=3 if quick else 5)
    row = timing_row(f"DeepSpeed ZeRO-2 -> universal, tiny-llama {layers} layers W=2", stats["ours"],
                     "ds_to_universal", stats["ds"], target_ratio=1.0)
    return [BenchRow(**{**row.__dict__, "note": row.note + f"; {len(stats['ours'].samples)} timed runs"})]


def run(quick: bool) -> list[BenchRow]:
    """The suite (see the module docstring).

    Args:
        quick: smaller model and fewer repetitions (about a minute on 2 cores).

    Returns:
        The rows of the table.
    """
    from plait.kernels.testing import run_distributed

    rows = _hash_rows()
    with tempfile.TemporaryDirectory(prefix="plait-ckpt-bench-") as tmp:
        started = time.monotonic()
        rows += run_distributed(save_load_rank, 2, tmp, quick, timeout=600)[0]
        shutil.rmtree(Path(tmp, "ours"), ignore_errors=True)
        shutil.rmtree(Path(tmp, "dcp"), ignore_errors=True)
        rows += _deepspeed_rows(Path(tmp), quick)
        from plait.universal_ckpt.benchmarks.suite_mp import model_parallel_rows

        rows += model_parallel_rows(Path(tmp), quick)
        print(f"universal-ckpt bench took {time.monotonic() - started:.0f}s", file=sys.stderr)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    from plait.kernels.bench import format_table

    print(format_table(run(parser.parse_args().quick)))
