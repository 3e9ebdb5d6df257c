"""wandistiller/evaluation/evaluate.py: `evaluate` on real (short) run folders: its results and grid, the prompts it
reads from a run's saved config, and what it reads and writes of a received run folder."""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import pytest
import torch
import yaml
from PIL import Image

from tests.conftest import ROOT
from tests.data.test_images import CAPTIONS, write_folder
from tests.state.test_runs import few_step_copy
from wandistiller import eval as eval_cli
from wandistiller.core.errors import UserError
from wandistiller.data.images import image_source
from wandistiller.data.validation import split_prompts
from wandistiller.evaluation.evaluate import EvalSettings, eval_prompts, evaluate, given_first_frames
from wandistiller.evaluation.metrics import KID_MEANING
from wandistiller.state.runs import RunFolder, open_run
from wandistiller.state.trust import Trust
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.train import run

POCKET = ROOT / "wandistiller" / "assets" / "pocket" / "pocket-wan-t2v"


def test_eval_writes_its_json_and_a_grid_named_by_its_settings(run_dir, caplog):
    with caplog.at_level("INFO", logger="wandistiller"):
        result = evaluate(run_dir, EvalSettings(steps=3, limit=2))
    timed = [re.sub(r"[\d.]+ s( each|,)", r"T s\1", m) for m in caplog.messages if m.startswith("eval: the")]
    progress = [re.sub(r"(under 1|about \d+) s for", "D for", m) for m in timed]
    # what the rest costs, said once the first image has measured it
    lines = ("eval: the {}: 1/2 images in T s, so D for the rest", "eval: the {}: 2/2 images, T s each")
    assert progress == [line.format(who) for who in ("teacher", "student") for line in lines]
    # not eval's defaults (20 steps, 8 prompts), which a run without an end-of-run evaluation has as its own
    assert result["files"] == ["eval_steps3_limit2.json", "eval_steps3_limit2.png"]
    assert result["variant"] == ["steps3", "limit2"] and not (run_dir / "eval.json").exists()
    written = json.loads((run_dir / "eval_steps3_limit2.json").read_text())
    assert written == result and len(result["prompts"]) == 2
    for row in result["prompts"]:
        assert set(row) == {"prompt", "latent_mse", "psnr", "ssim", "student_s", "teacher_s"}
        assert row["latent_mse"] > 0 and math.isfinite(row["psnr"]) and -1 <= row["ssim"] <= 1
    assert result["mean"]["speedup"] > 0 and result["student"].endswith("student")
    assert Image.open(run_dir / "eval_steps3_limit2.png").size[0] == 2 * 192
    # The held-out prompts, not training ones: the last tenth of the shipped prompts.
    assert result["prompts"][0]["prompt"] == eval_prompts(open_run(run_dir), None, 2)[0]


def test_results_that_cannot_be_written_are_one_line_and_no_half_result(run_dir):
    (run_dir / "eval_steps1_limit1.png").mkdir()  # os.replace cannot put the figure there, as a full disk could not
    with pytest.raises(UserError, match=r"eval_steps1_limit1.png/.json cannot be written \(Is a directory\); free"):
        evaluate(run_dir, EvalSettings(steps=1, limit=1))
    assert not list(run_dir.glob("*eval*.json"))  # no result, nor a temporary file


def test_eval_of_two_checkpoints_leaves_two_results_and_keeps_the_runs_own(run_dir):
    final = evaluate(run_dir, EvalSettings(steps=2, limit=1))
    first = evaluate(run_dir, EvalSettings(checkpoint="step_1", steps=2, limit=1))
    latest = evaluate(run_dir, EvalSettings(checkpoint="latest", steps=2, limit=1))
    assert final["files"] == ["eval_steps2_limit1.json", "eval_steps2_limit1.png"]
    assert first["files"] == ["eval_step_00000001_steps2_limit1.json", "eval_step_00000001_steps2_limit1.png"]
    assert latest["files"] == ["eval_step_00000002_steps2_limit1.json", "eval_step_00000002_steps2_limit1.png"]
    for result in (final, first, latest):
        assert json.loads((run_dir / result["files"][0]).read_text()) == result
        assert (run_dir / result["files"][1]).is_file()
    assert first["mean"] != final["mean"]  # a different student: the final student's result was not overwritten


