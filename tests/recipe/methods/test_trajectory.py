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
        ("method.schedule=[1,0.5]", "method.schedule=[1,0.5] has 2 sigmas and method.steps=4; give one sigma per step"),
        ("method.schedule=[1,0.5,0.75,0.25]", "method.schedule=[1,0.5,0.75,0.25]: the sigmas must decrease strictly"),
        ("method.schedule=cosine", "method.schedule=cosine is not one of euler, simple, beta"),
    ],
)
def test_a_bad_step_count_or_schedule_is_refused_before_the_run_folder(make_cfg, tmp_path, override, message):
    with refused(message) as e:
        run(make_cfg("method=trajectory", override, run_dir=tmp_path / "r"))
    assert "\n" not in str(e.value) and not (tmp_path / "r" / "checkpoints").exists()


def test_a_schedule_given_as_a_list_is_the_methods_sigmas_and_the_run_records_it(make_cfg, tmp_path):
    from hydra.utils import instantiate

    from wandistiller.teacher.fewstep import Schedule

    cfg = make_cfg("method=trajectory", "method.schedule=[1,0.9,0.75,0.5]", run_dir=tmp_path / "r")
    assert instantiate(cfg.method).schedule == Schedule("list", None, (1.0, 0.9, 0.75, 0.5))
    assert "schedule" not in instantiate(make_cfg("method=trajectory", run_dir=tmp_path / "r").method).identity()
    cfg = make_cfg("method=dmd", "method.schedule=simple", "method.shift=5", run_dir=tmp_path / "r")
    method = instantiate(cfg.method)
    assert method.schedule == Schedule("simple", 5.0)
    assert method.identity()["schedule"] == "ComfyUI's simple at shift 5"  # a resume at other sigmas is refused


def test_the_cli_refuses_a_schedule_not_decreasing_in_one_line_exit_2_and_claims_no_folder(tmp_path, cache_dir):
    from tests.conftest import run_cli

    folder = tmp_path / "r"
    result = run_cli(f"hydra.run.dir={folder}", f"paths.cache_dir={cache_dir}", "logger=none", "method=dmd",
                     "method.steps=3", "method.schedule=[1,0.4,0.6]")  # fmt: skip
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("error: method.schedule=[1,0.4,0.6]: the sigmas must decrease strictly")
    assert not folder.exists()
