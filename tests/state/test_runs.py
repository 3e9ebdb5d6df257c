"""wandistiller/state/runs.py: a run folder read back (config, teacher, student, trust), directly and via the CLIs."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import refused
from tests.state.test_received import one_error_line, received
from wandistiller import eval as eval_cli
from wandistiller import generate as generate_cli
from wandistiller.core.errors import UserError
from wandistiller.state.checkpoint import load_checkpoint, save_checkpoint
from wandistiller.state.runs import (
    RunFolder,
    live_holder,
    load_student,
    open_run,
    student_scheduler,
    student_source,
    student_steps,
)
from wandistiller.teacher.fewstep import student_schedule
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.train import run


def test_a_hub_id_teacher_is_not_downloaded_from_a_received_run(finished, tmp_path, capsys, tiny_path):
    folder, file = received(finished, tmp_path, **{"teacher.path": "evil/repo", "teacher.builtin": None})
    err = one_error_line(capsys, generate_cli, [str(folder), "--prompt", "x"])
    assert "teacher.path='evil/repo'" in err and "--teacher-path" in err and "--allow-download" in err
    out = tmp_path / "out"
    argv = [str(folder), "--prompt", "x", "--steps", "1", "--teacher-path", str(tiny_path), "--out", str(out)]
    generate_cli.run_generate(generate_cli.parse_args(argv))
    assert len(list(out.glob("*.png"))) == 1


def test_a_run_from_another_machine_evaluates_generates_and_resumes(finished, tmp_path, make_cfg, cache_dir):
    """Other absolute paths (the sender's cache and output folder): this machine's cache is used, and
    the sender's folders are never created."""
    elsewhere = tmp_path / "home" / "alice"
    folder, _ = received(finished, tmp_path, **{"paths.cache_dir": str(elsewhere / "cache"),
                                                "paths.output_dir": str(elsewhere / "outputs/run")})  # fmt: skip
    result = eval_cli.evaluate(folder, eval_cli.EvalSettings(steps=1, limit=1))
    assert result["mean"]["latent_mse"] >= 0
    args = generate_cli.parse_args([str(folder), "--prompt", "../../escape", "--steps", "1"])
    paths = generate_cli.run_generate(args)
    assert all(p.resolve().parent == (folder / "generated").resolve() for p in paths)  # no `../` from prompts
    shutil.rmtree(folder / "student")
    (folder / "metrics.json").unlink()
    summary = run(make_cfg("trainer.resume=auto", "trainer.max_steps=3", run_dir=folder))
    assert summary["final_step"] == 3
    assert not elsewhere.exists()


def test_a_folder_without_a_saved_config_is_not_a_run_folder(tmp_path):
    with pytest.raises(UserError, match=r"is not a run folder \(no .hydra/config.yaml\); give an outputs/") as e:
        open_run(tmp_path)
    assert "\n" not in str(e.value)


def test_an_opened_run_uses_this_machines_cache_its_own_folder_and_the_teacher_given(finished, tmp_path, tiny_path):
    folder, _ = received(finished, tmp_path, **{"paths.cache_dir": "/elsewhere/cache", "teacher.path": "evil/repo",
                                                "teacher.builtin": None})  # fmt: skip
    with pytest.raises(UserError, match=r"teacher.path='evil/repo' in .*config.yaml is a Hub id"):
        open_run(folder)
    opened = open_run(folder, teacher_path=str(tiny_path), cache_dir=str(tmp_path / "mine"))
    assert opened.cfg.paths.cache_dir == str(tmp_path / "mine") and opened.cfg.paths.output_dir == str(folder)
    assert opened.cfg.teacher.path == str(tiny_path) and opened.cfg.teacher.builtin is None
    d = opened.cfg.data
    assert opened.latent_shape == (16, d.latent_frames, d.latent_height, d.latent_width)


def test_the_student_comes_from_the_final_folder_or_the_checkpoint_named(tmp_path, caplog):
    folder = RunFolder(tmp_path, OmegaConf.create({}), None)  # student_source reads the folder only
    with pytest.raises(UserError, match=r"has no student yet \(checkpoints: none\); train it first"):
        student_source(folder, None)
    with pytest.raises(UserError, match="--checkpoint 'newest' is not best, latest, step_N or ema"):
        student_source(folder, "newest")
    for step in (2, 4):
        save_checkpoint(tmp_path, step, {"student": {"w": torch.zeros(1)}}, keep=5)
    assert student_source(folder, None).name == "step_00000004"  # no final student yet: the latest checkpoint
    assert "has no final student (the run did not finish): its latest checkpoint, step_00000004" in caplog.text
    assert student_source(folder, "latest").name == "step_00000004"
    assert student_source(folder, "step_2").name == "step_00000002"
    with pytest.raises(UserError, match=r"no checkpoint 'step_3' \(checkpoints: step_00000002, step_00000004\)"):
        student_source(folder, "step_3")
    with pytest.raises(UserError, match="no checkpoint 'best'"):
        student_source(folder, "best")
    tensors = tmp_path / "checkpoints" / "step_00000004" / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:20])  # damaged: said before anything samples, naming the flag
    for asked in (None, "latest"):
        with pytest.raises(
            UserError,
            match=r"^--checkpoint latest: .*step_00000004 cannot be read \(.*\); pick "
            r"another --checkpoint \(step_00000002\)$",
        ):  # fmt: skip (the others: not the damaged one)
            student_source(folder, asked)
    (tmp_path / "student").mkdir()
    with pytest.raises(UserError, match="student has no config.json .* and is not a checkpoint"):  # before sampling
        student_source(folder, None)
    (tmp_path / "student" / "config.json").write_text("{}")
    assert student_source(folder, None) == tmp_path / "student"
    # --checkpoint ema: eval and generate refused it, though the export commands took it
    with pytest.raises(UserError, match=r"has no student_ema/ \(trainer.ema_decay was off, .*\); drop --checkpoint"):
        student_source(folder, "ema")
    (tmp_path / "student_ema").mkdir()
    (tmp_path / "student_ema" / "config.json").write_text("{}")
    assert student_source(folder, "ema") == tmp_path / "student_ema"


