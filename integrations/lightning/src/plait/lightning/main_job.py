"""``plait train``: the project's main job, end to end through Lightning.

1. trains tiny-llama on the built-in corpus with ``plait_zero3`` on 2 processes (GPUs where there
   are two, one GPU where there is one, CPU with gloo otherwise), progress bar on;
2. saves a universal checkpoint (a directory, one shard file per rank);
3. resumes it on 1 process and continues the same loss curve;
4. reads the consolidated weights back without any process group, exports them as HF
   safetensors, and generates a short sample with a plain (unsharded) model;
5. prints a table (loss at start and end, tokens/s, model-state bytes per rank against DDP's formula,
   bytes communicated per step against the ZeRO formula, checkpoint size) and writes it as JSON
   with a PNG of the loss curve to ``--out`` (default ``./out/main-job/``).

Each training phase is a child program (``python -m plait.lightning.main_job --phase ...``)
because Lightning's launcher starts the extra ranks by re-running the program that built the Trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from plait.kernels.bench import load_average, run_meta
from plait.kernels.collectives import ByteLedger
from plait.lightning.demo import LossRecorder, TinyLlamaModule
from plait.lightning.main_job_cli import register
from plait.lightning.main_job_report import build_report, plot_losses, print_report
from plait.lightning.progress import StepProgressBar
from plait.zero_sharding import model_state_bytes

# tiny-llama's layout (RMSNorm, RoPE, SwiGLU, untied head) at 2 layers of width 128 (0.53M
# parameters): on 2 CPU cores it takes a few hundred steps inside the minute, enough to learn
# words of the built-in corpus, where the benchmark shape (8 layers of 256) managed 40 steps in the
# same time and stayed at the letter frequencies. Vocab 512 covers the byte tokenizer's 259 ids.
DEFAULT_MODEL = {"vocab_size": 512, "num_layers": 2, "hidden_size": 128, "num_heads": 4, "intermediate_size": 344}
QUICK_MODEL = {"num_layers": 2, "hidden_size": 64, "num_heads": 2, "intermediate_size": 96, "vocab_size": 300,
               "max_seq_len": 64}
PROMPT = "The checkpoint"
OUTPUTS = ("checkpoint", "checkpoint-final", "hf", "phase-train.json", "phase-resume.json", "main-job.json",
           "loss.png")


def _accelerator(args: argparse.Namespace) -> tuple[str, int]:
    gpus = 0 if args.cpu else torch.cuda.device_count()
    if gpus >= args.devices:
        return "gpu", args.devices
    if gpus == 1:
        print(f"plait train: one GPU found; the first phase runs on 1 GPU process instead of {args.devices}.")
        return "gpu", 1
    return "cpu", args.devices


def _phase(name: str, args: argparse.Namespace, common: list[str], env: dict[str, str]) -> float:
    command = [sys.executable, "-m", "plait.lightning.main_job", "--phase", name, *common]
    print(f"\n== {name}: {' '.join(command[1:5])} ... ==", flush=True)
    started = time.perf_counter()
    result = subprocess.run(command, env=env, check=False)
    if result.returncode != 0:
        raise SystemExit(f"plait train: the {name} phase failed (exit {result.returncode}); see the output above.")
    return time.perf_counter() - started


def _command(args: argparse.Namespace) -> str:
    """The ``plait train`` command line of this run (the options that differ from the defaults)."""
    parser = argparse.ArgumentParser(prog="plait")
    register(parser.add_subparsers(dest="command"))
    defaults = vars(parser.parse_args(["train"]))
    changed = [(name, value) for name, value in vars(args).items()
               if name in defaults and name not in ("func", "command") and value != defaults[name]]
    flags = [f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}") for name, value in changed]
    return " ".join(["plait train", *flags])


def run(args: argparse.Namespace) -> int:
    """Run the main job (see the module docstring). Returns the exit code."""
    started, load_before = time.perf_counter(), load_average()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:  # only what an earlier run of this job wrote; nothing else in --out is touched
        target = out / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
    accelerator, devices = _accelerator(args)
    precision = args.precision or ("bf16-mixed" if accelerator == "gpu" else "32-true")
    model = QUICK_MODEL if args.quick else DEFAULT_MODEL
    steps, resume_steps = (6, 3) if args.quick else (args.steps, args.resume_steps)
    seq_len = min(args.seq_len, 64) if args.quick else args.seq_len
    checkpoint = out / "checkpoint"
    cores = os.cpu_count() or 1
    common = ["--out", str(out), "--checkpoint", str(checkpoint), "--model", json.dumps(model),
              "--strategy", args.strategy, "--precision", precision, "--accelerator", accelerator,
              "--devices", str(devices), "--steps", str(steps), "--resume-steps", str(resume_steps),
              "--batch-size", str(args.batch_size), "--seq-len", str(seq_len)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    print(f"plait train: tiny-llama {model or '(benchmark shape)'} on the built-in corpus, {args.strategy}, "
          f"{devices} x {accelerator}, precision {precision}; {steps} steps, then resume on 1 process for "
          f"{resume_steps} more. Output: {out}")
    walls = {
        "train": _phase("train", args, [*common, "--threads", str(max(1, cores // devices))], env),
        "resume": _phase("resume", args, [*common, "--threads", str(max(1, min(cores, 2)))], env),
    }
    phases = {name: json.loads((out / f"phase-{name}.json").read_text()) for name in ("train", "resume")}
    report = build_report(phases, checkpoint, out, model=model, prompt=PROMPT, walls=walls,
                          total_s=time.perf_counter() - started, learning_targets=not args.quick)
    plot = plot_losses(phases, out / "loss.png", references={
        f"letter frequencies (unigram entropy, {report['unigram_entropy']:.2f})": report["unigram_entropy"],
        f"letter pairs (bigram entropy, {report['bigram_entropy']:.2f})": report["bigram_entropy"]})
    report["total_wall_s"] = round(time.perf_counter() - started, 1)
    # The same metadata `plait bench` writes, so `plait bench lightning --table --out <main-job.json>`
    # prints the README's main-job table from a committed copy of this file.
    report["meta"] = run_meta(_command(args), load_before)
    (out / "main-job.json").write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)
    print(f"\nwrote {out / 'main-job.json'}, {plot or 'no plot'}, checkpoint {checkpoint}, HF weights {out / 'hf'}")
    return 0 if report["ok"] else 1


class StepMeter(L.Callback):
    """Rank 0's wall time, logical bytes communicated and model-state bytes of every step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.volumes: list[int] = []
        self.state_bytes: dict[str, int] = {}
        self._ledger: ByteLedger | None = None
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Open this step's byte ledger and start its clock."""
        self._ledger = ByteLedger().__enter__()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Close the ledger; keep time, bytes and (once) the model-state bytes after the step."""
        self.times.append(time.perf_counter() - self._start)
        if self._ledger is not None:
            self._ledger.__exit__(None, None, None)
            self.volumes.append(self._ledger.volume())
            self._ledger = None
        if not self.state_bytes:
            self.state_bytes = model_state_bytes(pl_module)


def _trainer(args: argparse.Namespace, devices: int, callbacks: list[Any], max_steps: int) -> L.Trainer:
    accelerator = "gpu" if args.accelerator == "gpu" else "cpu"
    # The bar counts optimizer steps toward max_steps; off a terminal it prints a few plain lines.
    return L.Trainer(accelerator=accelerator, devices=devices, strategy=args.strategy, precision=args.precision,
                     max_steps=max_steps, callbacks=[*callbacks, StepProgressBar()], logger=False,
                     enable_checkpointing=False, enable_model_summary=False, use_distributed_sampler=False,
                     limit_val_batches=2, val_check_interval=max_steps, num_sanity_val_steps=0, log_every_n_steps=1)


def run_phase(args: argparse.Namespace) -> int:
    """Run one training phase in this process (Lightning starts the other ranks by re-running
    ``python -m plait.lightning.main_job --phase ...``) and write ``phase-<name>.json`` on rank 0."""
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    total = args.steps + args.resume_steps
    L.seed_everything(args.seed, verbose=False)
    module = TinyLlamaModule(json.loads(args.model), batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                             warmup=max(1, total // 10), total_steps=total, seed=args.seed,
                             in_configure_model=True)
    recorder, meter = LossRecorder(), StepMeter()
    devices = args.devices if args.phase == "train" else 1
    max_steps = args.steps if args.phase == "train" else total
    trainer = _trainer(args, devices, [recorder, meter], max_steps)
    started = time.perf_counter()
    trainer.fit(module, ckpt_path=None if args.phase == "train" else args.checkpoint)
    elapsed = time.perf_counter() - started
    # The train phase's checkpoint is what the resume phase loads; the resume phase saves the final
    # weights the orchestrator consolidates and samples from.
    trainer.save_checkpoint(args.checkpoint if args.phase == "train" else out / "checkpoint-final")
    if trainer.global_rank != 0:
        return 0
    warm = meter.times[3:] or meter.times
    result = {
        "phase": args.phase, "devices": devices, "world_size": trainer.world_size, "losses": recorder.losses,
        "step_time_s": statistics.median(warm), "fit_wall_s": elapsed,
        "tokens_per_step": args.batch_size * args.seq_len,
        "volume_per_step": int(statistics.median(meter.volumes[1:] or meter.volumes)) if meter.volumes else 0,
        "state_bytes": meter.state_bytes, "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
        "num_params": sum(s.numel for u in module.zero_engine.units for s in u.slots),
        "precision": trainer.precision_plugin.precision, "strategy": args.strategy,
        "accelerator": str(trainer.strategy.root_device.type),
    }
    (out / f"phase-{args.phase}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


def build_phase_parser() -> argparse.ArgumentParser:
    """A phase's arguments (the orchestrator passes all of them)."""
    parser = argparse.ArgumentParser(prog="python -m plait.lightning.main_job --phase")
    parser.add_argument("--phase", choices=("train", "resume"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--model", default="{}", help="JSON overrides of TinyLlamaConfig")
    parser.add_argument("--strategy", default="plait_zero3")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--resume-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    return parser



def main(argv: list[str] | None = None) -> int:
    """``python -m plait.lightning.main_job``: the same as ``plait train``; with ``--phase`` one
    training phase (what the orchestrator and Lightning's launcher run)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--phase" in argv:
        return run_phase(build_phase_parser().parse_args(argv))
    parser = argparse.ArgumentParser(prog="plait")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", *argv])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
