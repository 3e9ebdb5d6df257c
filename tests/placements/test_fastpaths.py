"""Tests of wandistiller/placements/fastpaths.py, the opt-in fast paths: refused with one line where they cannot run
(called directly and through a run), and composable where they can."""

from __future__ import annotations

import pytest
import torch

from wandistiller.core.errors import UserError
from wandistiller.placements.fastpaths import check_compile_mode, check_quantize, compile_kwargs
from wandistiller.train import run


def test_an_fp8_teacher_is_refused_unless_it_computes_in_bf16(make_cfg, tmp_path):
    # (fp8 runs on the CPU too now: tests/teacher/test_fp8.py; the GPU's capability check is in tests/test_gpu.py)
    with pytest.raises(UserError, match=r"teacher.quantize=fp8 computes with a bf16 .*; use precision=bf16") as e:
        run(make_cfg("teacher.quantize=fp8", "precision=fp32", run_dir=tmp_path / "r"))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_unknown_fast_path_values_are_refused_with_their_key():
    with pytest.raises(UserError, match="teacher.quantize=int3 is unknown"):
        check_quantize("int3", torch.device("cpu"))
    with pytest.raises(UserError, match="trainer.compile_mode=fast is unknown"):
        check_compile_mode("fast", True)
    with pytest.raises(UserError, match="add trainer.compile_student=true"):
        check_compile_mode("reduce-overhead", False)


def test_fast_path_options_compose_and_a_chosen_attention_backend_trains(make_cfg, tmp_path):
    cfg = make_cfg(
        "trainer.compile_student=true",
        "trainer.compile_mode=max-autotune-no-cudagraphs",
        "teacher.attention_backend=native",
        "teacher.quantize=null",
    )
    check_quantize(cfg.teacher.quantize, torch.device("cpu"))
    check_compile_mode(cfg.trainer.compile_mode, cfg.trainer.compile_student)
    assert compile_kwargs(cfg.trainer.compile_mode) == {"fullgraph": True, "mode": "max-autotune-no-cudagraphs"}
    summary = run(make_cfg("teacher.attention_backend=native", "trainer.max_steps=2", run_dir=tmp_path / "r"))
    assert summary["steps_run"] == 2


def test_an_unavailable_attention_backend_is_refused_in_one_line(make_cfg, tmp_path):
    with pytest.raises(UserError, match="teacher.attention_backend=nonsense cannot be used here") as e:
        run(make_cfg("teacher.attention_backend=nonsense", "trainer.max_steps=1", run_dir=tmp_path / "r"))
    assert "\n" not in str(e.value)
