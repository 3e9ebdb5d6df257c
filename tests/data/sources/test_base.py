"""wandistiller/data/sources/base.py: a source overriding nothing (gaussian) makes Gaussian x0, called directly."""

from __future__ import annotations

import dataclasses

import pytest

from wandistiller.data.sources import sources
from wandistiller.data.sources.base import DataSource, Made


class Bare(DataSource):
    name = "bare"


def test_a_source_that_overrides_nothing_makes_gaussian_x0_from_the_prompts_given():
    assert Bare.ranges == ()
    assert Bare.check({"anything": "at all"}) is None
    made = Bare.make(None, None, "embeddings", "held-out embeddings")
    assert made == Made(None, "embeddings", "held-out embeddings")  # bank None: x0 is drawn as noise
    assert sources()["gaussian"].make(None, None, "embeddings", "held-out embeddings") == made


def test_what_a_source_made_cannot_be_changed_afterwards():
    made = Made(None, "embeddings", "held-out embeddings")
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.bank = "another bank"
