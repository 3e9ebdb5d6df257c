"""The loop and what a user swaps through `_target_`: the loss, the student builder, the recipe."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import FP32, cli, fresh_runs
from wandistiller.core.distributed import Topology
from wandistiller.data.prompts import PromptEmbeddings, batch_source
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.recipe.distillation import DistillationRecipe
from wandistiller.recipe.loop import Run, distillation_loss, train_loop
from wandistiller.recipe.losses import Distillation
from wandistiller.recipe.targets import LocalTargets
from wandistiller.state.checkpoint import list_checkpoints, load_checkpoint
from wandistiller.student.model import build_student
from wandistiller.teacher.model import inspect_teacher
from wandistiller.tracking.loggers import NullTracker
from wandistiller.train import run

CALLS: list[str] = []


def doubled_loss(pred, target, student_hidden, teacher_hidden, hidden_kd_weight: float = 0.0):
    """A user's loss: twice the velocity MSE (what trainer.loss._target_ may name)."""
    loss, velocity, hidden = distillation_loss(pred, target, student_hidden, teacher_hidden, hidden_kd_weight)
    CALLS.append("loss")
    return 2 * loss, velocity, hidden


def counted_student(spec, dtype=torch.float32, **student_keys):
    """A user's student builder (what student._target_ may name)."""
    CALLS.append("student")
    return build_student(spec, dtype, **student_keys)


class CountingRecipe(DistillationRecipe):
    """A user's recipe (what recipe._target_ may name): one setup step replaced."""

    def _setup_tracker(self, state):
        CALLS.append("tracker")
        return super()._setup_tracker(state)


def test_the_distillation_loss_is_velocity_mse_plus_weighted_hidden_mse():
    pred, target = torch.ones(2, 3), torch.zeros(2, 3)
    hs, ht = torch.ones(2, 4), torch.full((2, 4), 3.0)
    loss, velocity, hidden = distillation_loss(pred, target, hs, ht, hidden_kd_weight=0.5)
    assert velocity == 1.0 and hidden == 4.0 and loss == 3.0
    loss, _, hidden = distillation_loss(pred, target, None, None)
    assert loss == 1.0 and hidden == 0.0


def test_loss_student_and_recipe_are_swapped_through_their_targets(make_cfg, tmp_path):
    CALLS.clear()
    cfg = make_cfg(
        "trainer.max_steps=2",
        f"trainer.loss._target_={__name__}.doubled_loss",
        f"student._target_={__name__}.counted_student",
        f"recipe._target_={__name__}.CountingRecipe",
        run_dir=tmp_path / "r",
    )
    summary = run(cfg)
    assert summary["steps_run"] == 2
    assert CALLS.count("student") == 1 and CALLS.count("tracker") == 1 and CALLS.count("loss") == 2


@pytest.fixture(scope="module", autouse=True)  # autouse: it starts with the module, beside its in-process tests
def clis(request, tmp_path_factory, cache_dir):
    """This module's command-line run (a fresh process) and its folder, started with the module."""
    tmp_path = tmp_path_factory.mktemp("cli")
    args = cli(f"hydra.run.dir={tmp_path / 'r'}", f"paths.cache_dir={cache_dir}", "logger=none",
               "recipe._target_=nowhere.Recipe")  # fmt: skip
    return tmp_path, fresh_runs(request, {"nowhere": ("test_a_target_that_does_not_exist_is_one_line", args)})


def test_a_target_that_does_not_exist_is_one_line(clis):
    tmp_path, runs = clis
    result = runs["nowhere"].result()
    assert result.returncode == 2 and "Traceback" not in result.stderr and "recipe._target_" in result.stderr
    assert not (tmp_path / "r").exists()  # refused before the run folder is claimed


KEYS = {"step", "loss", "loss_velocity", "loss_hidden", "grad_norm", "lr", "samples_per_s", "step_ms"}
KEYS |= {"teacher_ms", "student_ms", "host_peak_rss_gib"}


