"""wandistiller/data/sources/__init__.py: the registry's sources, their schema keys, their refusals in a run."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from tests.conftest import CONF
from wandistiller.config import DataCommon
from wandistiller.core.errors import UserError
from wandistiller.data import sources
from wandistiller.train import run


def test_every_source_has_its_schema_and_every_data_yaml_names_one():
    found = sources.sources()
    assert set(found) == {"gaussian", "teacher", "images", "videos"}
    used = {OmegaConf.load(p).latents for p in (CONF / "data").glob("*.yaml")}
    assert used == set(found), "a source no data option uses, or an option naming no source"
    for p in (CONF / "data").glob("*.yaml"):  # each data option takes its source's schema
        assert f"/schema/data/{OmegaConf.load(p).latents}@_here_" in OmegaConf.load(p).defaults, p.name


def test_each_source_schema_holds_the_common_keys_and_its_own_name_alone():
    common = {f.name for f in dataclasses.fields(DataCommon)}
    for name, option in sources.REGISTRY.options.items():
        fields = {f.name: f for f in dataclasses.fields(option.schema)}
        assert common <= set(fields) and [c.value for c in type(fields["latents"].default)] == [name]


def test_another_sources_key_is_refused_at_composition(make_cfg):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="root"):
        make_cfg("data=static_prompts", "data.root=images")
    with pytest.raises(ConfigCompositionException, match="latents"):
        make_cfg("data=static_prompts", "data.latents=teacher")


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.latents_per_prompt=0", "data.latents_per_prompt=0 must be a positive integer"),
        ("data.latent_chunk=-1", "data.latent_chunk=-1 must be a positive integer"),
        ("data.sample_steps=0", r"data.sample_steps=0 must be in \[1, 1000\], a Wan scheduler.s training timesteps"),
        ("data.sample_steps=100000", r"data.sample_steps=100000 must be in \[1, 1000\]"),  # was hours of sampling
    ],
)
def test_a_sources_range_is_refused_in_one_line(make_cfg, tmp_path, override, message):
    with pytest.raises(UserError, match=message):
        run(make_cfg("data=teacher_latents", override, run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_the_chosen_sources_own_check_runs_before_the_run_folder(make_cfg, tmp_path):
    with pytest.raises(UserError, match=r"data\.root|data\.dataset"):
        run(make_cfg("data=image_folder", f"data.root={tmp_path / 'none'}", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_a_new_source_is_one_class_the_registry_finds(monkeypatch):
    """What a module of wandistiller/data/sources/ defining OPTION adds: its own keys' refusals."""

    class Noise(sources.DataSource):
        name = "noise"
        ranges = (("data.noise_scale", lambda v: v > 0, "positive"),)

    monkeypatch.setattr(sources, "sources", lambda: sources.REGISTRY and {"noise": Noise})
    data = OmegaConf.create({"latents": "noise", "noise_scale": -1.0})
    checks = {k: (ok, what) for k, _, ok, what in sources.range_checks(data)}
    assert not checks["data.noise_scale"][0](-1.0) and checks["data.noise_scale"][1] == "positive"


def test_an_image_to_video_teacher_on_prompts_alone_is_one_line_and_nothing_is_written(make_cfg, tmp_path):
    with pytest.raises(UserError) as e:
        run(make_cfg("teacher=tiny_i2v_moe", run_dir=tmp_path / "r"))
    assert str(e.value).startswith("data.latents=gaussian gives prompts alone, but teacher=tiny_i2v_moe is image-to")
    assert "\n" not in str(e.value) and not (tmp_path / "r").exists()


def test_a_text_to_video_teacher_on_image_prompt_pairs_is_one_line_and_nothing_is_written(
    make_cfg, tmp_path, monkeypatch
):
    # An image or video folder is a text-to-video teacher's x0: the default source is made one of pairs alone.
    monkeypatch.setattr(sources.sources()["gaussian"], "gives_images", True)
    with pytest.raises(UserError) as e:
        run(make_cfg("teacher=tiny", run_dir=tmp_path / "r"))
    assert str(e.value).startswith("data.latents=gaussian gives (image, prompt) pairs, but teacher=tiny is text-to")
    assert "\n" not in str(e.value) and not (tmp_path / "r").exists()
    monkeypatch.setattr(sources.sources()["gaussian"], "gives_images", False)
    with pytest.raises(UserError, match="data.latents=gaussian gives prompts alone.* .data.latents=images or videos.$"):
        run(make_cfg("teacher=tiny_i2v", run_dir=tmp_path / "r"))  # Wan 2.1's layout, its student's image tokens


def test_ti2v_without_images_trains_on_prompts_as_a_text_to_video_teacher(make_cfg, tmp_path):
    summary = run(make_cfg("teacher=tiny_ti2v", "trainer.max_steps=2", "data.latent_height=4", "data.latent_width=4"))
    assert summary is not None and (tmp_path / "run" / "student").is_dir()


def test_a_run_that_held_out_prompts_of_its_own_never_reads_its_data_record(tmp_path):
    """Nothing of the folder was held out, so nothing of it is compared: its record is not read either (a damaged
    one, or a link out of the run folder, stopped such a resume, which had never looked at it)."""
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (tmp_path / "elsewhere.json").write_text("{}")  # a file out of the run folder
    (run_dir / ".hydra" / "data.json").symlink_to(tmp_path / "elsewhere.json")  # read, a guarded read refuses it
    data = OmegaConf.create({"_target_": "x", "root": str(tmp_path / "clips"), "val_prompts_path": "val.txt"})
    assert sources.contents_problem(run_dir, data) is None
    with pytest.raises(UserError):
        sources.contents_problem(run_dir, OmegaConf.merge(data, {"val_prompts_path": None}))