def test_a_damaged_student_file_is_one_line_naming_the_folder(tmp_path, tiny_path):
    source = tmp_path / "student"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "diffusion_pytorch_model.safetensors").write_bytes(b"not a tensor file")
    run_folder = RunFolder(tmp_path, OmegaConf.create({}), inspect_teacher(tiny_path))
    with pytest.raises(UserError, match=r"the student in .*student: .*; use --checkpoint latest") as e:
        load_student(run_folder, source, torch.device("cpu"))
    assert "\n" not in str(e.value)


def test_checkpoints_are_chosen_by_name(run_dir, caplog):
    r = open_run(run_dir)
    assert student_source(r, None) == run_dir / "student"
    assert student_source(r, "latest").name == "step_00000002"
    with caplog.at_level(logging.INFO):
        step1 = load_student(r, student_source(r, "step_1"), torch.device("cpu"))
    assert not [m for m in caplog.messages if m.startswith("student:")]  # no "random initialisation": it is not
    final = load_student(r, student_source(r, None), torch.device("cpu"))
    assert not torch.equal(step1.blocks[0].ffn.net[2].weight, final.blocks[0].ffn.net[2].weight)
    state = load_checkpoint(run_dir / "checkpoints/step_00000002")["student"]
    assert torch.equal(final.proj_out.weight, state["transformer.proj_out.weight"])


def test_a_damaged_student_or_run_config_is_one_line_for_the_tools(make_cfg, tmp_path):
    import torch

    from wandistiller.core.errors import UserError
    from wandistiller.state.runs import load_student, open_run
    from wandistiller.train import run

    run_dir = tmp_path / "r"
    run(make_cfg("trainer.max_steps=1", run_dir=run_dir))
    weights = run_dir / "student" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(UserError, match="the student in .*too short|the student in .*truncated"):
        load_student(open_run(run_dir), run_dir / "student", torch.device("cpu"))
    saved = (run_dir / ".hydra" / "config.yaml").read_text()
    (run_dir / ".hydra" / "config.yaml").write_text("[:")
    with pytest.raises(UserError, match="config.yaml cannot be read"):
        open_run(run_dir)
    without_paths = "\n".join(line for line in saved.split("\npaths:")[0].splitlines())  # cut before `paths:`
    for damaged, unset in (("", "paths"), ("seed: 0\n", "paths"), (without_paths, "paths")):
        (run_dir / ".hydra" / "config.yaml").write_text(damaged)  # emptied or cut: an audit's traceback
        with pytest.raises(UserError, match=rf"config.yaml is damaged \(it has no {unset}: not a run's saved"):
            open_run(run_dir)


def test_a_saved_config_with_a_hydra_interpolation_is_one_line_for_the_tools(run_dir):
    config = run_dir / ".hydra" / "config.yaml"
    saved = OmegaConf.load(config)
    saved.teacher.guidance_scale = "${hydra:runtime.choices.teacher}"  # allowed, but only a training job resolves it
    OmegaConf.save(saved, config)
    with pytest.raises(
        UserError, match=r"^teacher.guidance_scale in .*config.yaml: .*(hydra|HydraConfig).*; fix the interpolation"
    ):
        open_run(run_dir)  # eval, generate and the export open a run so


