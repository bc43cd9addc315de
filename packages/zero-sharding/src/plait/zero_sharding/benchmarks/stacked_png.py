"""A stacked-bar chart written as a PNG with the standard library only (zlib + struct).

The benchmark environments do not carry matplotlib, and a breakdown is a handful of coloured
rectangles: one bar per contender, one segment per category, a light grid every ``grid`` units.
Labels live in the README table beside the picture (same order, same colours named there).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

# Category colours (RGB), in the order the segments stack from the bottom.
PALETTE = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def stacked_bars_png(path: Path, bars: Sequence[Sequence[float]], *, grid: float, width: int = 480,
                     height: int = 320) -> Path:
    """Write one vertical stacked bar per entry of ``bars``.

    Args:
        path: the PNG to write (parent folders are created).
        bars: per bar, the segment heights (same unit for every bar, stacked bottom-up in
            :data:`PALETTE` order).
        grid: a horizontal grid line every ``grid`` units.
        width, height: image size in pixels.

    Returns:
        ``path``.

    Raises:
        ValueError: no bars, a negative segment, more segments than colours, or ``grid <= 0``.
    """
    if not bars or grid <= 0 or any(v < 0 for bar in bars for v in bar) or max(map(len, bars)) > len(PALETTE):
        raise ValueError(f"stacked_bars_png needs bars with non-negative segments (at most {len(PALETTE)}) and "
                         f"grid > 0; got {len(bars)} bars, grid={grid}.")
    top = max(sum(bar) for bar in bars) or 1.0
    scale = (height - 20) / top
    pixels = [[(255, 255, 255)] * width for _ in range(height)]
    level = grid
    while level <= top:
        y = height - 1 - int(level * scale)
        pixels[y] = [(220, 220, 220)] * width
        level += grid
    slot = width // len(bars)
    for index, bar in enumerate(bars):
        x0, x1 = index * slot + slot // 5, (index + 1) * slot - slot // 5
        base = 0.0
        for colour, value in zip(PALETTE, bar, strict=False):
            y_lo, y_hi = height - 1 - int((base + value) * scale), height - 1 - int(base * scale)
            for y in range(max(0, y_lo), y_hi):
                pixels[y][x0:x1] = [colour] * (x1 - x0)
            base += value
    raw = b"".join(b"\x00" + bytes(channel for px in row for channel in px) for row in pixels)
    png = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) \
        + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png)
    return path
