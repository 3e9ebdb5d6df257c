"""wandistiller/data/sources/__init__.py: the registry's sources, their schema keys, their refusals in a run."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from tests.conftest import CONF
from wandistiller.config import DataConfig, Latents
from wandistiller.core.errors import UserError
from wandistiller.data import sources
from wandistiller.train import run


def test_every_source_is_a_choice_of_data_latents_and_every_data_yaml_names_one():
    found = sources.sources()
    assert set(found) == {"gaussian", "teacher", "images"} <= {c.value for c in Latents}
    used = {OmegaConf.load(p).latents for p in (CONF / "data").glob("*.yaml")}
    assert used == set(found), "a source no data option uses, or an option naming no source"


def test_each_sources_keys_are_typed_fields_of_the_data_schema():
    fields = {f.name: f for f in dataclasses.fields(DataConfig)}
    for source in sources.sources().values():
        for f in dataclasses.fields(source.Keys) if source.Keys else ():
            assert fields[f.name].default == f.default, f.name


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.latents_per_prompt=0", "data.latents_per_prompt=0 must be a positive integer"),
        ("data.latent_chunk=-1", "data.latent_chunk=-1 must be a positive integer"),
        ("data.sample_steps=0", "data.sample_steps=0 must be a positive integer"),
    ],
)
def test_a_sources_range_is_refused_in_one_line_whichever_source_runs(make_cfg, tmp_path, override, message):
    with pytest.raises(UserError, match=message):
        run(make_cfg(override, run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_the_chosen_sources_own_check_runs_before_the_run_folder(make_cfg, tmp_path):
    with pytest.raises(UserError, match=r"data\.root|data\.dataset"):
        run(make_cfg("data=image_folder", f"data.root={tmp_path / 'none'}", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_a_new_source_is_one_class_the_registry_finds(monkeypatch):
    """What a module of wandistiller/data/sources/ defining SOURCE adds: its keys and its refusals."""

    @dataclasses.dataclass
    class NoiseKeys:
        noise_scale: float = 1.0

    class Noise(sources.DataSource):
        name, Keys = "noise", NoiseKeys
        ranges = (("data.noise_scale", lambda v: v > 0, "positive"),)

    found = sources.sources() | {"noise": Noise}
    monkeypatch.setattr(sources, "sources", lambda: found)
    assert ("noise_scale", float) == sources.schema_fields()[-1][:2]
    data = OmegaConf.create({"noise_scale": -1.0, "latent_chunk": 16, "latents_per_prompt": 1, "sample_steps": 20})
    checks = {k: (ok, what) for k, _, ok, what in sources.range_checks(data)}
    assert not checks["data.noise_scale"][0](-1.0) and checks["data.noise_scale"][1] == "positive"