# A student's own step count (issue 28): `method.steps` of its saved config; none (or null) is a KD student.
@pytest.mark.parametrize(
    ("saved", "steps"),
    [
        ({}, None),  # a config saved before the `method` group: today's KD student
        ({"method": None}, None),
        ({"method": {"name": "kd", "steps": None}}, None),
        ({"method": {"name": "kd"}}, None),
        ({"method": {"name": "trajectory", "steps": 4}}, 4),
        ({"method": {"name": "dmd", "steps": 1}}, 1),
    ],
)
def test_a_students_steps_are_its_configs_method_steps_and_none_for_kd(saved, steps):
    assert student_steps(OmegaConf.create({"seed": 0, **saved})) == steps


@pytest.mark.parametrize("bad", [0, -2, 2.5, "4", True, "${oc.env:HOME}"])
def test_a_saved_step_count_that_is_not_one_is_one_line(bad):
    with refused(f"method.steps={bad!r} in the run's saved config is not a step count"):
        student_steps(OmegaConf.create({"method": {"steps": bad}}))


def test_a_kd_student_samples_with_the_teachers_scheduler_and_a_few_step_one_with_its_own(tiny_path):
    spec = inspect_teacher(tiny_path)
    assert student_scheduler(spec, None, 4) is None  # wan_pipeline then loads the teacher's own
    for steps in (4, 2):  # its own K, or another count on the same schedule
        scheduler = student_scheduler(spec, 4, steps)
        scheduler.set_timesteps(steps)
        assert torch.equal(scheduler.timesteps.float(), student_schedule(spec, steps)[0])


def few_step_copy(
    finished, tmp_path, steps: int | None, name: str = "run", method: str | None = None, schedule=None, shift=None
):
    """A copy of a finished tiny run whose saved config says its student takes `steps` steps (`method.steps`),
    trained by `method` (default: trajectory for a few-step student, kd for steps None), at `schedule` (and
    `shift`: `method.schedule`, `method.shift`) where given."""
    folder = tmp_path / name
    shutil.copytree(finished, folder)
    path = folder / ".hydra" / "config.yaml"
    cfg = OmegaConf.load(path)
    method = method or ("kd" if steps is None else "trajectory")
    given = {}
    if schedule is not None:  # a trajectory run's method node whole: its class takes the schedule
        given = {"_target_": "wandistiller.recipe.methods.trajectory.Trajectory", "teacher_steps": 20}
        given |= {"noises_per_prompt": 2, "chunk": 16, "schedule": schedule, "shift": shift}
    OmegaConf.update(cfg, "method", {"name": method, "steps": steps} | given, force_add=True)
    OmegaConf.save(cfg, path)
    return folder


# -- a received run's files, one level down and at every depth (issue 33) -----------------------------------------
# Each of a run's files that a tool reads, moved out of the folder and linked back: the tool refuses it in one line
# (a link in the place of a file it writes whole is replaced instead), the user's file keeps its bytes and mtime, and
# no descriptor of it is left. Without the guard each tool would have used the file silently: it is a good one.
def _student_ema(folder):
    shutil.copytree(folder / "student", folder / "student_ema")
    (folder / "student_ema" / "sampling.json").write_text('{"steps": 4}')


def _student_init(folder, tmp_path):
    from omegaconf import OmegaConf

    from wandistiller.student.model import init_source

    return init_source(OmegaConf.create({"init": str(folder / "student")}), {})


def _export(folder, tmp_path, checkpoint=None):
    from wandistiller.pipeline import export

    out = tmp_path / "export"
    try:
        export(folder, out, checkpoint)
    finally:
        assert not out.exists()  # nothing published


def _export_ema(folder, tmp_path):
    _export(folder, tmp_path, "ema")


def _write_pruning(folder, tmp_path):
    from wandistiller.student.prune import write_record

    write_record({"kept_blocks": [0]}, folder)
    assert json.loads((folder / "pruning.json").read_text()) == {"kept_blocks": [0]}


def _recorded_rows(folder, tmp_path):
    from wandistiller.data.validation import recorded_rows

    recorded_rows(folder)


def _model_card(folder, tmp_path):
    from wandistiller.state.card import model_card

    model_card(folder)


def _load(checkpoint):
    def load(folder, tmp_path):
        run = open_run(folder)
        load_student(run, student_source(run, checkpoint), torch.device("cpu"))

    load.__name__ = f"load_{checkpoint or 'student'}"
    return load