@pytest.mark.slow  # a whole run: the default lane keeps its 4 minutes
def test_eval_of_a_pocket_run_measures_prompt_accuracy_and_fid(make_cfg, tmp_path):
    folder = tmp_path / "pocket"
    run(make_cfg("teacher=pocket", "trainer.max_steps=1", run_dir=folder))
    one = evaluate(folder, EvalSettings(steps=2, limit=4))
    mean = one["mean"]
    for who in ("teacher", "student"):  # 4 images: FID/KID withheld (too few), the count said
        assert 0 <= mean[f"{who}_prompt_accuracy"] <= 1 and mean[f"{who}_samples"] == 4 and f"{who}_fid" not in mean
        assert f"{who}_diversity" not in mean  # one image a prompt: no diversity, and eval.json says why
    assert one["withheld"]["diversity"].startswith("per_prompt 1:") and "diversity_ratio" not in mean
    # 4 held-out prompts x 17 noises: FID/KID given
    several = evaluate(folder, EvalSettings(steps=1, limit=4, per_prompt=17))
    assert several["images"] == 68 and several["mean"]["student_samples"] == 68
    assert math.isfinite(several["mean"]["student_fid"]) and math.isfinite(several["mean"]["teacher_kid"])
    assert several["scales"] == {"kid": KID_MEANING} and "scales" not in one  # what KID is, where one is given
    assert several["mean"]["teacher_diversity"] > 0 and several["mean"]["student_diversity"] > 0  # 17 noises a prompt
    ratio = several["mean"]["student_diversity"] / several["mean"]["teacher_diversity"]
    assert several["mean"]["diversity_ratio"] == pytest.approx(ratio) and "withheld" not in several
    rows = several["prompts"]
    assert (
        rows[0]["prompt"] == rows[16]["prompt"] != rows[17]["prompt"] and rows[0]["latent_mse"] != rows[1]["latent_mse"]
    )
    assert Image.open(folder / several["files"][1]).size[1] < 5 * 240  # the grid: each prompt's first image, 4 rows
    # Prompts that are not the pocket's: no judge, so no pocket columns.
    other = evaluate(folder, EvalSettings(prompts_path=str(_fox_prompts(tmp_path)), steps=1, limit=1))
    assert "teacher_fid" not in other["mean"] and "latent_mse" in other["mean"]


def _fox_prompts(tmp_path):
    path = tmp_path / "fox.txt"
    path.write_text("a fox in the snow\n")
    return path


# Which prompts eval reads from a run's saved config (issue 20, issue 16): an image run's own held-out captions; a
# received prompts file only from the run folder or the package, else --prompts FILE. The run folder is built from
# the composed config.
def run_of(make_cfg, tmp_path, tiny_path, *overrides):
    cfg = make_cfg(*overrides)
    return RunFolder(tmp_path / "run", cfg, inspect_teacher(tiny_path))


def test_an_image_run_is_evaluated_on_its_own_held_out_captions(make_cfg, tmp_path, tiny_path):
    root = write_folder(tmp_path / "images")
    run = run_of(make_cfg, tmp_path, tiny_path, "data=image_folder", f"data.root={root}", "data.val_fraction=0.34")
    # the same split training validates on (data_sources._held_out_captions): the last val_fraction of the captions
    held = split_prompts(image_source(run.cfg.data).captions, None, 0.34)[1]
    with pytest.raises(UserError, match=r"data.root=.* lies outside the run folder, so eval does not read its caption"):
        eval_prompts(run, None, 8)  # a received run's data.root is the sender's choice of folder on this machine
    assert eval_prompts(run, None, 8, allow_data=True) == held and len(held) == 1 and held[0] in CAPTIONS
    assert eval_prompts(run, None, 8, own_files=True) == held  # the run's own end-of-run eval
    assert eval_prompts(run, str(write_prompts(tmp_path / "mine.txt")), 8) == ["my own prompt"]  # --prompts wins


