"""`wandistiller.eval`, the CLI: its numbers added to the run's loggers, its one-line refusals, its help."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml
from omegaconf import OmegaConf

from tests.conftest import ROOT, fresh_runs
from tests.conftest import cli as command_line
from tests.evaluation.test_evaluate import with_end_of_run_eval, write_prompts
from wandistiller import eval as eval_cli
from wandistiller import generate as generate_cli
from wandistiller.evaluation.evaluate import EvalSettings, evaluate
from wandistiller.train import run


@pytest.mark.slow  # a whole run: the default lane keeps its 4 minutes
def test_the_eval_cli_adds_its_numbers_to_the_runs_wandb_run(make_cfg, tmp_path, capsys):
    folder = tmp_path / "run"
    run(make_cfg("trainer.max_steps=1", "logger=wandb", run_dir=folder))
    eval_cli.main([str(folder), "--steps", "2", "--limit", "1"])
    assert "logged to the run's wandb run" in capsys.readouterr().out
    # offline-run-<date>_<time>-<id>, and "-1" after it when wandb started two in the same second
    ids = {p.name.split("-")[3] for p in (folder / "wandb").glob("offline-run-*")}
    assert len(ids) == 1  # the run's own id, resumed (offline wandb writes a folder per resume; sync merges them)


def test_the_eval_cli_adds_its_numbers_to_a_runs_csv_and_tensorboard_loggers_too(make_cfg, tmp_path, capsys):
    import csv

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = tmp_path / "run"
    overrides = ["trainer.max_steps=2", "trainer.checkpoint_every=1", "trainer.log_every=1"]
    run(make_cfg(*overrides, "logger=[tensorboard,csv]", run_dir=folder))
    eval_cli.main([str(folder), "--steps", "2", "--limit", "1"])
    assert "logged to the run's loggers: tensorboard, csv" in capsys.readouterr().out
    eval_cli.main([str(folder), "--checkpoint", "step_1", "--steps", "2", "--limit", "1"])
    rows = list(csv.DictReader((folder / "metrics.csv").read_text().splitlines()))
    # Keyed by its settings as its file is (not eval's own 20 steps and 8 prompts): no curve mixes two settings.
    key = "eval_steps2_limit1/psnr"
    assert rows[0]["step"] == "1" and rows[0]["loss"] and float(rows[-1][key]) > 0  # the run's rows kept
    # Each evaluation at the step of the student it evaluated: the final one's (the run's last), then step_1's.
    assert [row["step"] for row in rows if row[key]] == ["2", "1"]
    events = EventAccumulator(str(folder / "tensorboard"))
    events.Reload()
    assert key in events.Tags()["scalars"] and "loss" in events.Tags()["scalars"]
    assert sorted(event.step for event in events.Scalars(key)) == [1, 2]
    assert "eval/psnr" not in events.Tags()["scalars"]  # the run's own evaluation's key, which it never ran
    # The run's own summary (its metrics.json's), once: neither evaluation was the run's own, so neither replaced it.
    assert len(events.Tensors("summary/text_summary")) == 1


@pytest.mark.parametrize("case", ["not a run", "no student yet"])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, make_cfg, case):
    folder, message = tmp_path, "is not a run folder"
    if case == "no student yet":  # a run's config, and nothing trained
        folder, message = tmp_path / "run", "has no student yet"
        (folder / ".hydra").mkdir(parents=True)
        OmegaConf.save(make_cfg(), folder / ".hydra" / "config.yaml")
    for cli, extra in ((eval_cli, []), (generate_cli, ["--prompt", "x"])):
        with pytest.raises(SystemExit) as e:
            cli.main([str(folder), *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1


def test_a_prompts_file_that_is_not_there_is_named_by_its_flag(tmp_path, capsys):
    """Issue 41: `eval RUN --prompts missing.txt` named `data.prompts_path=`, a key eval's user never gave."""
    with pytest.raises(SystemExit) as e:
        eval_cli.main([str(tmp_path), "--prompts", str(tmp_path / "missing.txt")])
    err = capsys.readouterr().err
    missing = str(tmp_path / "missing.txt")
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: --prompts={missing!r} does not exist; give a text file")


@pytest.fixture(scope="module", autouse=True)  # autouse: it starts with the module, beside its in-process tests
def clis(request, tmp_path_factory):
    """This module's command-line runs (fresh processes), started together with the module."""
    test, empty = "test_the_cli_has_help_and_no_traceback", str(tmp_path_factory.mktemp("cli"))
    return fresh_runs(request, {
        "help": (test, command_line("--help", module="wandistiller.eval")),
        "bad": (test, command_line(empty, "--prompt", "x", module="wandistiller.generate")),
        "bad_steps": (test, command_line(empty, "--prompt", "x", "--student-steps", "0",
                                         module="wandistiller.generate")),
    })  # fmt: skip


