"""wandistiller/recipe/outputs.py: the run's summary computed directly from tiny metrics lists and a RunContext of
the tiny teacher (medians, peaks, the steps of a resumed run, validation), and a resumed run's summary in a real
run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import FP32, metrics_steps
from wandistiller.core.distributed import Topology, roles_for
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.recipe.context import RunContext
from wandistiller.recipe.hooks.base import Hook
from wandistiller.recipe.outputs import millions, summarize, validation_summary, whole_run
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.train import run


def test_metrics_are_written_as_they_happen_and_summarised_over_a_resumed_run(make_cfg, tmp_path):
    run_dir = tmp_path / "r"
    first = run(make_cfg("trainer.max_steps=2", "trainer.checkpoint_every=1", run_dir=run_dir))
    assert [r["step"] for r in metrics_steps(run_dir)] == [1, 2]
    (run_dir / "metrics.json").unlink()  # as if stopped before the end: the step rows are there already
    (run_dir / "student").rename(tmp_path / "student_first")
    summary = run(make_cfg("trainer.max_steps=4", "trainer.resume=auto", run_dir=run_dir))
    assert summary["steps_run"] == 4 and summary["loss_first"] == first["loss_first"] and summary["final_step"] == 4


def step(n: int, loss: float, **more) -> dict:
    return {"step": n, "loss": loss} | more


def test_a_resume_without_the_end_of_run_hooks_leaves_no_grid_of_the_student_it_replaced(make_cfg, tmp_path):
    # An audit's: `~hooks.evaluate hooks.samples.prompts=0` on a resume left step 2's samples.png (and eval.json,
    # which names no step) beside step 3's student.
    run_dir = tmp_path / "r"
    drawn = ("hooks=[monitor,progress,samples]", "hooks.samples.prompts=1", "hooks.samples.steps=2")
    run(make_cfg("trainer.max_steps=2", "trainer.checkpoint_every=1", *drawn, run_dir=run_dir))
    assert (run_dir / "samples.png").is_file()
    (run_dir / "eval.json").write_text("{}")  # as `eval RUN` leaves it
    run(make_cfg("trainer.max_steps=3", "trainer.resume=auto", "hooks=[monitor,progress]", run_dir=run_dir))
    assert not (run_dir / "samples.png").exists() and not (run_dir / "eval.json").exists()
    run(make_cfg("trainer.max_steps=4", "trainer.resume=auto", *drawn, run_dir=run_dir))
    assert (run_dir / "samples.png").is_file()  # the hook that runs writes the new student's


def test_the_files_judging_the_final_student_are_told_from_a_checkpoints():
    from wandistiller.recipe.outputs import of_the_final_student

    ours = ["eval.json", "eval.png", "eval.gif", "samples.png", "eval_steps20.json", "eval_student1_limit1.png"]
    others = ["eval_best.json", "eval_step_00000050.png", "eval_best_steps20.json", "metrics.json", "loss.png", "x.txt"]
    assert [of_the_final_student(n) for n in ours + others] == [True] * len(ours) + [False] * len(others)


def test_the_whole_run_is_every_steps_last_record_up_to_this_segments_last_step():
    recorded = [step(1, 0.9), step(2, 0.8), step(3, 0.7), {"step": 2, "val/loss": 0.5}, step(4, 0.6)]
    # Resumed from step 2's checkpoint: steps 3 and 4 measured by the killed segment, step 3 redone, 4 not yet.
    recorded += [step(3, 0.65)]
    this_segment = [step(3, 0.65)]
    assert whole_run(recorded, this_segment) == [step(1, 0.9), step(2, 0.8), step(3, 0.65)]
    assert whole_run([], this_segment) == this_segment  # nothing recorded (no monitor): this segment's own
    assert whole_run(recorded, []) == [step(1, 0.9), step(2, 0.8), step(3, 0.65), step(4, 0.6)]


def test_the_validation_summary_is_the_last_and_the_best_held_out_loss():
    recorded = [step(1, 0.9), {"step": 2, "val/loss": 0.4}, {"step": 4, "val/loss": 0.3}, {"step": 6, "val/loss": 0.35}]
    assert validation_summary(recorded) == {"val_loss_last": 0.35, "val_loss_best": 0.3}
    assert validation_summary([step(1, 0.9)]) == {}


@pytest.fixture
def context(tiny_path, tmp_path) -> RunContext:
    """A RunContext of one process holding the tiny teacher on the CPU, trainer keys set by hand."""
    trainer = OmegaConf.create({"batch_size": 2, "grad_accum_steps": 3})
    topo, placement = Topology(), CpuPlacement()
    return RunContext(
        teacher_cfg=OmegaConf.create({"path": "tiny", "name": "tiny"}), data_cfg=None, trainer_cfg=trainer,
        student_cfg=None, seed=0, cache_dir=str(tmp_path), spec=inspect_teacher(tiny_path), placement=placement,
        topo=topo, roles=roles_for(placement.serving, topo), precision=FP32, device=torch.device("cpu"),
        run_dir=tmp_path, teacher_path=str(tiny_path), overrides=["trainer.max_steps=3"],
    )  # fmt: skip


def test_the_summary_takes_medians_past_the_warm_up_step_and_the_peaks_of_every_step(context, tiny_path):
    history = [
        step(1, 0.9, step_ms=1000.0, teacher_ms=600.0, samples_per_s=1.0, host_peak_rss_gib=1.5),
        step(2, 0.8, step_ms=10.0, teacher_ms=6.0, samples_per_s=10.0, host_peak_rss_gib=2.5),
        step(3, 0.7, step_ms=30.0, teacher_ms=8.0, samples_per_s=30.0, host_peak_rss_gib=2.0),
    ]
    ranks = [{"rank": 0, "role": "owner + student"}, {"rank": 1, "role": "student"},
             {"rank": 2, "role": "teacher owner", "owner_idle_fraction": 0.25}]  # fmt: skip
    student = torch.nn.Linear(10, 100)  # 1,100 parameters
    dmd = SimpleNamespace(name="dmd", steps=4)  # the built method: its name and K
    summary = summarize(context, SimpleNamespace(student=student, method=dmd), history, ranks, segment=history[1:])
    assert summary["status"] == "completed" and summary["student_params_m"] == millions(student) == 0.0011
    assert (summary["steps_run"], summary["steps_this_segment"], summary["final_step"]) == (3, 2, 3)
    assert (summary["loss_first"], summary["loss_last"]) == (0.9, 0.7)
    assert summary["step_ms_median"] == 20.0 and summary["teacher_ms_median"] == 7.0  # step 1 (warm-up) left out
    assert summary["samples_per_s_median"] == 20.0 and summary["copy_ms_median"] is None
    assert summary["host_peak_rss_gib_max"] == 2.5
    assert summary["training_ranks"] == 2 and summary["batch_size"] == 2 * 3 * 2  # per rank x accumulation x ranks
    assert summary["owner_idle_fraction"] == 0.25 and summary["overrides"] == ["trainer.max_steps=3"]
    assert summary["teacher"] == "tiny" and Path(summary["teacher_path"]) == tiny_path
    assert summary["teacher_experts"] == 1 and summary["teacher_shape"]["text_dim"] == 32
    assert (summary["placement"], summary["precision"], summary["world_size"]) == ("cpu", "fp32", 1)
    assert (summary["method"], summary["student_steps"]) == ("dmd", 4)  # what trained it, as the card says
    # The whole process's rate beside the median step's: this segment's 2 steps x 12 samples over its wall time.
    assert summary["samples_this_segment"] == 24
    assert summary["samples_per_s_overall"] == pytest.approx(24 / summary["wall_s"])


def test_a_sweep_points_overrides_win_and_an_empty_history_summarises_to_nothing_measured(context):
    point = {"overrides": ["teacher_placement=cpu"], "group": "g", "name": "n"}
    swept = dataclasses.replace(context, sweep_point=point)
    kd = SimpleNamespace(student=torch.nn.Linear(1, 1), method=SimpleNamespace(name="kd", steps=None))
    summary = summarize(swept, kd, [], [{"rank": 0, "role": "student"}])
    assert summary["overrides"] == ["teacher_placement=cpu"]
    assert summary["steps_run"] == 0 and summary["final_step"] is None and summary["loss_first"] is None
    assert summary["step_ms_median"] is None and summary["step_ms_stdev"] is None


class StopsAtEndHook(Hook):
    """A hook whose end-of-run work is cut by Ctrl-C (what `stop_at_once`'s handler raises in the train CLI)."""

    def at_end(self, run) -> dict:
        import signal

        from wandistiller.core.stopping import Signalled

        raise Signalled(signal.SIGINT)


def test_ctrl_c_in_the_end_of_run_work_keeps_the_trained_student_and_says_what_was_skipped(make_cfg, tmp_path):
    from wandistiller.core.errors import Stopped

    folder = tmp_path / "r"
    stopper = "+hooks.stop._target_=tests.recipe.test_outputs.StopsAtEndHook"
    with pytest.raises(Stopped) as e:
        run(make_cfg("trainer.max_steps=2", stopper, run_dir=folder))
    line = str(e.value)
    assert line.startswith("stopped by SIGINT in the end-of-run work, after training finished: the trained student")
    assert "skipped: hooks.test_outputs" in line and f"python -m wandistiller.eval {folder}" in line
    assert (folder / "student").is_dir() and (folder / "pipeline").is_dir() and (folder / "metrics.json").is_file()


def test_a_lora_student_of_a_fine_tuned_teacher_names_its_loras_and_ships_that_teacher(make_cfg, tmp_path, tiny_path):
    """`teacher.lora` end to end: a 2-step LoRA student (trajectory, K=2) of the tiny teacher fine-tuned with a
    Lightning-layout LoRA at 0.8: metrics.json, sampling.json and the model card name the LoRA (file, strength,
    sha256 prefix), and the pipeline's transformer is the fine-tuned teacher the adapters were trained on."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    from tests.teacher.test_finetune import ALPHA, peft_state
    from wandistiller.state.loralayout import lightning_tensors
    from wandistiller.teacher.finetune import with_loras
    from wandistiller.teacher.model import load_expert

    plain = inspect_teacher(tiny_path)
    file = tmp_path / "style.safetensors"
    save_file(lightning_tensors(peft_state(plain.transformer_config), ALPHA, "fp32"), file)
    lora = f"teacher.lora=[{{path:{file},strength:0.8}}]"
    run_dir = tmp_path / "r"
    run(make_cfg("trainer.max_steps=2", "student=lora", "method=trajectory", "method.steps=2", lora, run_dir=run_dir))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    (named,) = metrics["teacher_loras"]
    assert named["file"] == "style.safetensors" and named["strength"] == 0.8 and len(named["sha256"]) == 64
    sampling = json.loads((run_dir / "student" / "sampling.json").read_text())
    assert sampling["teacher_loras"] == [{k: v for k, v in named.items() if k != "path"}]  # nothing of this machine
    card = (run_dir / "pipeline" / "README.md").read_text()
    assert f"`style.safetensors` at strength 0.8, sha256 `{named['sha256'][:12]}`" in card and str(tmp_path) not in card
    tuned = load_expert(with_loras(plain, [{"path": str(file), "strength": 0.8}]), "transformer", torch.float32)
    shipped = WanTransformer3DModel.from_pretrained(run_dir / "pipeline" / "transformer")
    for (name, ours), theirs in zip(tuned.state_dict().items(), shipped.state_dict().values()):
        assert torch.equal(ours, theirs), name
