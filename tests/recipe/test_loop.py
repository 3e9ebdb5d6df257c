"""wandistiller/recipe/loop.py: the old-shape loss on fixed tensors, the loop in-process at toy size (loss, logged
parts, checkpoints), grouped logging and the non-finite stop in real runs; and the values refused before a run
could go non-finite."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import FP32, metrics_steps, old_shape_loss
from wandistiller.core.distributed import Topology
from wandistiller.core.errors import UserError
from wandistiller.data.batches import BatchSettings, batch_source
from wandistiller.data.prompts import PromptEmbeddings
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.recipe.loop import (
    Clock,
    Run,
    _materialize,
    _Pending,
    _stop_if_not_finite,
    distill_step,
    train_loop,
)
from wandistiller.recipe.losses import Needs, as_loss
from wandistiller.recipe.losses.distillation import Distillation
from wandistiller.recipe.targets import LocalTargets
from wandistiller.state.checkpoint import list_checkpoints, load_checkpoint
from wandistiller.student.model import build_student
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.tracking.loggers import NullTracker
from wandistiller.train import run


def test_an_old_shape_loss_gets_the_last_blocks_when_its_bound_weight_asks():
    from functools import partial

    from wandistiller.recipe.losses.base import LAST

    assert as_loss(partial(old_shape_loss, hidden_kd_weight=0.5)).needs.teacher_hidden == LAST
    assert as_loss(old_shape_loss).needs.teacher_hidden == () and as_loss(None).needs.teacher


KEYS = {"step", "loss", "loss_velocity", "loss_hidden", "grad_norm", "lr", "samples_per_s", "step_ms"}
KEYS |= {"teacher_ms", "student_ms", "host_peak_rss_gib"}


def test_logging_every_few_steps_keeps_every_steps_metrics_and_values(make_cfg, tmp_path):
    # The loop reads its numbers from the device only when it logs: grouped steps equal per-step ones.
    common = ["trainer.max_steps=5", "trainer.checkpoint_every=2", "trainer.batch_size=2"]
    run(make_cfg(*common, "trainer.log_every=1", run_dir=tmp_path / "each"))
    run(make_cfg(*common, "trainer.log_every=3", run_dir=tmp_path / "grouped"))
    each, grouped = metrics_steps(tmp_path / "each"), metrics_steps(tmp_path / "grouped")
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


def toy_run(spec, teacher, run_dir, hidden_kd_weight: float, latent_shape=(16, 1, 8, 8)) -> Run:
    """A run of the real loop parts at toy size, built in the test: the tiny teacher, a random tiny
    student, four prompts of random text states, a constant learning rate, no tracker but a recording one."""
    torch.manual_seed(0)
    hidden = (-1,) if hidden_kd_weight > 0 else ()
    student = build_student(spec, builder="tiny", init="random", hidden_layers=hidden)
    g = torch.Generator().manual_seed(0)
    text = [torch.randn(n, 32, generator=g) for n in (3, 5, 7, 9)]
    embeddings = PromptEmbeddings(["a", "b", "c", "d"], text, torch.zeros(0, 32), 512)
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    return Run(
        model=student,
        targets=LocalTargets(teacher),
        batch_fn=batch_source(BatchSettings(0, 2, latent_shape, 3.0, 1000, embeddings)),
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
    history = train_loop(run, trainer, start_step=0)

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


CALLS: list[int] = []


def nan_from_third_call(pred, target, student_hidden, teacher_hidden, hidden_kd_weight: float = 0.0):
    """The shipped loss, turned NaN from its third call on (what an overflowing loss term does)."""
    loss, velocity, hidden = old_shape_loss(pred, target, student_hidden, teacher_hidden, hidden_kd_weight)
    CALLS.append(1)
    return (loss * float("nan") if len(CALLS) >= 3 else loss), velocity, hidden


def test_a_nan_loss_stops_at_its_step_and_keeps_the_last_good_checkpoint(make_cfg, tmp_path):
    CALLS.clear()
    folder = tmp_path / "run"
    cfg = make_cfg("trainer.max_steps=5", "trainer.checkpoint_every=1", "trainer.log_every=2",
                   f"trainer.loss._target_={__name__}.nan_from_third_call", run_dir=folder)  # fmt: skip
    with pytest.raises(UserError, match=r"non-finite at step 3 \(loss nan.*the last good checkpoint is step_00000002"):
        run(cfg)
    assert [p.name for p in list_checkpoints(folder)] == ["step_00000001", "step_00000002"]
    assert not (folder / "metrics.json").exists() and not (folder / "student").exists()  # never "completed"


def test_a_logged_steps_times_and_throughput_come_from_its_clock_marks():
    # On a CPU the clock's marks are perf_counter seconds: spans given by hand give known milliseconds.
    sums = {"loss": torch.tensor(0.5), "loss_task": torch.tensor(0.25)}
    pending = [_Pending(7, sums, torch.tensor(2.0), (10.0, 10.5), [(10.0, 10.1), (10.2, 10.3)], 1e-4, None),
               _Pending(8, sums, torch.tensor(3.0), (11.0, 11.25), [], 1e-4, 40.0)]  # fmt: skip
    first, second = _materialize(pending, Clock(torch.device("cpu")), samples_per_step=4, group=None)
    assert (first["step"], first["loss"], first["loss_task"], first["grad_norm"]) == (7, 0.5, 0.25, 2.0)
    assert first["step_ms"] == pytest.approx(500) and first["teacher_ms"] == pytest.approx(200)
    assert first["student_ms"] == pytest.approx(300) and first["samples_per_s"] == pytest.approx(8)
    assert "copy_ms" not in first and second["copy_ms"] == 40.0 and second["samples_per_s"] == pytest.approx(16)
    assert first["host_peak_rss_gib"] > 0


def test_an_infinite_gradient_under_a_grad_scaler_is_a_skipped_step_not_a_stop(tmp_path):
    entry = {"step": 3, "loss": 0.5, "grad_norm": float("inf"), "lr": 1e-4}
    scaled = SimpleNamespace(scaler=torch.amp.GradScaler("cpu", enabled=True), run_dir=tmp_path)
    _stop_if_not_finite(scaled, [entry])  # fp16's routine overflow: the scaler skips the step
    unscaled = SimpleNamespace(scaler=torch.amp.GradScaler("cpu", enabled=False), run_dir=tmp_path)
    with pytest.raises(UserError, match=r"non-finite at step 3 \(loss 0.5, grad norm inf.*no checkpoint was saved"):
        _stop_if_not_finite(unscaled, [entry])
    with pytest.raises(UserError, match="non-finite at step 3"):  # a NaN loss stops even under a scaler
        _stop_if_not_finite(scaled, [entry | {"loss": float("nan")}])


class TwoLayerKD:
    """A loss of a user's own that declares hidden states after two teacher blocks, and nothing else."""

    needs = Needs(teacher=True, teacher_hidden=(0, -1), student_hidden=(0, -1))

    def __call__(self, inputs):
        from wandistiller.recipe.losses.base import hidden_mse, velocity_mse

        return {"velocity": velocity_mse(inputs), "first": hidden_mse(inputs, 0), "last": hidden_mse(inputs, 1)}