RECEIVED_FILES = [  # (the file linked out, what reads or writes it, a preparation of the folder)
    ("student/diffusion_pytorch_model.safetensors", _load(None), None),
    ("student/config.json", _load(None), None),
    ("checkpoints/step_00000002/tensors.safetensors", _load("step_2"), None),
    ("checkpoints/step_00000002/state.json", _load("latest"), None),
    ("checkpoints/step_00000001/tensors.safetensors", _load("step_1"), None),
    (".hydra/config.yaml", _load(None), None),
    ("metrics.json", _model_card, None),
    ("metrics.json", _export, None),
    ("student/diffusion_pytorch_model.safetensors", _export, None),
    ("student_ema/diffusion_pytorch_model.safetensors", _export_ema, _student_ema),
    ("student_ema/sampling.json", _export_ema, _student_ema),
    ("student_ema/config.json", _export_ema, _student_ema),
    ("student/diffusion_pytorch_model.safetensors", _student_init, None),
    ("student/config.json", _student_init, None),
    ("metrics_steps.jsonl", _recorded_rows, None),
    ("pruning.json", _write_pruning, None),  # written whole: the link is replaced, never written through
]


@pytest.mark.parametrize(("name", "tool", "prepare"), RECEIVED_FILES,
                         ids=[f"{n}-{t.__name__.strip('_<>')}" for n, t, _ in RECEIVED_FILES])  # fmt: skip
def test_a_received_runs_file_linked_out_of_it_is_never_used(finished, tmp_path, name, tool, prepare):
    from tests.core.test_files import descriptors_of

    folder = tmp_path / "received"
    shutil.copytree(finished, folder)
    if prepare:
        prepare(folder)
    mine = tmp_path / "home" / Path(name).name  # the user's own good file of the same kind
    mine.parent.mkdir()
    shutil.move(folder / name, mine)
    os.utime(mine, ns=(10**18, 10**18))
    content = mine.read_bytes()
    (folder / name).symlink_to(mine)
    if name == "pruning.json":
        tool(folder, tmp_path)
        assert not (folder / name).is_symlink()
    else:
        with pytest.raises(UserError, match="leads out of the run folder") as refused:
            tool(folder, tmp_path)
        assert "\n" not in str(refused.value) and Path(name).name in str(refused.value)
    assert mine.read_bytes() == content and mine.stat().st_mtime_ns == 10**18 and not descriptors_of(mine)


