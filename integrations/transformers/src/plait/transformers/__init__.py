"""plait as a backend of the Hugging Face Trainer (and of TRL's trainers, which subclass it).

One line::

    from plait.transformers import with_plait
    from plait.zero_sharding import ZeroConfig

    trainer = with_plait(Trainer, ZeroConfig(stage=3))(model=model, args=args, train_dataset=ds)

Scripts nobody edits: ``PLAIT_CONFIG=plait.json torchrun ... -m plait.transformers.launch run_clm.py ...``
(see :mod:`plait.transformers.launch`), or ``--plait_config plait.json`` with
:class:`PlaitTrainingArguments`.
"""

from plait.transformers.config import PlaitConfig, config_from_dict, load_config, zero_config_for
from plait.transformers.trainer import PlaitModel, PlaitTrainerMixin, with_plait


def __getattr__(name: str) -> object:
    # PlaitTrainingArguments subclasses transformers' TrainingArguments, whose import is slow.
    if name == "PlaitTrainingArguments":
        from plait.transformers.args import PlaitTrainingArguments

        return PlaitTrainingArguments
    raise AttributeError(f"module 'plait.transformers' has no attribute {name!r}")


__all__ = ["PlaitConfig", "PlaitModel", "PlaitTrainerMixin", "PlaitTrainingArguments", "config_from_dict",
           "load_config", "with_plait", "zero_config_for"]
