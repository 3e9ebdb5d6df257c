"""wandistiller/recipe/hooks/collapse.py: the collapse watch driven directly on the tiny teacher (a real RunContext,
the teacher placed on the CPU, real students sampled through WanPipeline): its figures logged at every check, the
teacher's reference drawn once, the same probe at every check, one warning per episode on a collapsed student and
none on the teacher itself, nothing for a KD student unless asked; its refusals; and a whole CLI run (slow)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from tests.conftest import CONF, FP32, metrics_steps, refused, run_cli
from wandistiller.core.distributed import Topology, roles_for
from wandistiller.core.errors import UserError
from wandistiller.placements.base import load_teacher
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.recipe.context import RunContext
from wandistiller.recipe.hooks.base import HookParts
from wandistiller.recipe.hooks.collapse import CollapseWatch
from wandistiller.recipe.targets import LocalTargets
from wandistiller.student.model import Student
from wandistiller.teacher.model import load_expert
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.tracking.loggers import NullTracker

FIGURES = {
    "collapse/saturation",
    "collapse/flat",
    "collapse/diversity",
    "collapse/teacher_saturation",
    "collapse/teacher_flat",
    "collapse/teacher_diversity",
    "collapse/diversity_ratio",
    "collapse/collapsed",
}


class MetricsTracker(NullTracker):
    """A tracker that keeps what the hook logs."""

    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log(self, metrics, step) -> None:
        self.logged.append((step, dict(metrics)))


@pytest.fixture(scope="module")
def world(tiny_path, cache_dir):
    """The tiny teacher on the CPU, a 2-step trajectory run's composed config and the teacher's own transformer as
    a student (the teacher itself), built once."""
    overrides = [
        f"paths.cache_dir={cache_dir}",
        "paths.output_dir=unused",
        "precision=fp32",
        "method=trajectory",
        "method.steps=2",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("train", overrides=overrides)
    spec = inspect_teacher(tiny_path)
    teacher = load_teacher(spec, cfg.teacher, torch.float32, torch.device("cpu"))
    calls = []  # the teacher's forwards, as they happen
    teacher.experts[0].register_forward_pre_hook(lambda module, args: calls.append(1))
    itself = Student(load_expert(spec, "transformer", torch.float32))
    return SimpleNamespace(cfg=cfg, spec=spec, teacher=teacher, calls=calls, itself=itself)


def watched(world, tmp_path, student, student_steps=2, method=None, schedule=None, **settings) -> SimpleNamespace:
    """A CollapseWatch bound to a one-process CPU run of `student` (K = `student_steps`; None: a KD student; trained
    on `schedule`'s sigmas, default diffusers' Euler)."""
    cfg, topo, placement = world.cfg, Topology(), CpuPlacement()
    ctx = RunContext(
        teacher_cfg=cfg.teacher,
        data_cfg=cfg.data,
        trainer_cfg=cfg.trainer,
        student_cfg=cfg.student,
        seed=0,
        cache_dir=str(cfg.paths.cache_dir),
        spec=world.spec,
        placement=placement,
        topo=topo,
        roles=roles_for(placement.serving, topo),
        precision=FP32,
        device=torch.device("cpu"),
        run_dir=tmp_path,
        teacher_path=str(world.spec.path),
        student_steps=student_steps,
        student_schedule=schedule,
    )
    hook = CollapseWatch(**{"every": 2, "prompts": 2, "teacher_steps": 2} | settings)
    hook.bind(ctx, HookParts())
    return SimpleNamespace(
        hook=hook,
        student=student,
        targets=LocalTargets(world.teacher),
        tracker=MetricsTracker(),
        run_dir=tmp_path,
        method=method,
    )


def collapsed_copy(student: Student) -> Student:
    """The student made to predict one constant velocity: its output head's weights zeroed, its bias set high. Every
    noise then lands on (nearly) the same far-off latent: the decoded images are near-identical."""
    broken = copy.deepcopy(student)
    with torch.no_grad():
        broken.transformer.proj_out.weight.zero_()
        broken.transformer.proj_out.bias.fill_(50.0)
    return broken


def test_the_teacher_itself_is_watched_every_n_steps_against_a_reference_drawn_once(world, tmp_path, caplog):
    run = watched(world, tmp_path, world.itself)
    world.calls.clear()
    with caplog.at_level(logging.INFO, logger="wandistiller"):
        run.hook(run, 1)
        assert run.tracker.logged == [] and world.calls == []  # not a check: nothing sampled
        run.hook(run, 2)
        teacher_calls = len(world.calls)
        run.hook(run, 3)
        run.hook(run, 4)
    assert teacher_calls > 0 and len(world.calls) == teacher_calls  # the reference is drawn at the first check only
    (two, first), (four, second) = run.tracker.logged
    assert (two, four) == (2, 4) and set(first) == FIGURES
    assert first == second  # the same probe (prompts and noises) at every check: the same student, the same figures
    assert 0.8 < first["collapse/diversity_ratio"] < 1.25 and first["collapse/collapsed"] == 0.0
    assert [{"step": 2} | first, {"step": 4} | second] == metrics_steps(tmp_path)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "hooks.collapse: the teacher draws its reference (4 images, 2 steps), once for the run" in caplog.text
    assert (
        "step 4: hooks.collapse: diversity 0.9" in caplog.text or "step 4: hooks.collapse: diversity 1.0" in caplog.text
    )


def test_a_collapsed_student_is_said_in_one_line_once_per_episode(world, tmp_path, caplog):
    healthy, broken = world.itself, collapsed_copy(world.itself)
    run = watched(world, tmp_path, broken, method=SimpleNamespace(regression_weight=0.0))
    with caplog.at_level(logging.WARNING, logger="wandistiller"):
        run.hook(run, 2)
        run.hook(run, 4)  # still collapsed: no second line
        run.student = healthy
        run.hook(run, 6)
        run.student = broken
        run.hook(run, 8)  # a new episode
    flags = [(step, m["collapse/collapsed"]) for step, m in run.tracker.logged]
    assert flags == [(2, 1.0), (4, 1.0), (6, 0.0), (8, 1.0)]
    assert run.tracker.logged[0][1]["collapse/diversity_ratio"] < 0.5
    first, second = (r.getMessage() for r in caplog.records)
    assert "\n" not in first and first.startswith(
        "step 2: the student's samples look collapsed (hooks.collapse): diversity 0."
    )
    assert "x the teacher's (under hooks.collapse.min_diversity=0.5)" in first
    assert "a lower trainer.optimizer.lr (now 0.001)" in first
    assert "a regression term (method.regression_weight=0.1)" in first and "no check has looked healthy yet" in first
    assert second.startswith("step 8: ") and "fewer steps since step 6, the last check that looked healthy" in second


def test_a_kd_student_is_watched_only_when_asked(world, tmp_path):
    world.calls.clear()
    (tmp_path / "kd").mkdir(), (tmp_path / "asked").mkdir()
    quiet = watched(world, tmp_path / "kd", world.itself, student_steps=None)
    quiet.hook(quiet, 2)
    assert quiet.hook.probe is None and quiet.tracker.logged == [] and world.calls == []
    assert not (tmp_path / "kd" / "metrics_steps.jsonl").exists()
    asked = watched(world, tmp_path / "asked", world.itself, student_steps=None, steps=2)
    asked.hook(asked, 2)
    assert [step for step, _ in asked.tracker.logged] == [2] and world.calls
    # Bounded by the teacher's training timesteps before anything is drawn: a received 10**9 is one line.
    with pytest.raises(UserError, match=r"^hooks.collapse.teacher_steps=1000000000 is more than this teacher's \d+"):
        watched(world, tmp_path / "asked", world.itself, teacher_steps=10**9)


def test_a_student_trained_at_explicit_sigmas_is_watched_on_them_and_at_no_other_count(world, tmp_path):
    from wandistiller.teacher.fewstep import Schedule

    schedule = Schedule("list", None, (1.0, 0.4))
    with pytest.raises(UserError, match=r"^hooks.collapse.steps=3: the student was trained at 2 explicit sigmas"):
        watched(world, tmp_path, world.itself, schedule=schedule, steps=3)
    watch = watched(world, tmp_path, world.itself, schedule=schedule)
    scheduler = watch.hook.student_scheduler(watch.hook.ctx)
    scheduler.set_timesteps(2)
    assert scheduler.sigmas.tolist() == pytest.approx([1.0, 0.4, 0.0])


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("every", -1, "hooks.collapse.every=-1 must be 0 or more"),
        ("noises", 1, "hooks.collapse.noises=1 must be at least 2"),
        ("steps", 0, "hooks.collapse.steps=0 must be at least 1"),
        ("teacher_steps", 0, "hooks.collapse.teacher_steps=0 must be at least 1"),
        ("min_diversity", float("nan"), "hooks.collapse.min_diversity=nan must be 0 or more"),
        ("max_saturation_rise", 1.5, "hooks.collapse.max_saturation_rise=1.5 must be a share between 0 and 1"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_key(key, value, words):
    with refused(words):
        CollapseWatch(**{key: value})


FEW_STEP_RUN = [
    "logger=none",
    "precision=fp32",
    "trainer.progress_bar=false",
    "method=trajectory",
    "method.steps=2",
    "method.teacher_steps=2",
    "method.noises_per_prompt=1",
    "trainer.max_steps=4",
    "hooks.samples.prompts=0",
    "~hooks.evaluate",
    "hooks.collapse.every=2",
    "hooks.collapse.teacher_steps=2",
]


@pytest.mark.slow
def test_a_few_step_cli_run_logs_the_watch_into_metrics_steps(tmp_path, cache_dir, tiny_path):
    run_dir = tmp_path / "r"
    done = run_cli(f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache_dir}", *FEW_STEP_RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in metrics_steps(run_dir) if "collapse/diversity_ratio" in r]
    assert [r["step"] for r in rows] == [2, 4] and all(set(r) == FIGURES | {"step"} for r in rows)
    assert all(r["collapse/collapsed"] == 0.0 for r in rows)
    assert "step 4: hooks.collapse: diversity" in Path(run_dir / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("placement", "teacher_figures"),
    [("teacher_placement=sharded", True), ("teacher_placement=gpu0 teacher_placement.debug_cpu=true", False)],
    ids=["sharded", "dedicated-owner"],
)
def test_two_ranks_watch_on_the_main_rank(tmp_path, cache_dir, tiny_path, placement, teacher_figures):
    """A sharded teacher (collective forwards) draws its reference with both ranks; a dedicated owner's main rank,
    which holds no teacher, logs the student's figures alone."""
    run_dir = tmp_path / "r"
    done = run_cli(
        f"hydra.run.dir={run_dir}",
        f"paths.cache_dir={cache_dir}",
        "distributed.nproc_per_node=2",
        *placement.split(),
        *FEW_STEP_RUN,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in metrics_steps(run_dir) if "collapse/diversity" in r]
    assert [r["step"] for r in rows] == [2, 4]
    assert all(("collapse/diversity_ratio" in r) == teacher_figures for r in rows)


