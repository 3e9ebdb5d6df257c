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


def test_a_prompts_file_edited_since_the_run_began_is_refused_by_its_resume(make_cfg, tmp_path):
    """An audit's: a resume after the prompts file was rewritten trained on the new prompts and held out others,
    without a word (a folder of images or clips was held to its record; a prompts file was not)."""
    from tests.conftest import refused
    from wandistiller.train import run

    prompts, folder = tmp_path / "prompts.txt", tmp_path / "run"
    prompts.write_text("".join(f"a red {d}\n" for d in range(6)))
    given = (f"data.prompts_path={prompts}", "trainer.max_steps=2", "trainer.checkpoint_every=1")
    run(make_cfg(*given, run_dir=folder))
    prompts.write_text("".join(f"a blue {d}\n" for d in range(6)))
    resume = (*given[:1], "trainer.max_steps=3", "trainer.resume=auto")
    said = f"trainer.resume: data.prompts_path='{prompts}' changed since the run first read it (6 prompts then, "
    with refused(said + "6 now, or their text differs), so its held-out split would be another"):
        run(make_cfg(*resume, run_dir=folder))
    prompts.write_text("".join(f"a red {d}\n" for d in range(6)))
    assert run(make_cfg(*resume, run_dir=folder))["final_step"] == 3


def test_the_shipped_prompts_changed_since_a_run_began_are_named_as_such(tmp_path):
    # The review's: with data.prompts_path null (the shipped prompts) a changed digest was a StopIteration.
    import json

    from omegaconf import OmegaConf

    from wandistiller.data.sources import CONTENTS, contents_problem

    (tmp_path / ".hydra").mkdir()
    (tmp_path / CONTENTS).write_text(json.dumps({"items": 3, "what": "prompts", "digest": "0" * 16}))
    data = OmegaConf.create({"latents": "teacher", "prompts_path": None, "val_prompts_path": None})
    assert contents_problem(tmp_path, data).startswith(
        "the shipped prompts (data.prompts_path=null) changed since the run first read it (3 prompts then, "
    )
