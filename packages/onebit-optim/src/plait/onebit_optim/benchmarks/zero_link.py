"""The ZeRO-2 rows of ``plait bench onebit-optim`` at 1 Gbit/s alone, with more timed blocks, against
DDP + AdamW in the same launch (``python -m plait.onebit_optim.benchmarks.zero_link --out PATH``).

The full suite runs every variant on three links (about 12 minutes on 2 cores); this runs one
launch on the 1 Gbit/s emulated link (:mod:`.netem`, as root) with DDP + AdamW, ZeRO-2 + AdamW,
ZeRO-2 + 1-bit Adam with ZeRO's exact parameter gather and with ``zero_param_sync="update"``
(no gather), alternating blocks as the suite does (:mod:`.worker`). Besides the suite's rows
(each ZeRO variant against ZeRO-2 + AdamW), each ZeRO variant gets a row against DDP + AdamW
whose ratio is taken block by block (variant's block ``i`` / DDP's block ``i``, which ran next to
each other): the median ratio, with its p10/p90, and the target ``<= 0.6`` judged by the p90.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from plait.kernels.bench import BenchRow, TimingStats, format_table, load_average, run_meta, write_json
from plait.onebit_optim.benchmarks import netem
from plait.onebit_optim.benchmarks.suite import REFERENCE, _launch, _rows, _spec

VARIANTS = ["ddp_adamw", "zero2_adamw", "zero2_onebit_adam", "zero2_onebit_adam_update"]
TARGET = 0.6  # 1-bit Adam under ZeRO-2 against DDP + AdamW at 1 Gbit/s, by the p90 of the ratio


def run(blocks: int, rate: str = "1gbit") -> list[BenchRow]:
    """One launch on the emulated link (see the module docstring).

    Args:
        blocks: timed blocks of 4 steps per variant (after one warm-up block).
        rate: the link's ``tc`` rate.

    Returns:
        The rows.

    Raises:
        RuntimeError: the network namespaces cannot be made (not root, no ``ip``/``tc``).
    """
    reason = netem.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"zero_link needs the emulated link: {reason}")
    spec = {**_spec(False), "blocks": blocks, "timeout": 3600}
    with netem.emulated_link() as link:
        link.set_rate(rate)
        results = _launch(link, spec, VARIANTS)
    return _rows({rate: results}, None) + against_ddp(results, rate)


def against_ddp(results: dict[str, Any], rate: str) -> list[BenchRow]:
    """Each ZeRO variant's step against DDP + AdamW's, block by block (see the module docstring)."""
    ddp = [b["seconds"] for b in results.get(REFERENCE, {}).get("blocks", []) if b["timed"]]
    rows = []
    for name in VARIANTS[1:]:
        ours = [b["seconds"] for b in results.get(name, {}).get("blocks", []) if b["timed"]]
        if not ours or len(ours) != len(ddp):
            rows.append(BenchRow(benchmark=f"{name} step vs DDP, W=2, {rate}", figure="time/step ratio",
                                 ours=float("nan"), peer="DDP + AdamW",
                                 note=f"could not run: {results.get(name, {}).get('error', 'no result')}"))
            continue
        ratios = TimingStats.of([a / b for a, b in zip(ours, ddp)])
        target = TARGET if "onebit" in name else None
        rows.append(BenchRow(
            benchmark=f"{name} step vs DDP, W=2, {rate}", figure="time/step ratio (per block)",
            ours=ratios.median, peer="DDP + AdamW", ratio=ratios.median,
            target="" if target is None else f"<= {target:g} (p90)",
            passed=None if target is None else ratios.p90 <= target,
            note=f"ratio p10/median/p90 {ratios.p10:.3f}/{ratios.median:.3f}/{ratios.p90:.3f} over {len(ours)} blocks"))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--out PATH`` (required), ``--blocks N`` (default 6)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--blocks", type=int, default=6)
    args = parser.parse_args(argv)
    if args.blocks < 2:
        parser.error("--blocks must be at least 2 (a spread needs samples)")
    load_before = load_average()
    rows = run(args.blocks)
    print(format_table(rows))
    meta = run_meta(f"python -m plait.onebit_optim.benchmarks.zero_link --blocks {args.blocks}", load_before,
                    suite="onebit-optim", quick=False)
    print(f"\nwrote {write_json(rows, args.out, meta=meta)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
