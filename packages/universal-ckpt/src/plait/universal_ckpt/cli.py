"""``plait ckpt``: inspect, verify and convert checkpoints from the command line."""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

# Only what `plait ckpt --help` needs is imported here; torch and the readers load when a
# subcommand runs (the plait command's start-up stays well under a second).
from plait.universal_ckpt.errors import CheckpointError

SOURCE_KINDS = ("universal", "dcp", "deepspeed", "hf")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plait ckpt`` with ``inspect``, ``verify``, ``convert`` and ``quantize``.

    Args:
        subparsers: the ``plait`` command's subparsers.
    """
    parser = subparsers.add_parser("ckpt", help="universal checkpoints: inspect, verify, convert, quantize "
                                                "(plait-universal-ckpt)")
    commands = parser.add_subparsers(dest="ckpt_command", metavar="{inspect,verify,convert,quantize}")
    inspect = commands.add_parser("inspect", help="layout, tensors, sizes and integrity as a table")
    inspect.add_argument("path", help="checkpoint directory or root (its latest)")
    inspect.add_argument("--hash", action="store_true", help="also check every hash (reads all bytes)")
    inspect.add_argument("--limit", type=int, default=50, help="tensors to list (default 50; 0 for all)")
    inspect.set_defaults(func=run_inspect)
    verify = commands.add_parser("verify", help="check sizes, coverage and every hash; exit 1 on any problem")
    verify.add_argument("path", help="checkpoint directory or root (its latest)")
    verify.set_defaults(func=run_verify)
    convert = commands.add_parser("convert", help="convert between universal, HF safetensors, DCP and DeepSpeed")
    convert.add_argument("src", help="source: universal, DCP, DeepSpeed ZeRO or HF safetensors (detected)")
    convert.add_argument("dst", help="destination directory (a checkpoint root for --to universal)")
    convert.add_argument("--to", required=True, choices=("universal", "hf", "dcp"), help="target format")
    convert.add_argument("--dtype", default=None, help="cast floating weights for --to hf, e.g. bfloat16")
    convert.add_argument("--key", default=None, help="state-dict key of the model (hf export; import target key)")
    convert.add_argument("--config", default=None,
                         help="HF config.json (or a directory holding it) written with --to hf; needed for a "
                              "quantized checkpoint, whose quantization_config goes into it")
    convert.set_defaults(func=run_convert)
    quantize = commands.add_parser("quantize", help="weight-only int8/int4 universal checkpoint from a universal one")
    quantize.add_argument("src", help="universal checkpoint directory or root (its latest); hashes are checked")
    quantize.add_argument("dst", help="new checkpoint root (must not exist)")
    quantize.add_argument("--bits", type=int, required=True, choices=(8, 4), help="8: per channel; 4: group-wise")
    quantize.add_argument("--group-size", type=int, default=None, help="int4 group size: 32, 64 (default) or 128")
    sym = quantize.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_true", default=True,
                     help="int4 without zero points (default)")
    sym.add_argument("--asymmetric", dest="symmetric", action="store_false", help="int4 with a zero point per group")
    quantize.add_argument("--include-head", action="store_true", help="also quantize lm_head.weight")
    quantize.add_argument("--include-embedding", action="store_true", help="also quantize the input embedding")
    quantize.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                          help="keep weights matching this fnmatch pattern in full precision (repeatable)")
    quantize.add_argument("--key", default=None, help="state-dict key of the model (default: the only one)")
    quantize.add_argument("--config", default=None,
                          help="HF config.json (or its directory): written to DST/config.json with the "
                               "quantization_config, so vLLM serves DST with load_format=plait_universal")
    quantize.set_defaults(func=run_quantize)
    parser.set_defaults(func=lambda args: _usage(parser))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _progress(total: int | None, desc: str) -> contextlib.AbstractContextManager[Callable[[int], None]]:
    """Bytes done, on stderr: a bar on a terminal, one line at the end in a log."""
    from plait.kernels.progress import progress

    return progress(desc, total=total)


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return str(nbytes)


def run_inspect(args: argparse.Namespace) -> int:
    """Print the layout, a table of tensors and the integrity status; 1 when a check fails."""
    from plait.universal_ckpt import directory, layouts
    from plait.universal_ckpt.reader import check_coverage, check_files, read_manifest, verify_checkpoint

    try:
        ckpt = directory.resolve(args.path)
        manifest = read_manifest(ckpt)
    except CheckpointError as exc:
        print(f"plait ckpt inspect: {exc}", file=sys.stderr)
        return 1
    layout = manifest.layout
    print(f"checkpoint {ckpt}  step {manifest.step}  format v{manifest.format_version}  {manifest.hash_algorithm}")
    print(f"layout: world_size={layout.world_size} mesh={layout.mesh or '-'} zero_stage={layout.zero_stage} "
          f"ep={layout.expert_parallel_size} sp={layout.sequence_parallel_size} offload={layout.offload}")
    ep = layout.mesh.get("ep", layout.expert_parallel_size)
    sp = layout.mesh.get("sp", layout.sequence_parallel_size)
    if "tp" in layout.mesh or "pp" in layout.mesh or ep > 1 or sp > 1:  # a model-parallel producer
        print(f"model parallel: tp={layout.mesh.get('tp', 1)} pp={layout.mesh.get('pp', 1)} "
              f"dp={layout.mesh.get('dp', 1)} ep={ep} sp={sp}")
    if "quantization" in manifest.user_meta:
        from plait.universal_ckpt.quantize import describe

        record = manifest.user_meta["quantization"]
        print(f"quantized: {describe(record)}, {len(record.get('tensors', {}))} weights of key {record.get('key')!r} "
              f"({len(record.get('kept', {}))} kept in full precision)")
    entries = sorted(manifest.tensors.values(), key=lambda e: e.full_name)
    shown = entries if args.limit == 0 else entries[:args.limit]
    rows = [(e.full_name, e.kind, e.dtype, "x".join(map(str, e.global_shape)) or "scalar", str(len(e.pieces)),
             _size(e.nbytes), layouts.describe(e.pattern)) for e in shown]
    print(_table(rows, ("tensor", "kind", "dtype", "shape", "pieces", "size", "pattern")))
    if len(shown) < len(entries):
        print(f"... and {len(entries) - len(shown)} more (--limit 0 lists all)")
    by_kind: dict[str, int] = {}
    for entry in entries:
        by_kind[entry.kind] = by_kind.get(entry.kind, 0) + entry.nbytes
    on_disk = sum(manifest.files.values()) + sum(o.nbytes for o in manifest.objects.values())
    raw = sum(e.nbytes for e in entries)
    print(_table([(k, _size(v)) for k, v in sorted(by_kind.items())] + [("total tensors", _size(raw)),
                 ("on disk (data+objects)", _size(on_disk))], ("kind", "bytes")))
    print(f"files: {len(manifest.files)} data, {len(manifest.objects)} object; object keys: "
          f"{sorted({k for o in manifest.objects.values() for k in o.keys}) or '-'}")
    try:
        check_files(ckpt, manifest)
        problems = [p for p in (check_coverage(e) for e in entries) if p]
        if problems:
            raise CheckpointError(problems[0])
        if args.hash:
            with _progress(raw, "hashing") as update:
                verify_checkpoint(ckpt, progress=update)
    except CheckpointError as exc:
        print(f"integrity: FAILED: {exc}")
        return 1
    print("integrity: OK (" + ("sizes, coverage and every hash" if args.hash else
                                "sizes and coverage; --hash or `plait ckpt verify` checks hashes") + ")")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """Check everything; print OK or the first problem (file, expected, actual)."""
    from plait.universal_ckpt import directory
    from plait.universal_ckpt.reader import read_manifest, verify_checkpoint

    try:
        ckpt = directory.resolve(args.path)
        total = sum(e.nbytes for e in read_manifest(ckpt).tensors.values())
        with _progress(total, "verifying") as update:
            manifest = verify_checkpoint(ckpt, progress=update)
    except CheckpointError as exc:
        print(f"plait ckpt verify: FAILED: {exc}")
        return 1
    print(f"plait ckpt verify: OK: {ckpt} step {manifest.step}, {len(manifest.tensors)} tensors, "
          f"{len(manifest.files) + len(manifest.objects)} files, every hash matches")
    return 0


def detect_format(path: Path) -> str:
    """Which checkpoint format lives at ``path``: universal, dcp, deepspeed or hf.

    Raises:
        CheckpointError: none recognised.
    """
    from plait.universal_ckpt import directory

    if path.is_dir() and ((path / "manifest.json").is_file() or directory.latest(path) is not None):
        return "universal"
    if (path / ".metadata").is_file():
        return "dcp"
    tag = (path / "latest").read_text().strip() if (path / "latest").is_file() else ""
    if any(path.glob("*_optim_states.pt")) or (tag and any((path / tag).glob("*_optim_states.pt"))):
        return "deepspeed"
    if path.suffix == ".safetensors" or any(path.glob("*.safetensors")):
        return "hf"
    raise CheckpointError(f"{path} is not a checkpoint this tool knows ({', '.join(SOURCE_KINDS)}).")


def _to_universal(src: Path, kind: str, dst: Path, key: str | None, update: Callable[[int], None]) -> Path:
    if kind == "dcp":
        from plait.universal_ckpt.interop.dcp import import_dcp

        return import_dcp(src, dst, progress=update)
    if kind == "deepspeed":
        from plait.universal_ckpt.interop.deepspeed import import_deepspeed

        return import_deepspeed(src, dst, key=key or "model", progress=update)
    from plait.universal_ckpt.interop.hf import import_hf

    return import_hf(src, dst, key=key or "model", progress=update)


def _hf_config(path: str | None) -> dict | None:
    """The JSON of ``--config`` (a config.json or a directory holding one), or None."""
    import json

    if path is None:
        return None
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise CheckpointError(f"--config {path}: no config.json there.")
    return json.loads(file.read_text())


def _quantized(ckpt: Path) -> bool:
    from plait.universal_ckpt import directory
    from plait.universal_ckpt.reader import read_manifest

    return "quantization" in read_manifest(directory.resolve(ckpt)).user_meta


def run_convert(args: argparse.Namespace) -> int:
    """Convert SRC to DST; the source is never modified. Returns 1 on a refused conversion."""
    import torch

    src, dst = Path(args.src), Path(args.dst)
    dtype = None
    if args.dtype is not None:
        dtype = getattr(torch, args.dtype, None)
        if not isinstance(dtype, torch.dtype) or args.to != "hf":
            print(f"plait ckpt convert: --dtype {args.dtype!r} must name a torch dtype and is used with --to hf.",
                  file=sys.stderr)
            return 2
    try:
        if not src.exists():
            raise CheckpointError(f"{src} does not exist.")
        kind = detect_format(src)
        if kind == "universal" and args.to == "universal":
            raise CheckpointError(f"{src} is already a universal checkpoint.")
        with tempfile.TemporaryDirectory(prefix="plait-ckpt-") as scratch, _progress(None, "converting") as update:
            universal = src
            if kind != "universal":
                universal = _to_universal(src, kind, dst if args.to == "universal" else Path(scratch), args.key, update)
            # ``--config`` came later than ``convert`` itself: a caller's hand-built Namespace may lack it.
            config = _hf_config(getattr(args, "config", None))
            if args.to == "hf" and _quantized(universal):
                from plait.universal_ckpt.interop.hf_quantized import export_quantized_hf

                if dtype is not None:
                    raise CheckpointError(f"--dtype {args.dtype} with a quantized checkpoint: its codes and "
                                          "scales are exported as they are; drop --dtype.")
                export_quantized_hf(universal, dst, config=config, progress=update)
            elif args.to == "hf":
                from plait.universal_ckpt.interop.hf import export_hf

                export_hf(universal, dst, key=args.key, dtype=dtype, config=config, progress=update)
            elif args.to == "dcp":
                from plait.universal_ckpt.interop.dcp import export_dcp

                export_dcp(universal, dst, progress=update)
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"plait ckpt convert: {exc}", file=sys.stderr)
        return 1
    print(f"plait ckpt convert: {kind} {src} -> {args.to} {dst}")
    return 0


def run_quantize(args: argparse.Namespace) -> int:
    """Quantize SRC into the new root DST; 2 for bad options, 1 for a refused checkpoint (nothing written)."""
    from plait.universal_ckpt.quantize import CheckpointQuantizeConfig, quantize_checkpoint

    try:
        config = CheckpointQuantizeConfig(bits=args.bits, group_size=args.group_size, symmetric=args.symmetric,
                                          include_head=args.include_head, include_embedding=args.include_embedding,
                                          skip=tuple(args.skip), key=args.key)
    except ValueError as exc:
        print(f"plait ckpt quantize: {exc}", file=sys.stderr)
        return 2
    try:
        hf_config = _hf_config(args.config)
        with _progress(None, "quantizing") as update:
            report = quantize_checkpoint(args.src, args.dst, config, hf_config=hf_config, progress=update)
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"plait ckpt quantize: {exc}", file=sys.stderr)
        return 1
    print(f"plait ckpt quantize: {report.path}: {len(report.quantized)} weights {config.scheme.kind}"
          f"{'' if config.bits == 8 else f' group {config.scheme.group_size}'}, "
          f"{_size(report.bytes_before)} -> {_size(report.bytes_after)}")
    if report.kept:
        print(_table([(name, why) for name, why in report.kept], ("kept in full precision", "why")))
    if report.dropped:
        print(f"not written (training state): {len(report.dropped)} entries, e.g. {', '.join(report.dropped[:3])}")
    return 0
