"""``plait selftest``: one command that runs every GPU path plait has and prints one table.

This package holds the framework (:mod:`.core`, :mod:`.measure`, :mod:`.discover`) and
plait-kernels' own checks (:mod:`.ops_checks`). Other distributions contribute theirs through the
``plait.selftest`` entry-point group or a ``plait.<package>.selftest`` module.
"""

from plait.kernels.selftest.core import FAIL, PASS, SKIP, Check, Outcome, SelftestContext, Skip


def checks(ctx: SelftestContext) -> list[Check]:
    """plait-kernels' checks (imported lazily: the framework must import without loading the ops)."""
    from plait.kernels.selftest.ops_checks import checks as kernel_checks

    return kernel_checks(ctx)


__all__ = ["FAIL", "PASS", "SKIP", "Check", "Outcome", "SelftestContext", "Skip", "checks"]
