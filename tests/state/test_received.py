"""wandistiller/state/received.py: a received run's config is checked before anything in it runs (via the CLIs)."""

from __future__ import annotations

import shutil

import pytest
import yaml
from hydra.utils import instantiate
from omegaconf import OmegaConf

from wandistiller import eval as eval_cli
from wandistiller import generate as generate_cli
from wandistiller.core import registry
from wandistiller.core.errors import UserError
from wandistiller.data.prompts import read_prompts
from wandistiller.job.resumed import continued_config
from wandistiller.state.received import allow_targets, allowed_targets, check_received


def payload(marker) -> dict:
    """What the audit sent: nested `_target_`s that write a file when Hydra instantiates them."""
    return {"_target_": "pathlib.Path.write_text", "self": {"_target_": "pathlib.Path", "_args_": [str(marker)]},
            "data": "ran"}  # fmt: skip


def test_the_payload_is_live_under_plain_hydra(tmp_path):
    """The control: without the check, instantiating the crafted node does write the marker."""
    marker = tmp_path / "control"
    instantiate(OmegaConf.create(payload(marker)))
    assert marker.read_text() == "ran"


def received(finished, tmp_path, **changes) -> tuple:
    """A copy of the finished run whose saved config has `changes` (dotted key -> value) written in."""
    folder = tmp_path / "received"
    shutil.copytree(finished, folder)
    file = folder / ".hydra" / "config.yaml"
    saved = yaml.safe_load(file.read_text())
    for key, value in changes.items():
        *parents, last = key.split(".")
        node = saved
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    file.write_text(yaml.safe_dump(saved))
    return folder, file


def one_error_line(capsys, cli, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize("key", ["student.config_path", "trainer.optimizer", "trainer.loss.hidden_kd_weight",
                                 "recipe", "teacher_placement.extra", "logger"])  # fmt: skip
def test_a_hostile_target_is_refused_by_eval_and_generate_and_nothing_runs(finished, tmp_path, capsys, key):
    marker = tmp_path / "marker"
    folder, file = received(finished, tmp_path, **{key: payload(marker)})
    for cli, extra in ((eval_cli, ["--steps", "1", "--limit", "1"]), (generate_cli, ["--prompt", "x"])):
        err = one_error_line(capsys, cli, [str(folder), *extra])
        assert "pathlib." in err and str(file) in err and "--allow-target" in err
    assert not marker.exists()


def test_a_hostile_target_is_refused_on_resume_and_nothing_runs(finished, tmp_path, make_cfg):
    marker = tmp_path / "marker"
    folder, file = received(finished, tmp_path, **{"trainer.loss": payload(marker)})
    shutil.rmtree(folder / "student")
    (folder / "metrics.json").unlink()
    with pytest.raises(UserError, match=r"trainer.loss._target_='pathlib.Path.write_text' in .*config.yaml") as e:
        continued_config(make_cfg("trainer.resume=auto", run_dir=folder), ["trainer.resume=auto"])
    assert "on this command line" in str(e.value)
    assert not marker.exists()


def test_a_target_the_user_names_is_theirs(finished, tmp_path, capsys):
    """`--allow-target` for eval/generate; a resume's own command line (its composed config) the same way."""
    folder, file = received(
        finished, tmp_path, **{"trainer.optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1}}
    )
    assert check_received(OmegaConf.load(file), file).trainer.optimizer._target_ == "torch.optim.SGD"
    raw = OmegaConf.load(file)
    raw.recipe._target_ = "mypkg.MyRecipe"
    with pytest.raises(UserError, match="recipe._target_='mypkg.MyRecipe'"):
        check_received(raw, file)
    assert check_received(raw, file, trusted={"mypkg.MyRecipe"}).recipe._target_ == "mypkg.MyRecipe"
    allow_targets("mypkg.MyRecipe")  # a later registry's entry
    assert "mypkg.MyRecipe" in allowed_targets()


def test_the_registries_options_are_allowed_once_registered_and_reading_before_is_a_programming_error(monkeypatch):
    """compose.register_configs hands the registries down (core.registry.registered()): their options' classes are
    allowed targets; read before it, a shipped placement would be refused as a stranger's, so it is an error."""
    assert "wandistiller.placements.cpu.CpuPlacement" in allowed_targets()  # registered by tests/conftest.py
    monkeypatch.setattr(registry, "_registered", {})
    with pytest.raises(RuntimeError, match=r"call wandistiller.compose.register_configs\(\) first"):
        allowed_targets()


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"student.foo": 1}, "student.foo in .* is not a WanDistiller config key"),
        ({"surprise": {"a": 1}}, "surprise in .* is not a WanDistiller config key"),
        ({"trainer.optimizer.foo": 1}, "trainer.optimizer.foo in .* is not an argument of torch.optim.AdamW"),
        ({"teacher_placement.foo": 1}, "teacher_placement.foo in .* is not an argument of .*CpuPlacement"),
        ({"trainer.batch_size": "many"}, "trainer.batch_size in .*config.yaml"),
        ({"trainer.optimizer": "${oc.decode:'{_target_: os.system}'}"}, "uses the resolver oc.decode"),
        ({"recipe._target_": "${oc.env:WHATEVER}"}, "recipe._target_=.* is an interpolation"),
    ],
)
def test_a_config_off_the_schema_is_one_line_naming_key_and_file(finished, tmp_path, capsys, change, expected):
    folder, file = received(finished, tmp_path, **change)
    err = one_error_line(capsys, eval_cli, [str(folder), "--steps", "1", "--limit", "1"])
    assert str(file) in err
    assert __import__("re").search(expected, err), err


