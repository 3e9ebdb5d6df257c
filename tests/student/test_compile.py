"""Tests of wandistiller/student/compile.py, the student's regional compile settings: an unknown mode, or a mode without
a compiled student, refused with its key; a chosen mode composed from the config and passed to torch.compile."""

from __future__ import annotations

import pytest

from wandistiller.core.errors import UserError
from wandistiller.student.compile import check_compile_mode, compile_kwargs


def test_unknown_or_orphan_compile_modes_are_refused_with_their_key():
    with pytest.raises(UserError, match="trainer.compile_mode=fast is unknown"):
        check_compile_mode("fast", True)
    with pytest.raises(UserError, match="add trainer.compile_student=true"):
        check_compile_mode("reduce-overhead", False)
    check_compile_mode(None, False)


def test_a_compile_mode_composes_and_reaches_torch_compile_as_its_mode(make_cfg):
    cfg = make_cfg("trainer.compile_student=true", "trainer.compile_mode=max-autotune-no-cudagraphs")
    check_compile_mode(cfg.trainer.compile_mode, cfg.trainer.compile_student)
    assert compile_kwargs(cfg.trainer.compile_mode) == {"fullgraph": True, "mode": "max-autotune-no-cudagraphs"}
    assert compile_kwargs(None) == {"fullgraph": True}
