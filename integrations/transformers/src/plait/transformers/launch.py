"""Run an unedited training script on plait: ``python -m plait.transformers.launch script.py ARGS``
(or under ``torchrun ... -m plait.transformers.launch``), with the config in ``$PLAIT_CONFIG`` or,
for a DeepSpeed user's script, the script's own ``--deepspeed ds_config.json``.

Before the script (and TRL) import it, ``transformers.Trainer`` is replaced by
``with_plait(Trainer)``, so every Trainer subclass defined afterwards (``SFTTrainer``,
``Seq2SeqTrainer``) trains on plait too, and ``TrainingArguments(deepspeed=...)`` hands its config
to plait instead of DeepSpeed (:mod:`plait.transformers.ds_route`). Both replacements are undone
when the script ends.
"""

from __future__ import annotations

import contextlib
import runpy
import sys
from collections.abc import Iterator

from plait.transformers import settings
from plait.transformers.config import load_config
from plait.transformers.ds_route import deepspeed_intercepted


@contextlib.contextmanager
def plait_trainer_patched() -> Iterator[type]:
    """Inside, ``transformers.Trainer`` (and ``transformers.trainer.Trainer``) is the plait Trainer.

    Yields:
        The plait Trainer class.
    """
    import transformers.trainer  # noqa: F401 - loads the module that defines Trainer

    from plait.transformers.trainer import with_plait

    # Through sys.modules: transformers replaces its own module object with a lazy one during
    # import, so the name bound by ``import transformers`` here may not be the one scripts see.
    package, module = sys.modules["transformers"], sys.modules["transformers.trainer"]
    original = module.Trainer
    # A class of its own: the launched run must name its config (PLAIT_CONFIG or --deepspeed).
    base = with_plait(original)
    patched = type(base.__name__, (base,), {"plait_require_source": True, "__module__": original.__module__})
    package.Trainer = module.Trainer = patched
    try:
        yield patched
    finally:
        package.Trainer = module.Trainer = original


def main(argv: list[str] | None = None) -> None:
    """Run ``argv[0]`` as ``__main__`` with the remaining arguments, on plait.

    Raises:
        SystemExit: no script given, or ``$PLAIT_CONFIG`` is refused (the message says why). A run
            with neither ``$PLAIT_CONFIG`` nor a DeepSpeed config is refused when its Trainer is built.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: PLAIT_CONFIG=plait.json python -m plait.transformers.launch script.py [ARGS...]\n"
                         "   or: python -m plait.transformers.launch script.py --deepspeed ds_config.json [ARGS...]")
    source = settings.config_source()
    if source is not None:
        try:
            load_config(source)  # refuse a bad file before the script starts
        except ValueError as exc:
            raise SystemExit(f"PLAIT_CONFIG: {exc}") from exc
    sys.argv = argv
    with plait_trainer_patched(), deepspeed_intercepted():
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
