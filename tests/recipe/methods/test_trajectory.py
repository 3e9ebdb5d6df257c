"""wandistiller/recipe/methods/trajectory.py: a K-step student trained on jumps between the teacher's cached ODE
points, without calling the teacher in the loop; its K saved in the run's config; bad K refused in one line."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.conftest import metrics_steps, refused
from wandistiller.train import run


def test_trajectory_trains_on_the_cached_ode_without_calling_the_teacher(make_cfg, tmp_path, cache_dir, caplog):
    folder = tmp_path / "r"
    common = ["method=trajectory", "method.steps=2", "method.teacher_steps=4", "method.noises_per_prompt=1"]
    with caplog.at_level("INFO", logger="wandistiller"):
        summary = run(make_cfg(*common, "trainer.max_steps=3", "trainer.log_every=1", run_dir=folder))
    # Said before it is paid, and only what 3 steps x 4 samples can draw is made, not every training prompt's.
    assert "teacher ODE points: 12 trajectories (12 prompt(s) x 1 noise(s); of 63: what trainer.max_steps=3" in (
        caplog.text
    )
    (made,) = [m for m in (cache_dir / "trajectories").glob("*-first12/complete.json")]
    assert '"items": 12' in made.read_text()
    assert summary["status"] == "completed"
    rows = metrics_steps(folder)
    assert all(r["loss"] == r["loss_trajectory"] > 0 and "loss_velocity" not in r for r in rows)
    assert all(r["teacher_ms"] < 0.1 * r["step_ms"] for r in rows)  # no teacher call in the loop
    saved = OmegaConf.load(folder / ".hydra" / "config.yaml")
    assert (saved.method.name, saved.method.steps) == ("trajectory", 2)  # what sampling the student reads
    assert list((cache_dir / "trajectories").glob("*/complete.json"))  # made once, whole, for the next run


@pytest.mark.parametrize(
    "override,message",
    [
        ("method.steps=0", "method.steps=0 must be at least 1"),
        ("method.steps=30", "method.steps=30 is more than the teacher's sample steps (method.teacher_steps=20)"),
        ("method.noises_per_prompt=0", "method.noises_per_prompt=0 must be a positive integer"),
    ],
)
def test_a_bad_step_count_is_refused_before_the_run_folder(make_cfg, tmp_path, override, message):
    with refused(message) as e:
        run(make_cfg("method=trajectory", override, run_dir=tmp_path / "r"))
    assert "\n" not in str(e.value) and not (tmp_path / "r" / "checkpoints").exists()