def test_a_loss_that_declares_hidden_states_gets_them_with_no_other_setting(make_cfg, tmp_path):
    cfg = make_cfg("trainer.max_steps=2", "trainer.log_every=1", run_dir=tmp_path / "r")
    cfg.trainer.loss = OmegaConf.create({"_target_": f"{__name__}.TwoLayerKD"})
    run(cfg)
    rows = metrics_steps(tmp_path / "r")
    assert all(r["loss_first"] > 0 and r["loss_last"] > 0 and "loss_hidden" not in r for r in rows)
    assert rows[0]["loss_first"] != rows[0]["loss_last"]  # two blocks, each with its own projection
    state = load_checkpoint(list_checkpoints(tmp_path / "r")[-1])["student"]
    assert {k for k in state if k.startswith("hidden_proj.")} == {
        f"hidden_proj.{i}.{p}" for i in (0, 1) for p in ("weight", "bias")
    }


def test_ti2v_s_given_first_frame_does_not_count_in_the_loss_and_an_i2v_models_first_frame_does(
    tiny_ti2v_path, tiny_i2v_path
):
    """TI2V replaces the first latent frame with the image's and runs it at timestep 0: no prediction of its own,
    so kd's loss (and validation's) covers the frames after it, as Wan 2.2's TI2V training masks it. An I2V
    model (mask and image latents beside the noise) predicts every frame: all of them count."""
    import torch.nn.functional as F

    from wandistiller.data.batches import Batch
    from wandistiller.teacher.image import ImageCondition

    for path, given in ((tiny_ti2v_path, 1), (tiny_i2v_path, 0)):
        spec = inspect_teacher(path)
        guidance = OmegaConf.create({"guidance_scale": 1.0, "guidance_scale_2": None})
        teacher = CpuPlacement().load(spec, guidance, FP32, Topology())
        torch.manual_seed(0)
        student = build_student(spec, builder="half", init="random")
        g, c = torch.Generator().manual_seed(0), spec.latent_channels
        latents = torch.randn(2, c, 1, 4, 4, generator=g) if given else torch.randn(2, 4 + c, 3, 4, 4, generator=g)
        embeds = torch.randn(2, 5, 24, generator=g) if spec.image_encoder else None
        image = ImageCondition(latents, embeds)
        batch = Batch(torch.zeros(2, dtype=torch.long), torch.randn(2, c, 3, 4, 4, generator=g),
                      torch.tensor([900.0, 300.0]), torch.randn(2, 512, 32, generator=g), torch.zeros(2, 512, 32),
                      image=image)  # fmt: skip
        run_ = Run(model=student, targets=LocalTargets(teacher), batch_fn=None, optimizer=None, lr_scheduler=None,
                   scaler=None, ema=None, tracker=NullTracker(), precision=FP32, device=torch.device("cpu"),
                   run_dir=None, loss_fn=Distillation(0.0))  # fmt: skip
        with torch.no_grad():
            loss, _, _ = distill_step(run_, 0, 0, batch)
            pred = student(batch.x_t, batch.t, batch.cond, image)[0]
            target = teacher.targets(batch.x_t, batch.t, batch.cond, batch.uncond, (), image)[0]
        torch.testing.assert_close(loss, F.mse_loss(pred[:, :, given:], target[:, :, given:]), rtol=1e-6, atol=0)