# -- bounded parsing: a received config is refused in one line before it can pin the reader ---------------------
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")
)  # under 1 KB; 9^9 values once its aliases are expanded


@pytest.mark.parametrize("content, message", [
    (BOMB, "expands to more than 50,000 values (aliases of aliases)"),
    ("trainer: {}\n" + "pad: '" + "x" * (40 * 2**20) + "'\n", "more than a saved config can be"),
    ("a: " + "[" * 150 + "]" * 150 + "\n", "nests more than 100 deep"),
])  # fmt: skip
def test_a_config_that_would_pin_the_reader_is_one_line_for_eval_generate_and_resume(
    finished, tmp_path, capsys, make_cfg, content, message
):
    assert len(BOMB) < 1024
    folder, file = received(finished, tmp_path)
    file.write_text(content)
    for cli, extra in ((eval_cli, ["--steps", "1", "--limit", "1"]), (generate_cli, ["--prompt", "x"])):
        assert message in one_error_line(capsys, cli, [str(folder), *extra])
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        continued_config(make_cfg("trainer.resume=auto", run_dir=folder), ["trainer.resume=auto"])


def test_a_config_that_is_not_a_regular_file_is_not_read(finished, tmp_path, capsys):
    import os

    folder, file = received(finished, tmp_path)
    file.unlink()
    os.mkfifo(file)  # a FIFO would block the reader forever
    err = one_error_line(capsys, eval_cli, [str(folder), "--steps", "1", "--limit", "1"])  # at once, not blocked
    assert "is not a run folder (no .hydra/config.yaml)" in err


def test_an_empty_run_folder_argument_is_said_empty_not_read_as_the_current_folder(capsys):
    # An audit's `eval ""` (an unset variable) was "'.' is not a run folder".
    from wandistiller import export as export_cli
    from wandistiller import pipeline as pipeline_cli

    for cli, extra in ((eval_cli, []), (generate_cli, ["--prompt", "x"])):
        err = one_error_line(capsys, cli, ["", *extra])
        assert err == "error: the run folder given is empty (an unset variable?); give an outputs/<date>/<time> folder"
    for cli, extra in ((export_cli, ["--format", "diffusers", "--out", "x"]), (pipeline_cli, ["--out", "x"])):
        assert "run_dir: it is empty (an unset variable?)" in one_error_line(capsys, cli, ["", *extra])
    with pytest.raises(UserError, match=r"^--prompts is empty \(an unset variable\?\); give a text file"):
        read_prompts("", "--prompts")


def test_a_json_file_too_large_or_too_deep_is_one_line(tmp_path):
    from wandistiller.state.received import load_json

    big = tmp_path / "metrics.json"
    big.write_text('{"a": "' + "x" * 100 + '"}')
    with pytest.raises(UserError, match=r"metrics.json is 109 bytes, more than a metrics file can be \(64\)"):
        load_json(big, 64, "metrics file")
    big.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UserError, match="is nested too deeply to be a JSON file"):
        load_json(big)
    big.write_bytes(b"\xff\xfe{}")
    with pytest.raises(UserError, match="is not UTF-8 text"):
        load_json(big)


def test_the_saved_config_of_a_real_run_passes_the_bounds(finished):
    from wandistiller.state.received import load_yaml_config

    assert load_yaml_config(finished / ".hydra" / "config.yaml").trainer.max_steps == 2


def test_a_state_json_too_large_is_refused_before_parsing(tmp_path, monkeypatch):
    from tests.state.test_checkpoint import real_state
    from wandistiller.state import checkpoint, received
    from wandistiller.state.checkpoint import checkpoint_dir, save_checkpoint

    _, state = real_state()
    save_checkpoint(tmp_path, 2, state, keep=5)
    monkeypatch.setattr(received, "MAX_JSON_BYTES", 64)  # a state.json larger than the limit
    assert "bytes, more than a checkpoint state can be (64)" in checkpoint.problem(checkpoint_dir(tmp_path, 2))


def test_an_older_runs_saved_config_still_evaluates_and_resumes(finished, tmp_path, make_cfg):
    """A run saved before the hooks held their settings, the loss its hidden-state weight and each data source its
    own schema (the old `_target_`s too) is read back as today's: it evaluates and resumes."""
    import json

    from wandistiller.evaluation.evaluate import EvalSettings, evaluate
    from wandistiller.train import run

    folder = tmp_path / "old"
    shutil.copytree(finished, folder)
    saved = yaml.safe_load((folder / ".hydra" / "config.yaml").read_text())
    del saved["hooks"]  # before the list of hooks: every shipped one, with its settings in trainer
    saved["trainer"] |= {
        "val_every": 0,
        "sample_every": 0,
        "sample_prompts": 0,
        "sample_steps": 1,
        "eval_at_end": False,
    }
    saved["student"]["hidden_kd_weight"] = 0.0
    saved["trainer"]["loss"] = {"_target_": "wandistiller.loop.distillation_loss", "_partial_": True,
                                "hidden_kd_weight": "${student.hidden_kd_weight}"}  # fmt: skip
    saved["data"] |= {
        "latents_per_prompt": 1,
        "sample_steps": 20,
        "latent_chunk": 16,
        "root": None,
        "dataset": None,
        "image_column": None,
        "text_column": None,
    }  # one flat schema held every source's keys
    saved["recipe"] = {"_target_": "wandistiller.recipe.DistillationRecipe"}
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(saved))
    assert evaluate(folder, EvalSettings(steps=1, limit=1))["steps"] == 1
    run(make_cfg("trainer.max_steps=3", "trainer.resume=auto", run_dir=folder))
    assert json.loads((folder / "metrics.json").read_text())["final_step"] == 3