def test_a_bad_setting_on_the_command_line_is_refused_before_the_run_folder(make_cfg, tmp_path):
    from wandistiller.train import run

    with refused("hooks.collapse.noises=1 must be at least 2"):
        run(make_cfg("hooks=[collapse]", "hooks.collapse.noises=1", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_a_lora_student_is_watched_with_its_adapters_on(world, tmp_path):
    """A LoRA student (the placed teacher plus adapters) has no transformer of its own: the probe runs the teacher's
    experts with its adapters switched on, so adapters that change the teacher change the figures."""
    from wandistiller.teacher.lora import AdaptedTeacher

    lora = AdaptedTeacher(world.teacher, rank=2, dtype=torch.float32, seed=0)
    (tmp_path / "zero").mkdir()
    (tmp_path / "moved").mkdir()
    first = watched(world, tmp_path / "zero", lora)
    first.hook(first, 2)  # B at zero: the student is the teacher without CFG
    with torch.no_grad():
        for adapters in lora.adapters:
            for up in adapters.up.values():
                up.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    second = watched(world, tmp_path / "moved", lora)
    second.hook(second, 2)
    [(_, at_zero)], [(_, moved)] = first.tracker.logged, second.tracker.logged
    assert at_zero["collapse/diversity"] != moved["collapse/diversity"]  # the adapters were on while it sampled
    assert not any(a.on for a in lora.adapters)  # and off again after


@pytest.fixture(scope="module")
def clip_world(world):
    """The same tiny teacher and student, on clips: data.latent_frames=2 (5 frames through its 4x temporal VAE)."""
    cfg = copy.deepcopy(world.cfg)
    cfg.data.latent_frames = 2
    return SimpleNamespace(**vars(world) | {"cfg": cfg})


@pytest.mark.slow  # ~10 s: the tiny teacher's clips decoded at every check
def test_a_clip_run_logs_its_motion_beside_the_teachers_and_a_moving_student_is_silent(clip_world, tmp_path, caplog):
    run = watched(clip_world, tmp_path, clip_world.itself, method=SimpleNamespace(regression_weight=0.0))
    with caplog.at_level(logging.WARNING, logger="wandistiller"):
        run.hook(run, 2)  # the teacher's own transformer: it moves as the teacher does
        run.hook(run, 4)
    for _, logged in run.tracker.logged:
        assert set(logged) == FIGURES | {"collapse/motion", "collapse/teacher_motion", "collapse/motion_ratio",
                                         "collapse/still"}  # fmt: skip
        assert logged["collapse/teacher_motion"] > 0 and logged["collapse/motion_ratio"] > 0.7
        assert logged["collapse/still"] == 0.0
    assert not [r for r in caplog.records if "lose their motion" in r.getMessage()]


def test_pocket_clips_that_keep_their_frames_but_stop_moving_are_said_once_and_moving_ones_never(tmp_path, caplog):
    from wandistiller.evaluation.collapse import figures
    from wandistiller.pocket.clips import rendered_clip_split

    clips, _, prompts = rendered_clip_split("heldout", seed=1)
    moving, prompts = clips[:8], prompts[:8]
    frozen = moving[:, 8:9].expand_as(moving).contiguous()  # each clip held at its middle frame: the digit right
    hook = CollapseWatch(min_motion=0.7)
    hook.ctx = SimpleNamespace(trainer_cfg={"optimizer": {"lr": 1e-4}})
    hook.reference = figures(moving, prompts)
    run = SimpleNamespace(tracker=MetricsTracker(), run_dir=tmp_path, method=SimpleNamespace(regression_weight=0.1))
    with caplog.at_level(logging.WARNING, logger="wandistiller"):
        assert hook.judged(run, 1, figures(moving, prompts))["collapse/motion_ratio"] == 1.0
        assert hook.judged(run, 2, figures(frozen, prompts))["collapse/motion_ratio"] < 0.1
        hook.judged(run, 3, figures(frozen, prompts))
    (line,) = [r.getMessage() for r in caplog.records]  # the motion line alone: the frames themselves look fine
    assert line.startswith("step 2: the student's clips lose their motion (hooks.collapse): motion 0.0")
    assert "a larger method.regression_weight (now 0.1)" in line and "a lower trainer.optimizer.lr (now 0.0001)" in line


@pytest.mark.slow  # a training run of a tiny I2V teacher (~15 s)
@pytest.mark.parametrize("teacher", ["tiny_i2v", "tiny_i2v_moe"])
def test_an_image_to_video_run_is_watched_on_its_held_out_images(make_cfg, tmp_path, teacher):
    """The probe of an I2V run (Wan 2.1's CLIP layout, and A14B's pair) is drawn through the model's own
    WanImageToVideoPipeline on the held-out images' cached conditioning: its experts took the noise alone before,
    an internal error at the first check."""
    from tests.data.sources.test_images import given_images
    from wandistiller.train import run

    root, folder = given_images(tmp_path / "images", size=(40, 32)), tmp_path / "run"
    small = ["data.latent_frames=2", "data.latent_height=4", "data.latent_width=4", "trainer.max_steps=2"]
    watch = [
        "method=dmd",
        "method.steps=2",
        "hooks=[monitor,collapse]",
        "hooks.collapse.every=2",
        "hooks.collapse.prompts=1",
    ]
    run(make_cfg(f"teacher={teacher}", "data=image_folder", f"data.root={root}", *small, *watch, run_dir=folder))
    rows = [r for r in metrics_steps(folder) if "collapse/saturation" in r]
    assert [r["step"] for r in rows] == [2] and "collapse/teacher_motion" in rows[0]
