"""`loss=features`: the teacher's guided velocity (MSE) + feature KD at several depths (BK-SDM's feature-level KD).

Each pair matches a student block's output, through its own learned projection to the teacher's width, with the
output of one teacher block. `layers: N` (auto: 4, or every block of a shallower student) spreads N student blocks
evenly over the student's depth (its last block included) and pairs each with the teacher block it was cut from
(the keep-map `student.pruning` records, when the student was cut from the teacher) or else the teacher block at
the same relative depth; `layers: [[t, s], ...]` names the pairs. The pairs are settled once the student is built
(`resolve`), the same on every rank.

Each layer's MSE is divided by the teacher feature's mean square (`normalize: true`, the default): a DiT's residual
stream grows with depth, so unnormalised (BK-SDM's choice) the deepest pair would outweigh the rest by its scale
alone. Parts: `velocity`, `feature_<teacher block>_<student block>` (each as it is, before its weight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import ListConfig, OmegaConf

from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.recipe.losses.base import LossInputs, Needs, velocity_mse


@dataclass
class FeaturesConfig:
    _target_: str = "wandistiller.recipe.losses.features.Features"
    _partial_: bool = True
    # How many student blocks to match (spread over its depth, the last included; auto: 4, or every block of a
    # shallower student), or [[teacher, student], ...].
    layers: Any = "auto"
    # One weight per pair (null: equal shares of feature_weight).
    weights: Any = None
    # The features' total weight beside the velocity MSE's 1 (when `weights` is null).
    feature_weight: float = 1.0
    # Divide each layer's MSE by the teacher feature's mean square, so layers of different scale weigh alike.
    normalize: bool = True


AUTO = 4  # layers=auto: BK-SDM matches a handful of depths, not every block


def spread(count: int, depth: int) -> list[int]:
    """`count` blocks of `depth` spread evenly, the last block included (each the end of an equal segment)."""
    return [max(0, math.ceil((i + 1) * depth / count) - 1) for i in range(count)]


def feature_pairs(
    layers, teacher_blocks: int, student_blocks: int, kept: list[int] | None = None
) -> list[tuple[int, int]]:
    """The (teacher block, student block) pairs `layers` names, as non-negative indices; refuses, naming the key and
    a fix, a count or a pair the two models do not have. `kept[s]` is the teacher block student block s was cut
    from (the keep-map), None for a student not cut from this teacher (then: the block at the same relative depth)."""
    key = "trainer.loss.layers"
    if layers == "auto":
        layers = min(AUTO, student_blocks)
    if isinstance(layers, bool) or not isinstance(layers, (int, list, tuple)):
        raise UserError(
            f"{key}={layers} is neither auto, a count of blocks nor a list of [teacher, student] pairs; "
            "give e.g. auto, 4 or [[9,1],[29,3]]"
        )
    if isinstance(layers, int):
        if not 1 <= layers <= student_blocks:
            raise UserError(
                f"{key}={layers}: the student has {student_blocks} blocks; give a count from 1 to {student_blocks}"
            )
        blocks = spread(layers, student_blocks)
        return [(kept[s] if kept else spread(student_blocks, teacher_blocks)[s], s) for s in blocks]
    pairs = []
    for pair in layers:
        pair = list(pair) if isinstance(pair, (list, tuple)) else pair
        ok = (
            isinstance(pair, list)
            and len(pair) == 2
            and all(isinstance(i, int) and not isinstance(i, bool) for i in pair)
        )
        if not ok:
            raise UserError(f"{key} has {pair}, not a [teacher block, student block] pair; give e.g. [[9,1],[29,3]]")
        (t, s), fix = (
            pair,
            f"give teacher blocks in -{teacher_blocks}..{teacher_blocks - 1} and student blocks in "
            f"-{student_blocks}..{student_blocks - 1}",
        )
        if not -teacher_blocks <= t < teacher_blocks:
            raise UserError(f"{key} names teacher block {t}, but the teacher has {teacher_blocks} blocks; {fix}")
        if not -student_blocks <= s < student_blocks:
            raise UserError(f"{key} names student block {s}, but the student has {student_blocks} blocks; {fix}")
        pairs.append((t % teacher_blocks, s % student_blocks))
    if not pairs:
        raise UserError(f"{key}=[] names no pair; give a count (e.g. 4) or [[teacher, student], ...]")
    for side, name in ((0, "teacher"), (1, "student")):
        seen = [p[side] for p in pairs]
        repeated = next((b for b in seen if seen.count(b) > 1), None)
        if repeated is not None:
            raise UserError(f"{key} names {name} block {repeated} twice; match each block once")
    return pairs


class Features:
    """The teacher's guided velocity (MSE) + a weighted MSE per (teacher block, student block) pair."""

    def __init__(
        self,
        layers: Any = FeaturesConfig.layers,
        weights: Any = FeaturesConfig.weights,
        feature_weight: float = FeaturesConfig.feature_weight,
        normalize: bool = FeaturesConfig.normalize,
    ):
        if not (math.isfinite(feature_weight) and feature_weight >= 0):
            raise UserError(f"trainer.loss.feature_weight={feature_weight} must be 0 or more and finite; e.g. 1.0")
        self.layers = _plain(layers)
        self.weights = _plain(weights)
        if self.weights is not None and not (
            isinstance(self.weights, list)
            and all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
                for w in self.weights
            )
        ):
            raise UserError(
                f"trainer.loss.weights={self.weights} must be null or a list of finite weights >= 0, one per layer"
            )
        self.feature_weight, self.normalize = feature_weight, normalize
        self.pairs: list[tuple[int, int]] = []
        # The blocks are settled by `resolve` once the student's depth (and keep-map) is known.
        self.needs = Needs(teacher=True)

    def resolve(self, teacher_blocks: int, student_blocks: int, kept: list[int] | None = None) -> None:
        """Settle the pairs for these depths (and the student's keep-map): the teacher then returns those blocks'
        hidden states and the student projects its own. Refuses what the models do not have."""
        pairs = feature_pairs(self.layers, teacher_blocks, student_blocks, kept)
        if self.weights is not None and len(self.weights) != len(pairs):
            raise UserError(
                f"trainer.loss.weights has {len(self.weights)} weights for {len(pairs)} layers "
                f"{[list(p) for p in pairs]}; give one per layer, or null"
            )
        self.pairs = pairs
        teacher, student = (tuple(side) for side in zip(*pairs))
        self.needs = Needs(teacher=True, teacher_hidden=teacher, student_hidden=student)

    def __call__(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        assert self.pairs and inputs.student_hidden is not None and inputs.teacher_hidden is not None, "resolve first"
        weights = self.weights or [self.feature_weight / len(self.pairs)] * len(self.pairs)
        velocity = velocity_mse(inputs)
        parts, loss = {"velocity": velocity}, velocity
        for i, ((t, s), weight) in enumerate(zip(self.pairs, weights)):
            student, teacher = inputs.student_hidden[i].float(), inputs.teacher_hidden[i].to(inputs.pred.device).float()
            mse = F.mse_loss(student, teacher)
            if self.normalize:
                mse = mse / teacher.square().mean().clamp_min(1e-8)
            parts[f"feature_{t}_{s}"] = mse
            loss = loss + weight * mse
        return {"loss": loss} | parts


def _plain(value):
    """A list from OmegaConf (a ListConfig, nested) as plain lists; anything else as it is."""

    return OmegaConf.to_container(value) if isinstance(value, ListConfig) else value


OPTION = Option("features", FeaturesConfig, Features)