def test_the_cli_has_help_and_no_traceback(clis):
    help_ = clis["help"].result()
    assert help_.returncode == 0 and "--checkpoint" in help_.stdout
    assert "(the library: wandistiller/evaluation/)." in " ".join(help_.stdout.split())  # its description whole
    bad = clis["bad"].result()
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr
    steps = clis["bad_steps"].result()  # a value refused before the run folder is read: one line, no usage block
    assert steps.returncode == 2 and steps.stderr == (
        "error: --student-steps 0 is not 1 or more; give a whole number of 1 or more, e.g. --student-steps 4\n"
    )


def test_a_checkpoint_of_another_student_shape_is_one_line_for_eval(make_cfg, tmp_path, capsys):
    other, mine = tmp_path / "other", tmp_path / "mine"
    run(make_cfg("trainer.max_steps=1", "student=quarter", run_dir=other))  # cut narrower: another shape
    run(make_cfg("trainer.max_steps=1", "trainer.loss.hidden_kd_weight=0.5", run_dir=mine))  # + a projection
    eval_cli.main([str(mine), "--checkpoint", "step_1", "--steps", "1", "--limit", "1"])  # its student alone
    assert (mine / "eval_step_00000001_steps1_limit1.json").is_file()  # its checkpoint and settings in the name
    shutil.copytree(other / "checkpoints" / "step_00000001", mine / "checkpoints" / "step_00000009")
    with pytest.raises(SystemExit) as e:
        eval_cli.main([str(mine), "--checkpoint", "step_9", "--steps", "1", "--limit", "1"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and "--checkpoint: the checkpoint" in err, err
    assert "is of another student shape" in err and "pick one this run trained" in err


def test_eval_adds_to_wandb_offline_whatever_the_saved_config_says(make_cfg, tmp_path, capsys):
    folder = tmp_path / "run"
    run(make_cfg("trainer.max_steps=1", "logger=wandb", run_dir=folder))
    file = folder / ".hydra" / "config.yaml"
    saved = yaml.safe_load(file.read_text())
    saved["logger"]["wandb"]["mode"] = "online"
    file.write_text(yaml.safe_dump(saved))
    eval_cli.main([str(folder), "--steps", "1", "--limit", "1"])  # online would fail: no key, no network
    assert "logged to the run's wandb run" in capsys.readouterr().out
    assert list((folder / "wandb").glob("offline-run-*"))


@pytest.mark.parametrize("bad", ["0", "-1", "1.5", "two", "1,,2", "2,0"])
def test_bad_student_steps_are_one_line_and_exit_2(finished, tmp_path, capsys, bad):
    with pytest.raises(SystemExit) as e:
        eval_cli.main([str(finished), f"--student-steps={bad}", "--limit", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: --student-steps") and err.count("\n") == 1, err
    assert not list(finished.glob("eval*"))


def test_online_wandb_without_a_login_is_one_line_before_anything_samples(make_cfg, tmp_path, capsys, monkeypatch):
    # An audit's: wandb's own UsageError, as an internal error, after the teacher and student had sampled.
    folder = tmp_path / "run"
    run(make_cfg("trainer.max_steps=1", "logger=wandb", run_dir=folder))
    monkeypatch.setattr(eval_cli, "evaluate", lambda *_: pytest.fail("sampled first"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with pytest.raises(SystemExit) as e:
        eval_cli.main([str(folder), "--wandb-mode", "online", "--limit", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert (
        err.startswith("error: --wandb-mode online: no wandb login for https://api.wandb.ai") and "drop the flag" in err
    )
    assert not list(folder.glob("eval*"))


@pytest.mark.parametrize("damage", ["truncated", "no config.json"])
def test_a_damaged_final_student_is_one_line_before_the_teacher_samples(
    finished, tmp_path, capsys, monkeypatch, damage
):
    # An audit's: said once the teacher had sampled (minutes of a real teacher), by eval and by generate.
    import wandistiller.evaluation.evaluate as evaluate_module

    folder = tmp_path / "run"
    shutil.copytree(finished, folder)
    weights = folder / "student" / "diffusion_pytorch_model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        (folder / "student" / "config.json").unlink()
    monkeypatch.setattr(evaluate_module, "load_teacher", lambda *_: pytest.fail("the teacher loaded first"))
    monkeypatch.setattr(generate_cli, "encode_prompts", lambda *a, **k: pytest.fail("the prompts encoded first"))
    said = "truncated or damaged" if damage == "truncated" else "has no config.json"
    for cli, extra in ((eval_cli, ["--limit", "1"]), (generate_cli, ["--prompt", "a red 3"])):
        with pytest.raises(SystemExit) as e:
            cli.main([str(folder), *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"error: the student in {folder / 'student'}") and said in err


def test_a_clip_model_that_cannot_be_had_is_one_line_before_anything_samples(finished, capsys, monkeypatch):
    monkeypatch.setattr(eval_cli, "evaluate", lambda *_: pytest.fail("sampled first"))  # it was said after the samples
    with pytest.raises(SystemExit) as e:
        eval_cli.main([str(finished), "--clip-model", "/nowhere/clip", "--limit", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: --clip-model='/nowhere/clip' cannot be loaded"), err
    assert not list(finished.glob("eval*"))


def test_a_local_clip_folder_scores_teacher_and_student(finished, tiny_clip, tmp_path, capsys):
    # --clip-model DIR was refused as "cannot be loaded (ValueError)": torchmetrics' loader took five Hub ids alone,
    # and its score could not read transformers 5's outputs; no test had given a CLIP model that exists.
    folder = tmp_path / "run"
    shutil.copytree(finished, folder)
    eval_cli.main([str(folder), "--clip-model", str(tiny_clip), "--limit", "1", "--steps", "2"])
    (written,) = folder.glob("eval*clip*.json")
    mean = json.loads(written.read_text())["mean"]
    assert 0 <= mean["teacher_clip_score"] <= 100 and 0 <= mean["student_clip_score"] <= 100, mean


# Where eval's result files are named for users: each name there must be one a test below sees eval write.
DOCUMENTED = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "wandistiller" / "eval.py",
              ROOT / "wandistiller" / "evaluation" / "evaluate.py"]  # fmt: skip


def documented_results() -> set[str]:
    """Every eval result file named in the docs (`eval_step_XXXXXXXX.json` as the run's step 2 writes it)."""
    pattern = re.compile(r"(?<![\w/.-])eval(?:_[\w-]+)?\.(?:json|png)")
    names = {name for path in DOCUMENTED for name in pattern.findall(path.read_text())}
    return {name.replace("XXXXXXXX", "00000002") for name in names}


@pytest.mark.slow  # eight evaluations of a tiny run
def test_a_plain_eval_is_the_runs_own_and_every_result_the_docs_name_is_one_eval_writes(finished, tmp_path, capsys):
    folder = tmp_path / "run"
    shutil.copytree(finished, folder)
    with_end_of_run_eval(folder, steps=2, limit=1)  # the run's own evaluation (the default run's: 10 steps, 8 prompts)
    shutil.copytree(folder / "checkpoints" / "step_00000002", folder / "checkpoints" / "best")
    # What hooks.evaluate ran at the end of the run
    own = evaluate(folder, EvalSettings(steps=2, limit=1, per_prompt=1))
    # A plain `eval RUN` samples at those settings (it took 20 steps and wrote eval_steps20_limit8.json): eval.json
    eval_cli.main([str(folder)])
    assert f"wrote {folder / 'eval.json'} and eval.png" in capsys.readouterr().out
    again = json.loads((folder / "eval.json").read_text())
    assert (again["steps"], again["images"], again["per_prompt"], again["variant"]) == (2, 1, 1, [])
    assert [again["mean"][k] for k in ("latent_mse", "psnr", "ssim")] == [own["mean"][k] for k in
                                                                          ("latent_mse", "psnr", "ssim")]  # fmt: skip
    assert [p.name for p in folder.glob("eval*.json")] == ["eval.json"]
    for args in (["--checkpoint", "best"], ["--checkpoint", "step_2"], ["--student-steps", "1"],
                 ["--student-steps", "1,2,4"], ["--checkpoint", "best", "--steps", "20"]):  # fmt: skip
        eval_cli.main([str(folder), *args])
    # A received run's own prompts file outside it and the package is not read unasked: its held-out prompts are,
    # and the result is named so (never eval.json, which was drawn from that file)
    theirs = write_prompts(tmp_path / "theirs" / "prompts.txt")
    with_end_of_run_eval(folder, steps=2, limit=1, prompts_path=str(theirs))
    eval_cli.main([str(folder)])
    heldout = json.loads((folder / "eval_heldout.json").read_text())
    assert heldout["variant"] == ["heldout"] and heldout["prompts"][0]["prompt"] != "my own prompt"
    written = {p.name for p in folder.iterdir()}
    documented = documented_results()
    assert {"eval.json", "eval_best.json", "eval_student1.json", "eval_best_steps20.json"} <= documented
    assert documented <= written, sorted(documented - written)
