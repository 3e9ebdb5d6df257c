"""Tests of wandistiller/teacher/fastpaths.py, the teacher's opt-in fast paths: refused with one line where they cannot
run (called directly and through a run), and a chosen attention backend trains."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from wandistiller.core.errors import UserError
from wandistiller.teacher.fastpaths import check_quantize
from wandistiller.train import run


def test_an_fp8_teacher_is_refused_unless_it_computes_in_bf16(make_cfg, tmp_path):
    # (fp8 runs on the CPU too now: tests/teacher/test_fp8.py; the GPU's capability check is in tests/test_gpu.py)
    with pytest.raises(UserError, match=r"teacher.quantize=fp8 computes with a bf16 .*; use precision=bf16") as e:
        run(make_cfg("teacher.quantize=fp8", "precision=fp32", run_dir=tmp_path / "r"))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_an_unknown_quantize_mode_is_refused_with_its_key_and_none_is_no_check():
    with pytest.raises(UserError, match="teacher.quantize=int3 is unknown"):
        check_quantize("int3", torch.device("cpu"))
    check_quantize(None, torch.device("cpu"), torch.float32)


def test_an_fp8_teacher_on_a_build_without_fp8_is_refused_in_one_line_naming_what_is_missing():
    from wandistiller.teacher.fp8 import build_problem

    assert build_problem("cpu") is None  # this build (torch >= 2.1) has fp8 on the CPU: check_quantize passes
    check_quantize("fp8", torch.device("cpu"))
    # A build without the dtype (torch < 2.1) is this one asked for a dtype it lacks.
    missing = build_problem("cpu", "float8_e9m9")
    assert missing == f"torch {torch.__version__} has no float8_e9m9 dtype (fp8 needs torch >= 2.1)"


def test_a_chosen_attention_backend_composes_and_trains(make_cfg, tmp_path):
    cfg = make_cfg("teacher.attention_backend=native", "teacher.quantize=null")
    check_quantize(cfg.teacher.quantize, torch.device("cpu"))
    # any case, as diffusers takes it: "Native" was refused by a check that compared it as given
    summary = run(make_cfg("teacher.attention_backend=Native", "trainer.max_steps=2", run_dir=tmp_path / "r"))
    assert summary["steps_run"] == 2


def test_an_unknown_or_unavailable_attention_backend_is_refused_in_one_line(make_cfg, tmp_path):
    # An unknown name before the teacher loads (it was said after, with diffusers' list of 27 backends in the line).
    with pytest.raises(UserError, match="^teacher.attention_backend=nonsense is not one of diffusers' attention") as e:
        run(make_cfg("teacher.attention_backend=nonsense", "trainer.max_steps=1", run_dir=tmp_path / "r"))
    assert "\n" not in str(e.value) and not (tmp_path / "r").exists()
    if importlib.util.find_spec("flash_attn") is None:  # known, and refused as the teacher loads without its package
        with pytest.raises(UserError, match="^teacher.attention_backend=flash cannot be used here") as e:
            run(make_cfg("teacher.attention_backend=flash", "trainer.max_steps=1", run_dir=tmp_path / "r"))
        assert "\n" not in str(e.value)
