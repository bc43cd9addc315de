"""Every environment variable plait-transformers reads, read here and nowhere else (on each call,
so a test's ``monkeypatch.setenv`` takes effect)."""

from __future__ import annotations

import os


def config_source() -> str | None:
    """``PLAIT_CONFIG``: a JSON file path (or inline JSON) holding the plait config for scripts
    that are not edited; ``None`` when unset or empty."""
    value = os.environ.get("PLAIT_CONFIG", "").strip()
    return value or None
