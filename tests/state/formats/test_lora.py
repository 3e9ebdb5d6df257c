"""`wandistiller.state.formats.lora`: the LoRA format takes LoRA students only, and bf16/fp16/fp32 (the files
themselves, loaded by ComfyUI's code and diffusers, are tests/test_export.py's and tests/state/test_loralayout.py's)."""

from __future__ import annotations

from tests.conftest import refused
from wandistiller.export import export
from wandistiller.state.formats.lora import FORMAT
from wandistiller.state.runs import open_run


def test_a_student_of_its_own_is_refused_in_one_line_naming_the_other_formats(finished, tmp_path):
    problem = FORMAT.refusal(open_run(finished))
    assert problem is not None and "is not a LoRA (student.builder=" in problem and "--format single-file" in problem
    with refused("is not a LoRA"):
        export(finished, tmp_path / "out", "lora")
    assert not (tmp_path / "out").exists()
    assert "fp8" not in FORMAT.dtypes and FORMAT.default_dtype == "bf16" and FORMAT.workflow
