"""Tests wandistiller/job/resumed.py through `train.run` and the CLI: a resume continues the run a user started: its
saved config, with only the keys a resume may change."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from tests.conftest import run_cli
from wandistiller.core.errors import UserError
from wandistiller.job.resumed import continued_config
from wandistiller.train import run

FIRST = ["trainer.max_steps=4", "trainer.batch_size=2", "trainer.checkpoint_every=2"]


def interrupted_run(make_cfg, run_dir):
    """A run of 4 steps with its own overrides, cut short after step 2 (as a kill would leave it)."""
    run(make_cfg(*FIRST, run_dir=run_dir))
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    shutil.rmtree(run_dir / "student")
    (run_dir / "metrics.json").unlink()


def test_a_resume_without_the_original_overrides_continues_the_original_config(make_cfg, tmp_path):
    run_dir = tmp_path / "r"
    interrupted_run(make_cfg, run_dir)
    cfg = continued_config(make_cfg("trainer.resume=auto", run_dir=run_dir), ["trainer.resume=auto"])
    assert cfg.trainer.max_steps == 4 and cfg.trainer.batch_size == 2 and cfg.trainer.checkpoint_every == 2
    shorter = continued_config(make_cfg("trainer.resume=auto", "trainer.max_steps=3", run_dir=run_dir),
                               ["trainer.resume=auto", "trainer.max_steps=3", "logger=none"])  # fmt: skip
    assert shorter.trainer.max_steps == 3 and shorter.trainer.batch_size == 2


def test_overrides_given_again_must_agree_and_all_differences_are_one_line(make_cfg, tmp_path):
    run_dir = tmp_path / "r"
    interrupted_run(make_cfg, run_dir)
    given = ["trainer.resume=auto", "trainer.batch_size=3", "seed=7"]
    with pytest.raises(UserError, match=r"seed=7 \(saved 0\), trainer.batch_size=3 \(saved 2\) disagree") as e:
        continued_config(make_cfg(*given, run_dir=run_dir), given)
    assert "\n" not in str(e.value)
    # A whole composed config (no command line to go by) is held to the saved one key by key.
    with pytest.raises(UserError, match=r"trainer.batch_size=4 \(saved 2\)"):
        run(make_cfg("trainer.resume=auto", "trainer.max_steps=4", run_dir=run_dir))


def test_another_data_source_or_student_on_a_resume_is_named_by_its_choice_key_alone(make_cfg, tmp_path):
    # An audit's: data=<another source> listed each key of both sources, "data.root=unset (saved None)" among them.
    run_dir = tmp_path / "r"
    interrupted_run(make_cfg, run_dir)
    for given, said in (("data=teacher_latents", "data.latents=teacher (saved gaussian)"),
                        ("student=small", "student=small (saved tiny)")):  # fmt: skip
        with pytest.raises(UserError) as e:
            continued_config(make_cfg("trainer.resume=auto", given, run_dir=run_dir), ["trainer.resume=auto", given])
        assert f"with its saved config, and {said} disagree; drop them" in str(e.value), e.value


def test_a_saved_interpolation_that_cannot_resolve_to_its_type_is_one_line(make_cfg, tmp_path):
    from omegaconf import OmegaConf

    run_dir = tmp_path / "r"
    interrupted_run(make_cfg, run_dir)
    config = run_dir / ".hydra" / "config.yaml"
    saved = OmegaConf.load(config)
    saved.teacher.guidance_scale = "${oc.env:WD_TEST_UNSET_VARIABLE}"
    OmegaConf.save(saved, config)
    with pytest.raises(
        UserError, match=r"^teacher.guidance_scale=\$\{oc.env:WD_TEST_UNSET_VARIABLE\}: .*config.yaml\)$"
    ):
        continued_config(make_cfg("trainer.resume=auto", run_dir=run_dir), ["trainer.resume=auto"])


def test_the_continued_run_trains_the_remaining_steps(make_cfg, tmp_path):
    run_dir = tmp_path / "r"
    interrupted_run(make_cfg, run_dir)
    summary = run(make_cfg(*FIRST, "trainer.resume=auto", run_dir=run_dir))
    assert summary["final_step"] == 4 and summary["teacher_shape"]["num_layers"] == 4


def test_a_damaged_saved_config_is_one_line(make_cfg, tmp_path):
    run_dir = tmp_path / "r"
    interrupted_run(make_cfg, run_dir)
    (run_dir / ".hydra" / "config.yaml").write_text("- just\n- a list\n")
    with pytest.raises(UserError, match="config.yaml is damaged"):
        continued_config(make_cfg("trainer.resume=auto", run_dir=run_dir), ["trainer.resume=auto"])
    # Gone: its checkpoints are not continued with the defaults composed anew (another teacher, unsaid: an audit's
    # find), the line names the file and a resume that says whose config it is.
    (run_dir / ".hydra" / "config.yaml").unlink()
    said = r"no .hydra/config.yaml, .* restore it, or continue .* via trainer.resume=.*step_0+2 hydra.run.dir="
    with pytest.raises(UserError, match=said):
        continued_config(make_cfg("trainer.resume=auto", run_dir=run_dir), ["trainer.resume=auto"])


@pytest.mark.slow
def test_cli_resume_keeps_the_first_runs_overrides_and_records_them(tmp_path, cache_dir, tiny_path):
    run_dir = tmp_path / "r"
    base = [f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache_dir}", "logger=none", "hooks.samples.prompts=0",
            "hooks.monitor.val_every=0", "~hooks.evaluate", "trainer.progress_bar=false"]  # fmt: skip
    first = run_cli(*base, *FIRST)
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    (run_dir / "metrics.json").unlink()
    shutil.rmtree(run_dir / "student")
    refused = run_cli(f"hydra.run.dir={run_dir}", "trainer.resume=auto", "trainer.batch_size=8")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith("error: trainer.resume=auto")
    again = run_cli(f"hydra.run.dir={run_dir}", "trainer.resume=auto")
    assert again.returncode == 0, again.stderr[-2000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["final_step"] == 4 and metrics["steps_run"] == 4 and "trainer.batch_size=2" in metrics["overrides"]
    assert "step 4/4: loss" in (run_dir / "train.log").read_text()


def test_steps_a_killed_segment_measured_past_the_resumed_run_are_not_in_its_summary(tmp_path):
    from wandistiller.data.validation import recorded_rows
    from wandistiller.recipe.outputs import whole_run

    rows = [{"step": s, "loss": 1.0} for s in range(1, 18)]  # killed at 17, last checkpoint at 10
    (tmp_path / "metrics_steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    history = [{"step": s, "loss": 0.5} for s in range(11, 14)]  # resumed with trainer.max_steps=13
    with (tmp_path / "metrics_steps.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in history)
    steps = whole_run(recorded_rows(tmp_path), history)
    assert [r["step"] for r in steps] == list(range(1, 14)) and steps[-1]["loss"] == 0.5


def test_a_resume_takes_only_the_changeable_keys_given_not_their_whole_group(make_cfg, tmp_path):
    run_dir = tmp_path / "r"
    run(make_cfg(*FIRST, "logger=wandb", "logger.wandb.mode=disabled", "logger.wandb.project=mine", run_dir=run_dir))
    (run_dir / "metrics.json").unlink()
    given = ["trainer.resume=auto", "+logger.wandb.tags=[again]"]  # + : these tests compose with logger=none
    cfg = continued_config(make_cfg(*given, run_dir=run_dir), given)
    w = cfg.logger.wandb
    assert w.project == "mine" and w.mode == "disabled" and list(w.tags) == ["again"]


@pytest.mark.slow  # two runs (~7 s); the naming itself: job/test_checks and test_plan
def test_a_teacher_given_by_path_is_named_by_its_folder_in_the_run_and_its_resume(make_cfg, tmp_path, tiny_path):
    from omegaconf import OmegaConf

    teacher, run_dir = tmp_path / "MyWan", tmp_path / "r"
    shutil.copytree(tiny_path, teacher)
    run(make_cfg(*FIRST, f"teacher.path={teacher}", run_dir=run_dir))
    assert json.loads((run_dir / "metrics.json").read_text())["teacher_config_name"] == "MyWan"  # was "tiny"
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml").teacher
    assert (saved.name, saved.builtin) == ("MyWan", None)
    for left in ("checkpoints/step_00000004", "student"):
        shutil.rmtree(run_dir / left)
    (run_dir / "metrics.json").unlink()
    # A whole composed config (no command line to go by) is held to the saved one key by key: the names agree.
    assert run(make_cfg(*FIRST, f"teacher.path={teacher}", "trainer.resume=auto", run_dir=run_dir))["final_step"] == 4


def test_a_setting_of_a_hook_the_saved_run_did_not_have_brings_the_whole_hook(make_cfg, tmp_path):
    run_dir = tmp_path / "r"
    interrupted_run(make_cfg, run_dir)  # its hooks: monitor and progress (the test default)
    given = ["trainer.resume=auto", "hooks=[monitor,progress,samples]", "hooks.samples.prompts=1"]
    cfg = continued_config(make_cfg(*given[1:], "trainer.resume=auto", run_dir=run_dir), ["trainer.resume=auto",
                           "hooks.samples.prompts=1"])  # fmt: skip
    assert cfg.hooks.samples._target_.endswith("SampleGrids") and cfg.hooks.samples.prompts == 1


DMD = ["method=dmd", "method.steps=2", "method.fake_updates=1", "trainer.batch_size=2", "trainer.max_steps=1",
       "trainer.checkpoint_every=1"]  # fmt: skip


def test_a_method_given_again_is_held_to_the_keys_given_and_a_difference_names_those_keys_alone(make_cfg, tmp_path):
    run_dir = tmp_path / "r"
    run(make_cfg(*DMD, "method.fake_score=lora", "method.lora_rank=2", run_dir=run_dir))
    again = ["trainer.resume=auto", "method=dmd"]  # the run's method restated: its saved K and fake score kept
    cfg = continued_config(make_cfg(*again, run_dir=run_dir), again)
    assert (cfg.method.steps, cfg.method.fake_score, cfg.method.lora_rank) == (2, "lora", 2)
    other = [*again, "method.fake_score=student"]
    with pytest.raises(UserError, match=r"and method.fake_score=student \(saved lora\) disagree; drop them") as e:
        continued_config(make_cfg(*other, run_dir=run_dir), other)
    assert "{" not in str(e.value)  # neither whole `method` node
    kd = ["trainer.resume=auto", "method=kd"]
    with pytest.raises(UserError, match=r"and method=kd \(saved dmd\) disagree; drop them"):
        continued_config(make_cfg(*kd, run_dir=run_dir), kd)


@pytest.mark.slow  # two runs and a refused resume: the default lane keeps its 4 minutes
def test_a_resume_says_it_continues_the_saved_config_only_once_it_is_accepted(make_cfg, tmp_path, caplog):
    run_dir = tmp_path / "r"
    run(make_cfg(*DMD, run_dir=run_dir))
    (run_dir / "metrics.json").unlink()
    with caplog.at_level("INFO", logger="wandistiller"), pytest.raises(UserError, match="teacher_whole_step=true"):
        run(make_cfg(*DMD, "trainer.resume=auto", "trainer.teacher_whole_step=true", run_dir=run_dir))
    assert "continuing with the run's saved config" not in caplog.text  # refused: not a word in its log
    caplog.clear()
    with caplog.at_level("INFO", logger="wandistiller"):
        assert run(make_cfg(*DMD, "trainer.resume=auto", "trainer.max_steps=2", run_dir=run_dir))["final_step"] == 2
    assert caplog.text.count("trainer.resume=auto: continuing with the run's saved config") == 1


def before_methods(finished, tmp_path):
    """A copy of a finished tiny run as a version before the `method` group left it (c1bf174: `git show
    c1bf174:wandistiller/conf/train.yaml` composes no method, and its checkpoints' state.json held student, optimizer,
    lr_scheduler, scaler, ema, tracker_run_id, step and rng alone), cut short after step 1: no `method` in its saved
    config, neither `method_identity` nor `teacher` in its checkpoint."""
    folder = tmp_path / "old"
    shutil.copytree(finished, folder)
    config = folder / ".hydra" / "config.yaml"
    saved = yaml.safe_load(config.read_text())
    del saved["method"]
    config.write_text(yaml.safe_dump(saved))
    shutil.rmtree(folder / "checkpoints" / "step_00000002")
    state = folder / "checkpoints" / "step_00000001" / "state.json"
    recorded = json.loads(state.read_text())
    del recorded["method_identity"], recorded["teacher"]
    state.write_text(json.dumps(recorded))
    shutil.rmtree(folder / "student")
    (folder / "metrics.json").unlink()
    return folder


def test_a_run_saved_before_methods_resumes_as_the_kd_it_trained_with(finished, make_cfg, tmp_path):
    folder = before_methods(finished, tmp_path)
    # It said "method has no value: an override removed it (~method?)", which no one wrote.
    cfg = continued_config(make_cfg("trainer.resume=auto", run_dir=folder), ["trainer.resume=auto"])
    assert cfg.method.name == "kd" and cfg.method._target_ == "wandistiller.recipe.methods.kd.KD"
    again = ["trainer.resume=auto", "method=kd"]  # its method restated: the same
    assert continued_config(make_cfg(*again, run_dir=folder), again).method.name == "kd"
    other = ["trainer.resume=auto", "method=trajectory"]
    with pytest.raises(UserError, match=r"method=trajectory \(saved kd\) disagree"):
        continued_config(make_cfg(*other, run_dir=folder), other)


@pytest.mark.slow  # a training run and an eval in fresh processes
def test_a_run_saved_before_methods_resumes_from_the_cli_and_still_evaluates(finished, tmp_path, cache_dir):
    from wandistiller import eval as eval_cli

    folder = before_methods(finished, tmp_path)
    eval_cli.main([str(folder), "--steps", "2", "--limit", "1"])  # eval of such a run keeps working (its checkpoint)
    result = json.loads((folder / "eval_step_00000001_steps2_limit1.json").read_text())
    assert result["student_trained_steps"] is None and result["student_steps"] == [2]  # a KD student
    resumed = run_cli(f"hydra.run.dir={folder}", f"paths.cache_dir={cache_dir}", "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    log = (folder / "train.log").read_text()
    assert "saved before the `method` group: it trained as method=kd, and continues so" in log
    assert json.loads((folder / "metrics.json").read_text())["final_step"] == 2
    state = json.loads((folder / "checkpoints" / "step_00000002" / "state.json").read_text())
    assert "kd" in json.dumps(state["method_identity"])  # its next checkpoint records the method it continued


def saved_run(make_cfg, run_dir, *first: str):
    """A run folder holding only what a resume reads first: its saved config and overrides (nothing trained)."""
    from omegaconf import OmegaConf

    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(make_cfg(*first, run_dir=run_dir), run_dir / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create(list(first)), run_dir / ".hydra" / "overrides.yaml")
    return run_dir


def test_an_experiment_on_a_resume_is_held_to_the_run_never_dropped(make_cfg, tmp_path):
    kd = saved_run(make_cfg, tmp_path / "kd", "trainer.max_steps=4")
    given = ["trainer.resume=auto", "+experiment=pocket_fewstep"]
    with pytest.raises(UserError, match=r"experiment=pocket_fewstep \(it sets .*method=dmd \(saved kd\)") as e:
        continued_config(make_cfg(*given, run_dir=kd), given)
    assert "\n" not in str(e.value) and "hydra.run.dir=<a new folder>" in str(e.value)
    # The first launch's experiment given again restates it: the run continues as it was made.
    few = saved_run(make_cfg, tmp_path / "few", "+experiment=pocket_fewstep", "trainer.max_steps=6")
    cfg = continued_config(make_cfg(*given, run_dir=few), given)
    assert cfg.method.name == "dmd" and cfg.trainer.max_steps == 6
    other = ["trainer.resume=auto", "+experiment=pocket_lora"]
    with pytest.raises(UserError, match=r"experiment=pocket_lora \(it sets student=.*lora"):
        continued_config(make_cfg(*other, run_dir=few), other)


def test_an_experiments_teacher_on_a_resume_is_named_not_taken_as_the_runs_teacher_moved(make_cfg, tmp_path):
    """A checkpoint that records its teacher lets a resume find that teacher at a new teacher.path; an experiment's
    own teacher is not that: the line names it among what the experiment would change (it named only the method's
    keys, as if the teacher were the run's, moved)."""
    folder = tmp_path / "r"
    first = ["+experiment=pocket_i2v_lora", "trainer.max_steps=2", "trainer.checkpoint_every=2", "hooks=[progress]"]
    run(make_cfg(*first, run_dir=folder))  # its teacher node differs from pocket_video's by its place alone
    given = ["trainer.resume=auto", "+experiment=pocket_video_lora"]
    with pytest.raises(UserError) as e:
        continued_config(make_cfg(*given, run_dir=folder), given)
    assert "experiment=pocket_video_lora (it sets " in str(e.value), e.value
    assert "teacher=pocket_video (saved pocket_i2v)" in str(e.value), e.value


@pytest.mark.parametrize("dropped", [["~hooks.monitor"], ["hooks=[progress]"]])
def test_a_resume_drops_the_hooks_it_is_told_to(make_cfg, tmp_path, dropped):
    run_dir = saved_run(make_cfg, tmp_path / "r", "trainer.max_steps=4")
    given = ["trainer.resume=auto", *dropped]
    cfg = continued_config(make_cfg(*given, run_dir=run_dir), given)
    assert list(cfg.hooks) == ["progress"]


def test_a_resume_keeps_the_lr_schedule_the_run_was_made_with(make_cfg, tmp_path, caplog):
    """Another trainer.max_steps never reshapes the run's schedule (its length stays the first launch's): shorter stops
    earlier along it, longer trains on at its last LR, and the line that continues the run says so."""
    import torch
    from diffusers.optimization import get_scheduler

    from wandistiller.job.resumed import continuing
    from wandistiller.recipe.distillation import held_after

    run_dir = saved_run(make_cfg, tmp_path / "r", "trainer.max_steps=4", "trainer.warmup_steps=1")
    shorter = ["trainer.resume=auto", "trainer.max_steps=3"]
    cfg = continued_config(make_cfg(*shorter, run_dir=run_dir), shorter)
    assert (cfg.trainer.max_steps, cfg.trainer.schedule_steps) == (3, 4)
    longer = ["trainer.resume=auto", "trainer.max_steps=8"]
    cfg = continued_config(make_cfg(*longer, run_dir=run_dir), longer)
    assert (cfg.trainer.max_steps, cfg.trainer.schedule_steps) == (8, 4)
    with caplog.at_level("INFO", logger="wandistiller"):
        continuing(run_dir)
    # cosine ends at 0: said so plainly (a newcomer's "at its last LR" hid that the steps changed nothing)
    assert "steps 5-8 train at LR 0, where it ends: they change nothing" in caplog.text
    assert f"student.init={run_dir}/student" in caplog.text
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = get_scheduler("cosine", optimizer, num_warmup_steps=1, num_training_steps=4)
    factor = schedule.lr_lambdas[0]
    assert [held_after(factor, 4)(s) for s in (3, 4, 6)] == [factor(3), 0, 0] and factor(6) > 0
    # Still warming up where its schedule ends (the default warm-up of 10 steps, 4 steps run): not 0, said so
    warming = saved_run(make_cfg, tmp_path / "w", "trainer.max_steps=4")
    continued_config(make_cfg(*longer, run_dir=warming), longer)
    caplog.clear()
    with caplog.at_level("INFO", logger="wandistiller"):
        continuing(warming)
    assert "steps 5-8 train at LR 0.0004 (40% of trainer.optimizer.lr), where it ends" in caplog.text
    warm = get_scheduler("cosine", optimizer, num_warmup_steps=10, num_training_steps=4).lr_lambdas[0]
    assert held_after(warm, 4)(6) == warm(4) == 0.4


def test_an_in_process_resume_of_a_precision_auto_run_takes_the_dtypes_it_resolved(make_cfg, tmp_path):
    """In-process callers (wandistiller.quality) give a whole composed config, no overrides: its precision=auto was
    refused against the saved run's resolved fp32; another key that differs is still refused."""
    from wandistiller.core.hydra import resolve_precision

    first = make_cfg("trainer.max_steps=4", "precision=auto", run_dir=tmp_path / "run")
    resolve_precision(first)  # as preflight saves it
    saved_run(lambda *o, run_dir: first, tmp_path / "run")
    again = make_cfg("trainer.max_steps=4", "precision=auto", "trainer.resume=auto", run_dir=tmp_path / "run")
    assert again.precision.name == "auto"
    assert continued_config(again, None).precision.name == first.precision.name != "auto"
    with pytest.raises(UserError, match="trainer.batch_size"):
        again = make_cfg("trainer.batch_size=3", "precision=auto", "trainer.resume=auto", run_dir=tmp_path / "run")
        continued_config(again, None)


def test_a_moved_teacher_and_lora_resume_from_where_they_lie_now_and_other_weights_are_still_refused(
    make_cfg, tmp_path, tiny_path, monkeypatch
):
    """A teacher folder or a teacher.lora file moved (or copied to another disk) between a run and its resume: the
    resume takes the new places, its teacher named by its new folder as a first launch would be, because the
    checkpoint's teacher check holds what they are (the weights' digest, each LoRA's sha256): other weights at the
    new place are still one line, and with no checkpoint to hold them to, a new place is refused as before."""
    from omegaconf import OmegaConf
    from safetensors.torch import load_file, save_file

    from tests.teacher.test_finetune import peft_state
    from wandistiller.teacher.spec import inspect_teacher

    teacher, run_dir = tmp_path / "MyWan", tmp_path / "r"
    shutil.copytree(tiny_path, teacher)
    save_file(peft_state(inspect_teacher(teacher).transformer_config), tmp_path / "style.safetensors")
    monkeypatch.chdir(tmp_path)  # given relative, saved absolute: a tool run from elsewhere reads the same folder
    run(make_cfg(*FIRST, "teacher.path=MyWan", "teacher.lora=[style.safetensors]", run_dir=run_dir))
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml").teacher
    assert (saved.path, list(saved.lora)) == (str(teacher), [str(tmp_path / "style.safetensors")])
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    shutil.rmtree(run_dir / "student")
    (run_dir / "metrics.json").unlink()
    (tmp_path / "loras").mkdir()
    moved, lora = (
        teacher.rename(tmp_path / "Wan-moved"),
        (tmp_path / "style.safetensors").rename(tmp_path / "loras/s.st"),
    )
    now = ["trainer.resume=auto", f"teacher.path={moved}", f"teacher.lora=[{lora}]"]
    cfg = continued_config(make_cfg(*now, run_dir=run_dir), now)
    assert (cfg.teacher.path, cfg.teacher.name, list(cfg.teacher.lora)) == (str(moved), "Wan-moved", [str(lora)])
    assert cfg.trainer.max_steps == 4 and cfg.trainer.batch_size == 2  # the rest is the run's own
    kept = shutil.move(run_dir / "checkpoints", tmp_path / "kept")  # killed before its first checkpoint
    with pytest.raises(UserError, match=r"teacher.lora and teacher.path at a new place: no checkpoint in it records"):
        continued_config(make_cfg(*now, run_dir=run_dir), now)
    shutil.move(kept, run_dir / "checkpoints")
    # A whole composed config takes the new places too; its end-of-run eval reads the teacher where it lies now.
    evaluated = ["hooks=[monitor,progress,evaluate]", "hooks.evaluate.limit=1", "hooks.evaluate.steps=2"]
    summary = run(make_cfg(*FIRST, *now, *evaluated, run_dir=run_dir))
    assert summary["final_step"] == 4 and (run_dir / "eval_steps2_limit1.json").is_file()
    # Taken once, the new places are the run's: a later resume (and every tool: test_runs.py) finds them unasked.
    later = ["trainer.resume=auto", "trainer.max_steps=5"]
    cfg = continued_config(make_cfg(*later, run_dir=run_dir), later)
    assert (cfg.teacher.path, cfg.teacher.name, list(cfg.teacher.lora)) == (str(moved), "Wan-moved", [str(lora)])
    assert OmegaConf.load(run_dir / ".hydra" / "config.yaml").teacher.path == str(teacher)  # the first, kept as made
    (newest,) = (run_dir / ".hydra").glob("config_resume_*.yaml")
    shutil.copy(newest, run_dir / ".hydra" / "config_resume_1.yaml")  # an older resume's (its time 1) changes nothing
    assert continued_config(make_cfg(*later, run_dir=run_dir), later).teacher.path == str(moved)

    other = shutil.copytree(moved, tmp_path / "Other")  # the same shape, other weights
    weights = next((other / "transformer").glob("*.safetensors"))
    save_file({k: v * 1.01 for k, v in load_file(weights).items()}, weights)
    longer = [*FIRST, "trainer.max_steps=6", "trainer.resume=auto", f"teacher.lora=[{lora}]"]
    with pytest.raises(UserError, match=r"does not fit this teacher: .* the weights of the teacher at .*Other differ"):
        run(make_cfg(*longer, f"teacher.path={other}", run_dir=run_dir))
    save_file({k: v * 1.01 for k, v in load_file(lora).items()}, lora)  # the LoRA changed where it lies
    with pytest.raises(
        UserError, match=r"does not fit this teacher: .*lora=\[s.st@1.0 .*, and this run's is teacher.lora=\[s.st@1.0"
    ):
        run(make_cfg(*longer, f"teacher.path={moved}", run_dir=run_dir))


def test_a_resume_with_its_data_at_a_new_place_names_the_link_that_lets_it_read_the_data_there(make_cfg, tmp_path):
    """No checkpoint records what the data was (its files, their captions), so a new data.root cannot be held to
    the run's data and is refused, as before; the line now says how to continue the run with the data moved."""
    from PIL import Image

    data = tmp_path / "shots"
    data.mkdir()
    for i in range(4):
        Image.new("RGB", (64, 64), (60 * i, 0, 0)).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text(f"a red square {i}")
    run_dir = tmp_path / "run"
    run(make_cfg(*FIRST, "data=image_folder", f"data.root={data}", run_dir=run_dir))
    moved = data.rename(tmp_path / "moved")
    now = ["trainer.resume=auto", f"data.root={moved}"]
    with pytest.raises(UserError, match=rf"put it back or link the old place to the new: ln -s {moved} {data}\)"):
        continued_config(make_cfg("data=image_folder", *now, run_dir=run_dir), ["data=image_folder", *now])
    # The link it names lets the run continue on its own saved config.
    data.symlink_to(moved)
    cfg = continued_config(make_cfg("trainer.resume=auto", run_dir=run_dir), ["trainer.resume=auto"])
    assert cfg.data.root == str(data) and cfg.trainer.max_steps == 4


def test_a_saved_config_that_lost_a_group_is_said_as_damaged_not_as_an_override_nobody_gave(make_cfg, tmp_path):
    run_dir = tmp_path / "run"
    interrupted_run(make_cfg, run_dir)
    saved = run_dir / ".hydra" / "config.yaml"
    config = yaml.safe_load(saved.read_text())
    del config["teacher"]
    saved.write_text(yaml.safe_dump(config))
    with pytest.raises(UserError, match=r"config.yaml has no teacher: the run's saved config is damaged; restore it"):
        continued_config(make_cfg("trainer.resume=auto", run_dir=run_dir), ["trainer.resume=auto"])


@pytest.mark.parametrize("schedule,after", [("constant_with_warmup", [0.75, 1.0, 1.0]), ("cosine", [0.75] * 3)])
def test_each_step_logs_the_lr_it_trained_at_and_a_resume_past_the_schedule_goes_on_as_it_says(
    make_cfg, tmp_path, schedule, after
):
    """`lr` in metrics_steps.jsonl is the step's own (it was the next step's: step 1 of a warm-up logged a share it
    never trained at); a constant schedule's warm-up goes on past the first launch's length (it stopped, unsaid),
    and another holds the LR it ends at (a warm-up of 4 over a 3-step schedule: 3/4 of it)."""
    from tests.conftest import metrics_steps

    folder = tmp_path / "r"
    common = [f"trainer.lr_scheduler={schedule}", "trainer.warmup_steps=4", "trainer.optimizer.lr=1e-3",
              "trainer.log_every=1", "trainer.schedule_steps=3", "hooks=[monitor,progress]", "logger=none"]  # fmt: skip
    run(make_cfg(*common, "trainer.max_steps=3", run_dir=folder))
    run(make_cfg(*common, "trainer.max_steps=6", "trainer.resume=auto", run_dir=folder))
    assert [round(r["lr"] / 1e-3, 6) for r in metrics_steps(folder)] == [0.0, 0.25, 0.5, *after]