def test_a_student_init_folders_truncated_or_crafted_weights_are_one_line(finished, tmp_path):
    from omegaconf import OmegaConf

    from wandistiller.student.model import init_source

    init = tmp_path / "theirs"
    shutil.copytree(finished / "student", init)
    weights = init / "diffusion_pytorch_model.safetensors"
    whole = weights.read_bytes()
    for damaged in (whole[: len(whole) // 2], (2**40).to_bytes(8, "little") + whole[8:], b"\x00" * 3):
        weights.write_bytes(damaged)
        with pytest.raises(UserError) as refused:
            init_source(OmegaConf.create({"init": str(init)}), {})
        message = str(refused.value)
        assert message.startswith(f"student.init={init} holds a damaged weights file: ") and "\n" not in message


@pytest.mark.parametrize("where", ["file", "folder"])
def test_a_teacher_path_whose_files_link_out_of_it_is_one_line_and_a_hub_snapshot_may_link_into_its_cache(
    finished, tmp_path, tiny_path, where
):
    """--teacher-path: every file of the folder is checked before anything reads it (a link out of it is refused in
    one line, the outside file unread); a Hub cache snapshot's links into its own repo's blobs/ are how it is made."""
    from tests.core.test_files import descriptors_of

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_path, teacher)
    weights = teacher / "transformer" / "diffusion_pytorch_model.safetensors"
    mine = tmp_path / "elsewhere" / weights.name
    mine.parent.mkdir()
    shutil.move(weights, mine)
    os.utime(mine, ns=(10**18, 10**18))
    if where == "file":
        weights.symlink_to(mine)
    else:
        shutil.move(teacher / "transformer", tmp_path / "elsewhere" / "transformer")
        (teacher / "transformer").symlink_to(tmp_path / "elsewhere" / "transformer")
    with pytest.raises(UserError, match=r"^--teacher-path .* leads out of the teacher folder .*copy the teacher") as e:
        open_run(finished, teacher_path=str(teacher))
    assert "\n" not in str(e.value) and mine.stat().st_mtime_ns == 10**18 and not descriptors_of(mine)
    # A Hub snapshot: models--org--name/snapshots/<rev>/<file> -> ../../../blobs/<hash>
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    shutil.copytree(tiny_path, snapshot)
    (repo / "blobs").mkdir()
    blob = repo / "blobs" / "0123"
    shutil.move(snapshot / "transformer" / weights.name, blob)
    (snapshot / "transformer" / weights.name).symlink_to(Path("../../../blobs/0123"))
    assert open_run(finished, teacher_path=str(snapshot)).spec.path.samefile(snapshot)
    # An export's --out of its blobs/ (with --force: replaced) would break the snapshot's links: refused.
    from wandistiller.state.runs import check_out_of_inputs

    with pytest.raises(UserError, match="is the folder the teacher's files link into .*, which the export reads"):
        check_out_of_inputs(repo / "blobs", open_run(finished, teacher_path=str(snapshot)))


def test_a_live_run_is_never_read_as_a_finished_one(finished, tmp_path, capsys):
    """export, pipeline, eval and generate on a run whose .lock a live process holds (training, or in its end-of-run
    eval): one line naming it, nothing written; the same folder once the run ends is read as before."""
    import subprocess
    import sys

    from wandistiller import export as export_cli
    from wandistiller import pipeline as pipeline_cli
    from wandistiller.job.rundir import LOCK_FILE
    from wandistiller.state.runs import LOCK_FILE as READ_LOCK

    assert LOCK_FILE == READ_LOCK
    folder = tmp_path / "run"
    shutil.copytree(finished, folder)
    hold = (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, b'pid %d on elsewhere' % os.getpid())\nprint('held', flush=True)\ntime.sleep(120)"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold, str(folder / ".lock")], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        out = tmp_path / "out"
        for cli, argv in (
            (export_cli, [str(folder), "--format", "single-file", "--out", str(out)]),
            (pipeline_cli, [str(folder), "--out", str(out)]),
            (eval_cli, [str(folder)]),
            (generate_cli, [str(folder), "--prompt", "a cat", "--out", str(out)]),
        ):
            err = one_error_line(capsys, cli, argv)
            assert f"is a live run (pid {holder.pid} on elsewhere holds its .lock)" in err and "wait for it" in err
            assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    assert live_holder(folder) is None and open_run(folder).path == folder


def test_on_a_file_system_without_locks_a_run_is_live_while_the_process_its_lock_names_lives_here(
    tmp_path, monkeypatch
):
    """No lock to try there: the holder the run wrote into its .lock, while that process of this host lives (another
    host's cannot be known: not held live, as before the lock existed)."""
    import subprocess
    import sys

    from tests.core.test_atomic import no_locks
    from wandistiller.core.leftovers import HOST

    no_locks(monkeypatch)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / ".lock").write_text(f"pid {sleeper.pid} on {HOST}\n")
        assert live_holder(tmp_path) == f"pid {sleeper.pid} on {HOST}"
        (tmp_path / ".lock").write_text(f"pid {sleeper.pid} on another-host\n")
        assert live_holder(tmp_path) is None
    finally:
        sleeper.kill()
        sleeper.wait()
    (tmp_path / ".lock").write_text(f"pid {sleeper.pid} on {HOST}\n")
    assert live_holder(tmp_path) is None  # ended


def test_a_run_of_a_fine_tuned_teacher_reopens_with_its_loras_and_its_student_fits_only_that_teacher(
    make_cfg, tmp_path, tiny_path, cache_dir
):
    """eval, generate and export reopen a teacher.lora run with its LoRAs merged (the teacher the student learned),
    and refuse the plain teacher for it in one line naming both."""
    import dataclasses

    from safetensors.torch import save_file

    from tests.teacher.test_finetune import peft_state
    from wandistiller.state.runs import check_teacher_fits

    plain = inspect_teacher(tiny_path)
    save_file(peft_state(plain.transformer_config), tmp_path / "style.safetensors")
    folder = tmp_path / "r"
    run(make_cfg("trainer.max_steps=1", f"teacher.lora=[{tmp_path}/style.safetensors]", run_dir=folder))
    reopened = open_run(folder, cache_dir=str(cache_dir))
    assert [lora.path.name for lora in reopened.spec.loras] == ["style.safetensors"]
    check_teacher_fits(reopened, folder / "student", allow_other=False)  # metrics.json's record: the same teacher
    with refused("and this run's is teacher.lora=null"):
        check_teacher_fits(dataclasses.replace(reopened, spec=plain), folder / "student", allow_other=False)