def write_prompts(path, text="my own prompt\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("key", ["prompts_path", "val_prompts_path"])
def test_a_received_prompts_file_outside_the_run_and_the_package_is_not_read(make_cfg, tmp_path, tiny_path, key):
    secret = write_prompts(tmp_path / "elsewhere" / "secret.txt", "a private line\nanother\n")
    run = run_of(make_cfg, tmp_path, tiny_path, f"data.{key}={secret}")
    with pytest.raises(UserError) as e:
        eval_prompts(run, None, 8)
    assert str(e.value).startswith(f"data.{key}='{secret}' in the run's saved config lies outside the run folder")
    assert str(e.value).endswith("add --allow-data if you trust that file (its held-out prompts, as eval.json was "
                                 "drawn from), or give --prompts FILE") and "\n" not in str(e.value)  # fmt: skip
    mine = write_prompts(tmp_path / "mine.txt")
    assert eval_prompts(run, str(mine), 8) == ["my own prompt"]  # the user's own file, named on the command line
    # An audit's: --allow-data was ignored here, so a run of the user's own file could not redraw its eval.json
    if key == "prompts_path":
        assert eval_prompts(run, None, 8, allow_data=True) == ["another"]  # its held-out prompt, as the run's eval


def test_prompts_inside_the_run_folder_or_shipped_are_read(make_cfg, tmp_path, tiny_path):
    inside = write_prompts(tmp_path / "run" / "prompts.txt", "one\ntwo\nthree\n")
    assert eval_prompts(run_of(make_cfg, tmp_path, tiny_path, f"data.prompts_path={inside}"), None, 8) == ["three"]
    assert eval_prompts(run_of(make_cfg, tmp_path, tiny_path), None, 8)  # the shipped prompts (the default)


def test_the_end_of_run_eval_reads_the_users_own_prompts_file_wherever_it_lies(make_cfg, tmp_path, tiny_path):
    # `python -m wandistiller.train data.prompts_path=my_prompts.txt` evaluates itself at the end: its own file
    mine = write_prompts(tmp_path / "elsewhere" / "my_prompts.txt", "one\ntwo\nthree\n")
    run = run_of(make_cfg, tmp_path, tiny_path, f"data.prompts_path={mine}")
    assert eval_prompts(run, None, 8, own_files=True) == ["three"]
    with pytest.raises(UserError):  # the same folder received from someone else is not
        eval_prompts(run, None, 8)


def copied(finished, tmp_path):
    folder = tmp_path / "received"
    shutil.copytree(finished, folder)
    return folder


def test_eval_of_a_received_run_replaces_linked_results_and_never_writes_through_them(finished, tmp_path):
    from tests.core.test_files import untouched, victim

    mine = victim(tmp_path)
    other = tmp_path / "home" / "other.png"
    shutil.copy2(mine, other)
    folder = copied(finished, tmp_path)  # a legitimate run moved to another machine: it evaluates
    result, png = folder / "eval_steps1_limit1.json", folder / "eval_steps1_limit1.png"  # what it writes
    result.symlink_to(mine)
    png.hardlink_to(other)
    evaluate(folder, EvalSettings(steps=1, limit=1))
    assert json.loads(result.read_text())["steps"] == 1 and not result.is_symlink()
    assert Image.open(png).size[0] == 2 * 192
    assert untouched(mine) and other.read_bytes() == mine.read_bytes()
    assert sorted(p.name for p in mine.parent.iterdir()) == ["other.png", "victim.txt"]


def test_eval_does_not_load_a_checkpoint_or_student_linked_out_of_the_run(finished, tmp_path, capsys):
    folder = copied(finished, tmp_path)
    step = folder / "checkpoints" / "step_00000002"
    shutil.move(step, tmp_path / "elsewhere")
    step.symlink_to(tmp_path / "elsewhere")
    for flag in ("step_2", "best"):
        if flag == "best":
            (folder / "checkpoints" / "best").symlink_to(tmp_path / "elsewhere")
        with pytest.raises(SystemExit):
            eval_cli.main([str(folder), "--checkpoint", flag, "--steps", "1", "--limit", "1"])
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "leads out of the run folder" in err and "\n" not in err
    shutil.move(folder / "student", tmp_path / "student_elsewhere")
    (folder / "student").symlink_to(tmp_path / "student_elsewhere")
    with pytest.raises(UserError, match="student leads out of the run folder"):
        evaluate(folder, EvalSettings(steps=1, limit=1))
    assert not list(folder.glob("eval*"))


def test_eval_with_a_teacher_of_another_shape_is_refused_unless_asked(finished, tmp_path, capsys):
    from wandistiller.state.trust import Trust

    folder = copied(finished, tmp_path)
    with pytest.raises(SystemExit):
        eval_cli.main([str(folder), "--teacher-path", str(POCKET), "--steps", "1", "--limit", "1"])
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the student in ") and "does not fit this teacher: it was trained against" in err
    assert (
        "num_attention_heads=2, this teacher at" in err
        and err.endswith("--allow-other-teacher to use this one on purpose")
        and "\n" not in err
    )
    assert not list(folder.glob("eval*"))
    args = eval_cli.parse_args([str(folder), "--teacher-path", str(POCKET), "--allow-other-teacher"])
    assert Trust.from_args(args).other_teacher
    with pytest.raises(UserError, match="does not fit this teacher"):  # a checkpoint records it too
        evaluate(folder, EvalSettings("latest", steps=1, limit=1, trust=Trust(teacher_path=str(POCKET))))
    saved = yaml.safe_load((folder / ".hydra" / "config.yaml").read_text())  # the saved teacher.path edited
    saved["teacher"] |= {"path": str(POCKET), "builtin": None}
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(UserError, match="does not fit this teacher"):
        evaluate(folder, EvalSettings(steps=1, limit=1))


@pytest.mark.parametrize("name", ["metrics.csv", "tensorboard", "wandb"])
def test_eval_refuses_a_loggers_file_linked_out_of_the_run_before_the_work(finished, tmp_path, name):
    from tests.core.test_files import untouched, victim

    folder, mine = copied(finished, tmp_path), victim(tmp_path)
    (folder / name).symlink_to(mine if name == "metrics.csv" else mine.parent)
    with pytest.raises(UserError, match=f"{name} leads out of the run folder"):
        evaluate(folder, EvalSettings(steps=1, limit=1))
    assert not list(folder.glob("eval*")) and untouched(mine)  # refused before sampling, not after
    assert sorted(p.name for p in mine.parent.iterdir()) == ["victim.txt"]


# A student at its own steps (issue 28): a few-step student at its K, any student at the counts asked for.
def test_eval_student_steps_gives_one_result_per_count_with_its_network_calls(finished, tmp_path, capsys):
    folder = few_step_copy(finished, tmp_path, 2)
    eval_cli.main([str(folder), "--student-steps", "1,2", "--steps", "2", "--limit", "1"])
    out = capsys.readouterr().out
    assert "student at 1 step:" in out and "(1 call)" in out and "student at 2 steps:" in out and "(4 calls)" in out
    result = json.loads((folder / "eval_student1-2_steps2_limit1.json").read_text())
    assert result["student_trained_steps"] == 2 and result["student_steps"] == [1, 2] and result["teacher_steps"] == 2
    assert list(result["results"]) == ["1", "2"]
    for n, one in result["results"].items():
        assert one["student_steps"] == int(n) and one["mean"]["student_calls_per_image"] == int(n)
        assert one["mean"]["teacher_calls_per_image"] == 4  # 2 steps with CFG
    one, two = result["results"]["1"]["mean"], result["results"]["2"]["mean"]
    assert one["latent_mse"] != two["latent_mse"] and result["mean"] == one  # the first also as `mean`
    assert result["withheld"]["diversity"].startswith("per_prompt 1: intra-prompt diversity needs 2 or more")


def test_a_student_trained_at_explicit_sigmas_is_evaluated_on_them_and_at_no_other_count(finished, tmp_path):
    folder = few_step_copy(finished, tmp_path, 2, "listed", schedule=[1.0, 0.4])
    with pytest.raises(UserError, match=r"^--student-steps 3: the student was trained at 2 explicit sigmas"):
        evaluate(folder, EvalSettings(steps=2, limit=1, student_steps=[3]))
    listed = evaluate(folder, EvalSettings(steps=2, limit=1))
    euler = evaluate(few_step_copy(finished, tmp_path, 2, "euler"), EvalSettings(steps=2, limit=1))
    assert listed["mean"]["latent_mse"] != euler["mean"]["latent_mse"]  # other sigmas, other samples


def test_a_few_step_student_is_evaluated_at_its_own_k_and_a_kd_one_as_before(finished, tmp_path):
    few = evaluate(few_step_copy(finished, tmp_path, 3, "few"), EvalSettings(steps=2, limit=1))
    assert few["student_steps"] == [3] and few["mean"]["student_calls_per_image"] == 3
    kd_folder = few_step_copy(finished, tmp_path, None, "kd")
    # A KD student: the teacher's scheduler at --steps, as before
    kd = evaluate(kd_folder, EvalSettings(steps=2, limit=1))
    assert kd["student_trained_steps"] is None and kd["student_steps"] == [2]
    assert kd["mean"]["student_calls_per_image"] == 2
    # --student-steps works for a KD student too
    asked = evaluate(kd_folder, EvalSettings(steps=2, limit=1, student_steps=[2]))
    assert asked["mean"]["latent_mse"] == kd["mean"]["latent_mse"]
    four = evaluate(kd_folder, EvalSettings(steps=2, limit=1, student_steps=[4]))
    assert four["mean"]["student_calls_per_image"] == 4 and four["mean"]["latent_mse"] != kd["mean"]["latent_mse"]


# An evaluation at other settings never overwrites the run's own (eval.json, what metrics.json and the model card
# quote): every setting that changes its figures is in its file name.
def with_end_of_run_eval(folder, **settings):
    """`folder`'s saved config with an end-of-run evaluation (`hooks.evaluate`) at these settings."""
    path = folder / ".hydra" / "config.yaml"
    saved = yaml.safe_load(path.read_text())
    saved["hooks"]["evaluate"] = {"_target_": "wandistiller.recipe.hooks.evaluate.EvaluateAtEnd", "steps": 10,
                                  "per_prompt": 1, "prompts_path": None, "limit": 8} | settings  # fmt: skip
    path.write_text(yaml.safe_dump(saved))
    return folder


def test_eval_at_another_student_step_count_leaves_the_end_of_run_result_untouched(finished, tmp_path, capsys):
    folder = with_end_of_run_eval(few_step_copy(finished, tmp_path, 2, method="dmd"), steps=2, limit=1)
    own = evaluate(folder, EvalSettings(steps=2, limit=1))  # what hooks.evaluate does at the end of the run
    assert own["files"] == ["eval.json", "eval.png"] and own["variant"] == [] and own["student_steps"] == [2]
    before = {name: (folder / name).read_bytes() for name in own["files"]}
    eval_cli.main([str(folder), "--student-steps", "1", "--limit", "1", "--steps", "2"])  # the audit's command
    assert f"wrote {folder / 'eval_student1.json'} and eval_student1.png" in capsys.readouterr().out
    assert {name: (folder / name).read_bytes() for name in own["files"]} == before
    one = json.loads((folder / "eval_student1.json").read_text())
    assert one["student_steps"] == [1] and one["variant"] == ["student1"] and one["mean"] != own["mean"]
    assert (folder / "eval_student1.png").is_file()


def test_the_file_name_carries_each_setting_that_differs_from_the_runs_own(finished, tmp_path):
    from wandistiller.evaluation.evaluate import result_stem, variant

    folder = few_step_copy(finished, tmp_path, 4, method="dmd")
    mine = write_prompts(tmp_path / "mine" / "prompts.txt")
    other = write_prompts(tmp_path / "other" / "prompts.txt")
    with_end_of_run_eval(folder, steps=2, per_prompt=2, prompts_path=str(mine), limit=40)
    run = open_run(folder)
    own = {"student": [4], "steps": 2, "limit": 40, "per_prompt": 2, "prompts": str(mine), "dtype": torch.float32,
           "clip": None, "fid": None}  # fmt: skip
    assert variant(run, own) == [] and result_stem(folder / "student", []) == "eval"
    names = {
        "student": ([1, 2, 4], "student1-2-4"), "steps": (20, "steps20"), "limit": (1, "limit1"),
        "per_prompt": (1, "perprompt1"), "dtype": (torch.bfloat16, "bf16"),
    }  # fmt: skip
    for key, (value, token) in names.items():
        assert variant(run, own | {key: value}) == [token], key
    held_out, theirs = variant(run, own | {"prompts": None}), variant(run, own | {"prompts": str(other)})
    assert held_out == ["heldout"] and theirs[0].startswith("prompts-prompts-") and theirs != variant(run, own)
    assert variant(run, own | {"prompts": str(mine.parent / ".." / "mine" / "prompts.txt")}) == []  # one file
    assert variant(run, own | {"clip": "openai/clip-vit-base-patch32"})[0].startswith("clip-clip-vit-base-patch32-")
    assert variant(run, own | {"fid": str(tmp_path / "refs")})[0].startswith("fid-refs-")
    checkpoint = folder / "checkpoints" / "step_00000002"
    assert result_stem(checkpoint, ["student1", "steps20"]) == "eval_step_00000002_student1_steps20"
    # A run without an end-of-run evaluation has eval's defaults as its own; a KD student's own count is --steps.
    kd = open_run(few_step_copy(finished, tmp_path, None, "kd"))
    defaults = own | {"student": [20], "steps": 20, "limit": 8, "per_prompt": 1, "prompts": None}
    assert variant(kd, defaults) == [] and variant(kd, defaults | {"student": [4], "steps": 4}) == ["steps4"]


def test_settings_left_unset_are_the_runs_own_end_of_run_evaluations(finished, tmp_path):
    from wandistiller.evaluation.evaluate import DEFAULTS, run_settings
    from wandistiller.state.trust import Trust

    folder = few_step_copy(finished, tmp_path, None)
    assert run_settings(open_run(folder), None, None, None, None, Trust()) == (20, 8, 1, None)  # no hooks.evaluate
    assert DEFAULTS == {"steps": 20, "limit": 8, "per_prompt": 1, "prompts_path": None}
    inside = write_prompts(folder / "prompts.txt")
    with_end_of_run_eval(folder, steps=3, limit=2, per_prompt=2, prompts_path=str(inside))
    run = open_run(folder)
    assert run_settings(run, None, None, None, None, Trust()) == (3, 2, 2, str(inside))
    assert run_settings(run, 5, 1, 1, "given.txt", Trust()) == (5, 1, 1, "given.txt")  # what is given wins
    # the run's own file outside the run folder: read for the run's own end-of-run eval, not unasked for a received run
    outside = write_prompts(tmp_path / "elsewhere" / "prompts.txt")
    with_end_of_run_eval(folder, steps=3, limit=2, prompts_path=str(outside))
    run = open_run(folder)
    assert run_settings(run, None, None, None, None, Trust())[3] is None
    assert run_settings(run, None, None, None, None, Trust(own_files=True))[3] == str(outside)


@pytest.mark.parametrize(("asked", "message"), [
    ({"per_prompt": 10**9}, r"--per-prompt 1000000000 \(\d+ prompts\) asks for [\d,]+ images, which take"),
    ({"steps": 5000}, "--steps 5000 is more than this teacher's 1000 training timesteps"),
    ({"student_steps": [1, 1001]}, "--student-steps 1001 is more than this teacher's 1000 training timesteps"),
])  # fmt: skip
def test_eval_bounds_every_count_by_the_run_before_any_work(finished, tmp_path, asked, message, caplog):
    """`eval --per-prompt 1000000` used to run unbounded: each count is checked against what it would take (the
    teacher's timesteps, this machine's memory for the images held at once), in one line, before any sampling."""
    folder = copied(finished, tmp_path)
    with caplog.at_level("INFO", logger="wandistiller"), pytest.raises(UserError, match=message) as e:
        evaluate(folder, EvalSettings(**({"steps": 1, "limit": 1} | asked)))
    assert "\n" not in str(e.value) and not list(folder.glob("eval*"))
    assert not [m for m in caplog.messages if m.startswith("eval: the")]  # nothing sampled


def other_weights(tiny_path, tmp_path):
    """The tiny teacher with other weights of the same shape: a fine-tune, say."""
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other-teacher"
    shutil.copytree(tiny_path, other)
    file = other / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(file)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 0.01
    save_file(tensors, file, metadata={"format": "pt"})
    return other


def test_a_result_against_another_teacher_is_named_for_it(finished, tmp_path, tiny_path):
    """--allow-other-teacher: the result goes to its own file, named for that teacher's weights (every tensor's
    digest: two fine-tunes of a few layers can share the coarse one), and carries the teacher, path and digests (the
    slow test below)."""
    from wandistiller.state.checkpoint import tensors_digest
    from wandistiller.state.runs import open_run, other_teacher_tag
    from wandistiller.state.trust import Trust
    from wandistiller.teacher.spec import inspect_teacher

    folder, other = copied(finished, tmp_path), other_weights(tiny_path, tmp_path)
    with pytest.raises(UserError, match="does not fit this teacher: .* weights of the teacher at .* differ"):
        evaluate(folder, EvalSettings(steps=1, limit=1, trust=Trust(teacher_path=str(other))))
    digest = tensors_digest(inspect_teacher(other))
    run = open_run(folder, str(other))
    assert other_teacher_tag(run, folder / "student", True) == f"teacher-{digest[:12]}"
    assert other_teacher_tag(open_run(folder), folder / "student", True) is None  # the recorded one: its own name
    assert other_teacher_tag(run, folder / "student", False) is None  # refused without the flag, as above


@pytest.mark.slow  # a whole evaluation (~3 s): the default lane checks the names above
def test_a_result_against_another_teacher_goes_to_its_own_file_and_carries_the_teacher(finished, tmp_path, tiny_path):
    from wandistiller.state.checkpoint import teacher_digest, tensors_digest
    from wandistiller.state.trust import Trust
    from wandistiller.teacher.spec import inspect_teacher

    folder, other = copied(finished, tmp_path), other_weights(tiny_path, tmp_path)
    own = folder / "eval.json"
    own.write_text('{"judged": "against its own teacher"}')
    os.utime(own, ns=(10**18, 10**18))
    spec = inspect_teacher(other)
    digest, fine = teacher_digest(spec), tensors_digest(spec)
    result = evaluate(folder, EvalSettings(steps=1, limit=1, trust=Trust(teacher_path=str(other), other_teacher=True)))
    assert result["files"][0].endswith(f"_teacher-{fine[:12]}.json") and result["files"][0].startswith("eval_")
    saved = json.loads((folder / result["files"][0]).read_text())
    assert saved["teacher"] == {"path": str(other), "digest": digest, "tensors_digest": fine, "recorded": False}
    assert own.read_text() == '{"judged": "against its own teacher"}' and own.stat().st_mtime_ns == 10**18


# Issue 42: an image-to-video run is evaluated as it was trained -- each held-out caption continues its own image.
def test_an_image_to_video_run_is_evaluated_from_its_held_out_first_frames(make_cfg, tmp_path, capsys, tiny_i2v_path):
    """The teacher and the student continue the held-out caption's own image (the folder's last), through the
    model's own image-to-video pipeline: the result's first-frame PSNR is the student clip's, drawn here from that
    image by `generate`, bit for bit. Prompts without images are one line, nothing written."""
    from tests.data.sources.test_images import given_images, pairs
    from wandistiller.data.conditions import fitted
    from wandistiller.data.prompts import encode_prompts
    from wandistiller.evaluation.clips import first_frame_psnr, pil_tensor
    from wandistiller.state.runs import student_sampler
    from wandistiller.state.sampling import generate
    from wandistiller.teacher.image import load_image_encoder
    from wandistiller.teacher.vae import decode_clips, load_vae

    root = given_images(tmp_path / "images", (72, 72))
    folder = tmp_path / "r"
    run(make_cfg(*pairs(root), run_dir=folder))
    result = evaluate(folder, EvalSettings(steps=2, limit=1, trust=Trust(data=True)))
    (row,) = result["prompts"]
    assert row["prompt"] == CAPTIONS[-1] and math.isfinite(row["first_frame_psnr"])  # the held-out caption: the last
    assert result["mean"]["student_first_frame_psnr"] == row["first_frame_psnr"]
    assert math.isfinite(result["mean"]["teacher_first_frame_psnr"]) and (folder / result["files"][0]).is_file()
    with pytest.raises(UserError) as refused:  # its data folder lies outside it: --allow-data, never --prompts
        evaluate(folder, EvalSettings(steps=2, limit=1))
    assert str(refused.value).endswith("does not read its captions; --allow-data if you trust that folder")

    opened = open_run(folder)
    image = fitted(Image.open(root / "img2.png"), 32, 32, "img2", "data.root")  # as training fits it
    cpu = torch.device("cpu")
    student = student_sampler(opened, folder / "student", cpu)
    vae = load_vae(opened.spec, cpu)
    t = opened.cfg.teacher
    emb = encode_prompts(opened.spec, [row["prompt"]], t.negative_prompt, t.max_sequence_length, torch.float32, cpu,
                         opened.cfg.paths.cache_dir)  # fmt: skip
    shape = opened.latent_shape
    latents, _ = generate(student, emb, [0], int(opened.cfg.seed), opened.trained_steps or 2, shape, per_prompt=1,
                          images=(vae, load_image_encoder(opened.spec, cpu), lambda i, k: image))  # fmt: skip
    assert first_frame_psnr(decode_clips(vae, latents), pil_tensor(image)[None]) == [row["first_frame_psnr"]]

    before = sorted(p.name for p in folder.iterdir())
    capsys.readouterr()  # the run's own progress
    with pytest.raises(SystemExit) as e:
        eval_cli.main(
            [str(folder), "--limit", "1", "--allow-data", "--prompts", str(write_prompts(tmp_path / "p.txt"))]
        )
    err = capsys.readouterr().err.strip()
    said = "this student of an image-to-video teacher continues each held-out caption's own first frame"
    assert e.value.code == 2 and said in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in folder.iterdir()) == before
    # Held-out prompts of the user's own (data.val_prompts_path) have no first frames either.
    own = run_of(
        make_cfg, tmp_path, tiny_i2v_path, *pairs(root), f"data.val_prompts_path={write_prompts(tmp_path / 'v.txt')}"
    )
    with pytest.raises(UserError, match=r"^data.val_prompts_path=.* held out prompts of the user's own, which have no"):
        given_first_frames(own, None, 1, True)