def steps(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics_steps.jsonl").read_text().splitlines()]


def test_logging_every_few_steps_keeps_every_steps_metrics_and_values(make_cfg, tmp_path):
    # The loop reads its numbers from the device only when it logs: grouped steps equal per-step ones.
    common = ["trainer.max_steps=5", "trainer.checkpoint_every=2", "trainer.batch_size=2"]
    run(make_cfg(*common, "trainer.log_every=1", run_dir=tmp_path / "each"))
    run(make_cfg(*common, "trainer.log_every=3", run_dir=tmp_path / "grouped"))
    each, grouped = steps(tmp_path / "each"), steps(tmp_path / "grouped")
    assert [s["step"] for s in grouped] == [1, 2, 3, 4, 5]
    assert all(KEYS <= set(s) for s in grouped)
    assert all(s["step_ms"] > s["teacher_ms"] > 0 and s["samples_per_s"] > 0 for s in grouped)
    for key in ("loss", "loss_velocity", "loss_hidden", "grad_norm", "lr"):
        assert [s[key] for s in grouped] == [s[key] for s in each], key


class RecordingTracker(NullTracker):
    """A tracker that keeps what the loop gives it (the interface every logger implements)."""

    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log(self, metrics: dict, step: int) -> None:
        self.logged.append((step, dict(metrics)))


def toy_run(spec, teacher, run_dir, hidden_kd_weight: float) -> Run:
    """A run of the real loop parts at toy size, built in the test: the tiny teacher, a random tiny
    student, four prompts of random text states, a constant learning rate, no tracker but a recording one."""
    torch.manual_seed(0)
    student = build_student(spec, builder="tiny", init="random", hidden_kd_weight=hidden_kd_weight)
    g = torch.Generator().manual_seed(0)
    text = [torch.randn(n, 32, generator=g) for n in (3, 5, 7, 9)]
    embeddings = PromptEmbeddings(["a", "b", "c", "d"], text, torch.zeros(0, 32), 512)
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    return Run(
        model=student,
        targets=LocalTargets(teacher),
        batch_fn=batch_source(0, 2, (16, 1, 8, 8), 3.0, 1000, embeddings),
        optimizer=optimizer,
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        ema=None,
        tracker=RecordingTracker(),
        precision=FP32,
        device=torch.device("cpu"),
        run_dir=run_dir,
        loss_fn=Distillation(hidden_kd_weight),
    )


def test_the_loop_lowers_the_loss_logs_each_part_and_checkpoints_its_last_step(tiny_path, tmp_path):
    """The loop in-process at toy size: no config, no CLI, no launcher -- well under a second."""
    spec = inspect_teacher(tiny_path)
    guidance = OmegaConf.create({"guidance_scale": 5.0, "guidance_scale_2": None})
    teacher = CpuPlacement().load(spec, guidance, FP32, Topology())
    run = toy_run(spec, teacher, tmp_path, hidden_kd_weight=0.5)
    seen = []
    run.hooks.append(lambda r, step: seen.append(step))
    trainer = {"grad_accum_steps": 1, "batch_size": 2, "max_steps": 12, "max_grad_norm": 1.0, "progress_bar": False}
    trainer = OmegaConf.create(trainer | {"checkpoint_every": 6, "log_every": 4, "keep_checkpoints": 1})
    history = train_loop(run, trainer, 0.5, start_step=0)

    assert [h["step"] for h in history] == list(range(1, 13)) and seen == list(range(1, 13))
    for h in history:  # every part the loss returned, logged; the trained loss is their weighted sum
        assert abs(h["loss"] - (h["loss_velocity"] + 0.5 * h["loss_hidden"])) < 1e-5 * h["loss"]
        assert h["loss_hidden"] > 0 and h["grad_norm"] > 0 and h["lr"] == 3e-3
    velocity = [h["loss_velocity"] for h in history]
    assert sum(velocity[-3:]) < 0.8 * sum(velocity[:3]), velocity
    # The tracker gets every log_every-th step, with the loop's own numbers.
    assert [(step, m["loss"]) for step, m in run.tracker.logged] == [(s, history[s - 1]["loss"]) for s in (4, 8, 12)]
    # One checkpoint kept, the last step's, holding the student as it ended.
    (kept,) = list_checkpoints(tmp_path)
    saved = load_checkpoint(kept)
    assert saved["step"] == 12
    assert all(torch.equal(saved["student"][k], v) for k, v in run.student.state_dict().items())