# Issue 42: a student of one layout loaded on another is one line, exit 2, nothing written -- even with
# --allow-other-teacher, which bridges other weights, never other input channels.
def test_an_image_to_video_student_is_never_drawn_by_a_text_to_video_pipeline_or_teacher(
    make_cfg, tmp_path, tiny_path, capsys
):
    from tests.data.sources.test_images import given_images, pairs
    from wandistiller.train import run

    folder = tmp_path / "run"
    run(make_cfg(*pairs(given_images(tmp_path / "images")), run_dir=folder))
    capsys.readouterr()  # the run's own progress
    before = sorted(p.name for p in folder.iterdir())
    cases = {
        (): "is a student of the image-to-video teacher",
        ("--teacher-path", str(tiny_path)): "whose experts take 36 input channels, and the teacher at",
        ("--teacher-path", str(tiny_path), "--allow-other-teacher"): "a student runs only on the layout it was",
    }
    for extra, said in cases.items():
        for cli, argv in ((generate_cli, ["--prompt", "a fox"]), (eval_cli, ["--limit", "1"])):
            if cli is eval_cli and not extra:  # eval draws it from its held-out first frames (tests/evaluation)
                continue
            err = one_error_line(capsys, cli, [str(folder), *argv, *extra])
            if cli is generate_cli and not extra:  # generate draws it, given the first frame
                assert err.startswith("error: --image: a student of an image-to-video teacher continues a given")
                continue
            assert err.startswith(f"error: the student in {folder / 'student'} cannot be drawn here: ") and said in err
    assert sorted(p.name for p in folder.iterdir()) == before  # no generated/, no eval/


# A LoRA student holds one adapter set per expert: on a teacher with another count of experts it cannot run (one
# expert left unadapted, or adapters for none), so it is refused before the teacher samples, whatever
# --allow-other-teacher says, naming the teacher to give; not "use --checkpoint latest", which holds the same sets.
def test_a_lora_student_is_never_drawn_on_a_teacher_with_another_count_of_experts(
    make_cfg, tmp_path, tiny_path, tiny_moe_path, capsys
):
    from tests.student.test_lora import lora_run

    for trained_on, other, held, now in (("tiny", tiny_moe_path, 1, 2), ("tiny_moe", tiny_path, 2, 1)):
        folder = tmp_path / trained_on
        lora_run(make_cfg, folder, trained_on)
        before = sorted(p.name for p in folder.iterdir())
        for cli, argv in ((generate_cli, ["--prompt", "a fox"]), (eval_cli, ["--limit", "1"])):
            other_teacher = ["--teacher-path", str(other), "--allow-other-teacher"]
            err = one_error_line(capsys, cli, [str(folder), *argv, *other_teacher])
            assert err.startswith(f"error: the student in {folder / 'student'} cannot be drawn here: ")
            assert f"it holds adapters for {held} expert(s)" in err and f"the teacher at {other} has {now};" in err
            assert "--teacher-path that teacher's folder" in err and "--checkpoint" not in err
        assert sorted(p.name for p in folder.iterdir()) == before  # nothing sampled, nothing written
    # A teacher of another shape: the adapters' layers are not its layers (the run's record says which).
    from wandistiller.core.arch import TINY_TRANSFORMER
    from wandistiller.teacher.tiny import build_tiny_pipeline

    fewer, folder = tmp_path / "fewer", tmp_path / "trained"
    build_tiny_pipeline(transformer_config={"num_layers": TINY_TRANSFORMER["num_layers"] - 1}).save_pretrained(fewer)
    run(make_cfg("student=lora", "trainer.max_steps=1", run_dir=folder))
    capsys.readouterr()
    for checkpoint in ([], ["--checkpoint", "latest"]):
        other_teacher = ["--teacher-path", str(fewer), "--allow-other-teacher", *checkpoint]
        err = one_error_line(capsys, eval_cli, [str(folder), "--limit", "1", *other_teacher])
        assert "cannot be drawn here: its adapters were trained on a teacher with num_layers=" in err, err


def test_an_out_folder_inside_the_run_or_holding_it_is_refused_and_one_beside_it_is_not(tmp_path):
    from tests.conftest import refused
    from wandistiller.state.runs import check_out_of_run

    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (tmp_path / "link").symlink_to(run_dir)
    for out in (run_dir, run_dir / "export", tmp_path / "link" / "export"):  # a link into the run counts as inside
        with refused("is inside the run folder"):
            check_out_of_run(out, run_dir)
    with refused(f"--out {tmp_path / 'runs'} holds the run folder {run_dir}"):
        check_out_of_run(tmp_path / "runs", run_dir)
    check_out_of_run(tmp_path / "runs" / "export", run_dir)  # beside the run: fine


