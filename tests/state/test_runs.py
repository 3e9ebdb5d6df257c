"""wandistiller/state/runs.py: a run folder read back (its config, teacher, student, sampler), called directly
on tiny folders, and through eval/generate on a finished run someone sent."""

from __future__ import annotations

import shutil

from tests.state.test_received import one_error_line, received
from wandistiller import eval as eval_cli
from wandistiller import generate as generate_cli
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
    result = eval_cli.evaluate(folder, steps=1, limit=1)
    assert result["mean"]["latent_mse"] >= 0
    args = generate_cli.parse_args([str(folder), "--prompt", "../../escape", "--steps", "1"])
    paths = generate_cli.run_generate(args)
    assert all(p.resolve().parent == (folder / "generated").resolve() for p in paths)  # no `../` from prompts
    shutil.rmtree(folder / "student")
    (folder / "metrics.json").unlink()
    summary = run(make_cfg("trainer.resume=auto", "trainer.max_steps=3", run_dir=folder))
    assert summary["final_step"] == 3
    assert not elsewhere.exists()
