"""`wandistiller.state.saved`: a received run's saved config and metrics read as values safe to show: never resolved,
a number only where it is a finite one, a word only where it is a plain one, a path by its last part."""

from __future__ import annotations

import json

from omegaconf import OmegaConf

from wandistiller.state.saved import last_part, named_path, raw_value, run_loras, saved_number, saved_word


def test_a_saved_key_is_read_as_written_and_never_resolved(monkeypatch):
    monkeypatch.setenv("SECRET", "leaked")
    node = OmegaConf.create({"path": "${oc.env:SECRET}", "name": "wan"})
    assert raw_value(node, "path") == "${oc.env:SECRET}" and raw_value(node, "name") == "wan"
    assert raw_value(node, "missing") is None and raw_value("not a node", "path") is None


def test_only_finite_numbers_and_plain_words_are_shown():
    assert saved_number(0.5) == 0.5 and saved_number(3) == 3
    assert saved_number(float("nan")) is None and saved_number(True) is None and saved_number("1") is None
    assert saved_word("wan2.1_t2v-14b") == "wan2.1_t2v-14b"
    assert saved_word("two\nlines") is None and saved_word("<b>") is None and saved_word(7) is None


def test_a_path_is_named_by_its_last_part_or_as_shipped_and_an_interpolation_never():
    assert last_part("/home/alice/models/my_teacher") == "my_teacher" and last_part("${oc.env:HOME}/x") is None
    assert named_path(None, "prompts") == "the shipped prompts"
    assert named_path("${wd_assets:prompts.txt}", "prompts") == "the prompts shipped with WanDistiller"
    assert named_path("/home/alice/p.txt", "prompts") == "`p.txt`"
    assert named_path("${x}/a b!", "prompts") == "your prompts"


def test_the_runs_loras_are_read_as_data_and_anything_else_left_out(tmp_path):
    sha = "ab" * 32
    good = {"file": "style.safetensors", "strength": 0.8, "experts": ["transformer", "vae"], "sha256": sha}
    bad = {"file": "../../etc/passwd\n", "strength": "x", "experts": "all", "sha256": "short"}
    rows = [good, bad, "not a row"]
    (tmp_path / "metrics.json").write_text(json.dumps({"teacher_loras": rows}))
    assert run_loras(tmp_path) == [
        {"file": "style.safetensors", "strength": 0.8, "experts": ["transformer"], "sha256": sha},
        {"file": "?", "strength": None, "experts": [], "sha256": None},
    ]
    (tmp_path / "metrics.json").write_text("{not json")
    assert run_loras(tmp_path) == [] and run_loras(tmp_path / "nowhere") == []