def test_a_run_whose_teacher_and_lora_moved_is_read_where_they_lie_now_held_to_what_it_recorded(
    make_cfg, tmp_path, tiny_path, capsys
):
    """A run moved to another machine, or its teacher moved since: every tool says in one line which flag gives
    the new place (--teacher-path, --teacher-lora), reads the run there, and refuses other weights found there
    (an export takes no other teacher at all: it ships the student with its teacher's parts)."""
    from safetensors.torch import load_file, save_file

    from tests.teacher.test_finetune import peft_state
    from wandistiller import export as export_cli
    from wandistiller import pipeline as pipeline_cli

    teacher, folder = tmp_path / "MyWan", tmp_path / "r"
    shutil.copytree(tiny_path, teacher)
    save_file(peft_state(inspect_teacher(teacher).transformer_config), tmp_path / "style.safetensors")
    lora = f"teacher.lora=[{{path:{tmp_path}/style.safetensors,strength:0.8}}]"
    run(make_cfg("trainer.max_steps=1", f"teacher.path={teacher}", lora, run_dir=folder))
    (tmp_path / "elsewhere").mkdir()
    moved = teacher.rename(tmp_path / "elsewhere" / "Wan")
    style = (tmp_path / "style.safetensors").rename(tmp_path / "elsewhere" / "style.safetensors")
    out = tmp_path / "out"
    for cli, extra in ((pipeline_cli, ["--out", str(out)]), (export_cli, ["--out", str(out), "--format", "diffusers"]),
                       (generate_cli, ["--prompt", "x"]), (eval_cli, ["--limit", "1"])):  # fmt: skip
        err = one_error_line(capsys, cli, [str(folder), *extra])
        assert f"teacher.path='{teacher}'" in err and "is not there" in err and "--teacher-path DIR" in err, err
        err = one_error_line(capsys, cli, [str(folder), *extra, "--teacher-path", str(moved)])
        assert f"names {tmp_path}/style.safetensors, which is not there" in err and "--teacher-lora FILE" in err, err
        err = one_error_line(capsys, cli, [str(folder), *extra, "--teacher-path", str(moved), "--teacher-lora",
                                           str(style), str(style)])  # fmt: skip
        assert "--teacher-lora gives 2 file(s), and teacher.lora in" in err and "names 1 (style.safetensors)" in err
    assert not out.exists()
    wrongs = {
        "nowhere does not exist; give the teacher's": ["--teacher-path", str(tmp_path / "nowhere")],
        "style.safetensors is a file; give the teacher's": ["--teacher-path", str(style)],
        "x.st: no such file": ["--teacher-path", str(moved), "--teacher-lora", str(moved / "x.st")],
    }
    for said, wrong in wrongs.items():
        assert said in one_error_line(capsys, generate_cli, [str(folder), "--prompt", "x", *wrong])

    opened = open_run(folder, str(moved), teacher_loras=[str(style)])
    assert opened.spec.path == moved and [(x.path, x.strength) for x in opened.spec.loras] == [(style, 0.8)]
    pipeline_cli.main([str(folder), "--out", str(out), "--teacher-path", str(moved), "--teacher-lora", str(style)])
    assert (out / "model_index.json").is_file()

    save_file({k: v * 1.01 for k, v in load_file(style).items()}, style)  # other weights where the LoRA lies now
    again = ["--teacher-path", str(moved), "--teacher-lora", str(style)]
    err = one_error_line(capsys, pipeline_cli, [str(folder), "--out", str(tmp_path / "out2"), *again])
    assert "does not fit this teacher" in err and "an export ships the student with its teacher's parts" in err
    err = one_error_line(capsys, pipeline_cli, [str(folder), "--out", str(tmp_path / "out2"), *again,
                                                "--checkpoint", "latest"])  # fmt: skip
    assert "the student in " + str(folder / "checkpoints" / "step_00000001") + " does not fit this teacher" in err, err
    assert not (tmp_path / "out2").exists()
    err = one_error_line(capsys, generate_cli, [str(folder), "--prompt", "x", *again])
    assert "does not fit this teacher" in err and "--allow-other-teacher" in err


def test_a_saved_teacher_folder_since_filled_with_another_model_is_never_exported_beside_the_student(
    make_cfg, tmp_path, tiny_path, tiny_moe_path, tiny_i2v_path, capsys
):
    """The run's teacher.path still there but holding other weights (another download, a fine-tune copied over it):
    an export is refused in one line saying so, as a --teacher-path of other weights is; it shipped them before."""
    from wandistiller import export as export_cli

    teacher, folder, out = tmp_path / "MyWan", tmp_path / "r", tmp_path / "out"
    shutil.copytree(tiny_path, teacher)
    run(make_cfg("trainer.max_steps=1", f"teacher.path={teacher}", run_dir=folder))
    swaps = {  # the same shape, other weights: exported without a word
        tiny_moe_path: ("does not fit this teacher: ", "the weights of the teacher at", "now hold other weights"),
        # another layout: said "give the run folder it was trained in"
        tiny_i2v_path: ("cannot be exported with this teacher: ", "is image-to-video (its experts take", "layout"),
    }
    for other, said in swaps.items():
        shutil.rmtree(teacher)
        shutil.copytree(other, teacher)
        for extra in ([], ["--checkpoint", "latest"]):
            err = one_error_line(capsys, export_cli, [str(folder), "--out", str(out), "--format", "diffusers", *extra])
            assert all(part in err for part in said) and "run folder it was trained in" not in err, err
    assert not out.exists()
    shutil.rmtree(teacher)
    shutil.copytree(tiny_path, teacher)  # put back: it exports
    export_cli.main([str(folder), "--out", str(out), "--format", "diffusers"])
    assert (out / "model_index.json").is_file()


