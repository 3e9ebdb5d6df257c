"""`hooks.evaluate`: with `trainer.eval_at_end=true`, the end of a run evaluates the student against its teacher
(`python -m wandistiller.eval`'s `evaluate`, from the same noise, prompts and sampler) and adds the means to
metrics.json (`eval_*`) and the loggers. Its class lives with the CLI it runs (`wandistiller.eval.EvaluateAtEnd`):
the config names it, so nothing in the package imports a CLI."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvaluateConfig:
    _target_: str = "wandistiller.eval.EvaluateAtEnd"


OPTION = (EvaluateConfig, "wandistiller.eval.EvaluateAtEnd")
