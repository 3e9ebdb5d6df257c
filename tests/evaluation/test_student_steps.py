"""eval and generate sample a student at its own steps (issue 28): a few-step student at its K with its few-step
scheduler and no CFG, any student at the counts asked for (`--student-steps 1,2`), one result each, with the network
calls per image each took; and intra-prompt diversity beside accuracy and FID."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from wandistiller import eval as eval_cli
from wandistiller import generate as generate_cli
from wandistiller.data.prompts import encode_prompts
from wandistiller.evaluation.evaluate import evaluate
from wandistiller.state.runs import as_sampler, generate, load_student, load_teacher, open_run, student_scheduler
from wandistiller.teacher.sampler import calls_per_image


def few_step_copy(finished, tmp_path, steps: int | None, name: str = "run"):
    folder = tmp_path / name
    shutil.copytree(finished, folder)
    path = folder / ".hydra" / "config.yaml"
    cfg = OmegaConf.load(path)
    OmegaConf.update(cfg, "method", {"name": "trajectory", "steps": steps}, force_add=True)
    OmegaConf.save(cfg, path)
    return folder


def test_network_calls_per_image_are_what_wan_pipeline_makes(finished, tmp_path):
    """One forward a step for the student (no CFG), two for the teacher (its CFG): counted with forward hooks."""
    run, cpu = open_run(few_step_copy(finished, tmp_path, 2)), torch.device("cpu")
    emb = encode_prompts(run.spec, ["a fox"], "", run.cfg.teacher.max_sequence_length, torch.float32, cpu,
                         run.cfg.paths.cache_dir)  # fmt: skip
    student = as_sampler(run.spec, load_student(run, run.path / "student", cpu), cpu)
    teacher = load_teacher(run, cpu, torch.float32)
    for sampler, steps, scheduler in [(student, 3, student_scheduler(run.spec, 2, 3)), (teacher, 2, None)]:
        calls: list[int] = []
        hooks = [e.register_forward_hook(lambda *_, c=calls: c.append(1)) for e in sampler.experts]
        generate(sampler, emb, [0], 0, steps, run.latent_shape, per_prompt=2, scheduler=scheduler)
        for hook in hooks:
            hook.remove()
        warm_up = calls_per_image(1 if scheduler is None else steps, sampler.guidance_scales[0])  # its first call
        assert len(calls) - warm_up == 2 * calls_per_image(steps, sampler.guidance_scales[0])
    assert calls_per_image(3, 1.0) == 3 and calls_per_image(2, teacher.guidance_scales[0]) == 4


def test_eval_student_steps_gives_one_result_per_count_with_its_network_calls(finished, tmp_path, capsys):
    folder = few_step_copy(finished, tmp_path, 2)
    eval_cli.main([str(folder), "--student-steps", "1,2", "--steps", "2", "--limit", "1"])
    out = capsys.readouterr().out
    assert "student at 1 steps:" in out and "student at 2 steps:" in out and "(4 calls)" in out
    result = json.loads((folder / "eval.json").read_text())
    assert result["student_trained_steps"] == 2 and result["student_steps"] == [1, 2] and result["teacher_steps"] == 2
    assert list(result["results"]) == ["1", "2"]
    for n, one in result["results"].items():
        assert one["student_steps"] == int(n) and one["mean"]["student_calls_per_image"] == int(n)
        assert one["mean"]["teacher_calls_per_image"] == 4  # 2 steps with CFG
    one, two = result["results"]["1"]["mean"], result["results"]["2"]["mean"]
    assert one["latent_mse"] != two["latent_mse"] and result["mean"] == one  # the first also as `mean`
    assert result["withheld"]["diversity"].startswith("per_prompt 1: intra-prompt diversity needs 2 or more")


def test_a_few_step_student_is_evaluated_at_its_own_k_and_a_kd_one_as_before(finished, tmp_path):
    few = evaluate(few_step_copy(finished, tmp_path, 3, "few"), steps=2, limit=1)
    assert few["student_steps"] == [3] and few["mean"]["student_calls_per_image"] == 3
    kd_folder = few_step_copy(finished, tmp_path, None, "kd")
    kd = evaluate(kd_folder, steps=2, limit=1)  # a KD student: the teacher's scheduler at --steps, as before
    assert kd["student_trained_steps"] is None and kd["student_steps"] == [2]
    assert kd["mean"]["student_calls_per_image"] == 2
    asked = evaluate(kd_folder, steps=2, limit=1, student_steps=[2])  # --student-steps works for a KD student too
    assert asked["mean"]["latent_mse"] == kd["mean"]["latent_mse"]
    four = evaluate(kd_folder, steps=2, limit=1, student_steps=[4])
    assert four["mean"]["student_calls_per_image"] == 4 and four["mean"]["latent_mse"] != kd["mean"]["latent_mse"]


@pytest.mark.parametrize("bad", ["0", "-1", "1.5", "two", "1,,2", "2,0"])
def test_bad_student_steps_are_one_line_and_exit_2(finished, tmp_path, capsys, bad):
    with pytest.raises(SystemExit) as e:
        eval_cli.main([str(finished), f"--student-steps={bad}", "--limit", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: --student-steps") and err.count("\n") == 1, err
    assert not (finished / "eval.json").exists()


def test_generate_samples_a_few_step_student_at_its_k_unless_told(finished, tmp_path):
    folder = few_step_copy(finished, tmp_path, 2)
    paths = {}
    for extra in ([], ["--student-steps", "2"], ["--student-steps", "1"]):
        args = generate_cli.parse_args([str(folder), "--prompt", "a fox", *extra])
        args.out = str(tmp_path / f"out{len(paths)}")
        [paths[tuple(extra)]] = generate_cli.run_generate(args)
    own, two, one = (p.read_bytes() for p in paths.values())
    assert own == two != one  # its K (2) by default, not --steps' 20