def test_a_run_resumed_where_its_teacher_lies_now_is_read_there_by_every_tool(make_cfg, tmp_path, tiny_path, capsys):
    """Once a resume took the teacher's new place (held to its checkpoint's record), the run's tools read it there
    without --teacher-path: the newest resume config's places, never its first's; a damaged one changes nothing."""
    teacher, folder = tmp_path / "MyWan", tmp_path / "r"
    shutil.copytree(tiny_path, teacher)
    run(make_cfg("trainer.max_steps=1", f"teacher.path={teacher}", run_dir=folder))
    moved = teacher.rename(tmp_path / "Wan-moved")
    run(make_cfg("trainer.max_steps=2", "trainer.resume=auto", f"teacher.path={moved}", run_dir=folder))
    opened = open_run(folder)
    assert opened.spec.path == moved and opened.cfg.teacher.name == "Wan-moved"
    eval_cli.main([str(folder), "--limit", "1", "--steps", "2"])
    (newest,) = (folder / ".hydra").glob("config_resume_*.yaml")
    moved.rename(tmp_path / "gone")  # moved again: the line names the resume config that said where it was
    err = one_error_line(capsys, generate_cli, [str(folder), "--prompt", "x"])
    assert f"teacher.path='{moved}' in {newest} is not there" in err and "--teacher-path DIR" in err, err
    newest.write_text("teacher: [")  # unreadable: the first config's place, as before any resume
    err = one_error_line(capsys, generate_cli, [str(folder), "--prompt", "x"])
    assert f"teacher.path='{teacher}' in {folder / '.hydra' / 'config.yaml'} is not there" in err, err


def test_a_clip_run_against_an_image_teacher_is_one_line_naming_the_flag_a_tool_has(tmp_path):
    """eval and generate cannot change a run's frames: the fix they give is the teacher it was trained with."""
    from wandistiller.pocket import TEACHER_DIR, VIDEO_TEACHER_DIR
    from wandistiller.state.runs import check_frames

    for frames, teacher in ((5, TEACHER_DIR), (1, VIDEO_TEACHER_DIR)):
        cfg = OmegaConf.create({"data": {"latent_frames": frames, "latent_height": 8, "latent_width": 8}})
        with pytest.raises(UserError, match=r"; use it with the teacher it was trained with \(--teacher-path .*\)$"):
            check_frames(RunFolder(tmp_path, cfg, inspect_teacher(teacher)))


def test_a_checkpoint_linked_in_from_outside_is_refused_by_name_by_every_reader_never_passed_over(tmp_path, caplog):
    """eval, generate, pipeline and export took the older checkpoint past a newer one linked in from outside (and
    called a `cp -rs` copy damaged), where a resume refuses it: the same one line for all, naming the copy."""
    run_dir, other = tmp_path / "run", tmp_path / "other"
    folder = RunFolder(run_dir, OmegaConf.create({}), None)
    for step in (2, 4):
        save_checkpoint(run_dir if step == 2 else other, step, {"student": {"w": torch.zeros(1)}}, keep=5)
    linked = run_dir / "checkpoints" / "step_00000004"
    linked.symlink_to(other / "checkpoints" / "step_00000004")
    copy = f"copy it in (rm {linked} && cp -r {other / 'checkpoints' / 'step_00000004'} {linked}) to take it"
    with refused(f"has no final student (the run did not finish): {linked} leads out of the run folder"):
        student_source(folder, None)
    assert "its latest checkpoint" not in caplog.text  # the refusal alone, not a line naming step 2 first
    with refused(f"--checkpoint latest: {linked} leads out of the run folder (to {other}/checkpoints/step_00000004)"):
        student_source(folder, "latest")
    with refused(f"{copy}, or remove {linked} to take step_00000002"):
        student_source(folder, "latest")
    with refused(f"{copy}, or pick another --checkpoint"):
        student_source(folder, "step_4")
    assert student_source(folder, "step_2").name == "step_00000002"  # an older one asked for by name: no loss
    linked.unlink()
    linked.mkdir()  # a copy made of links (cp -rs): not "damaged", the same line
    for name in ("state.json", "tensors.safetensors"):
        (linked / name).symlink_to(other / "checkpoints" / "step_00000004" / name)
    with refused(f"--checkpoint latest: {linked / 'state.json'} leads out of the run folder"):
        student_source(folder, "latest")
