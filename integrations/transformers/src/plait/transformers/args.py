"""``PlaitTrainingArguments``: ``TrainingArguments`` with a ``plait_config`` field, so scripts that
parse their arguments with ``HfArgumentParser`` accept ``--plait_config file.json`` as they accept
``--deepspeed ds.json``."""

from __future__ import annotations

import dataclasses

from transformers import TrainingArguments


@dataclasses.dataclass
class PlaitTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus the plait config (read by :func:`plait.transformers.with_plait`).

    Attributes:
        plait_config: a JSON file path (or inline JSON) with the plait config, e.g.
            ``{"zero": {"stage": 3}, "offload": "cpu"}``; ``None`` leaves the choice to
            ``with_plait(..., config)`` or ``$PLAIT_CONFIG``.
    """

    plait_config: str | None = dataclasses.field(
        default=None, metadata={"help": "plait config: a JSON file path or inline JSON, e.g. "
                                        "'{\"zero\": {\"stage\": 3}}'. Used by Trainers built with with_plait()."})

    def __post_init__(self) -> None:
        if self.plait_config is not None and not isinstance(self.plait_config, str):
            raise ValueError(f"PlaitTrainingArguments.plait_config={self.plait_config!r} must be a JSON file path "
                             "or an inline JSON string.")
        super().__post_init__()
