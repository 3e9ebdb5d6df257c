"""`wandistiller.state.formats.diffusers`: the pipeline folder an export and `python -m wandistiller.pipeline` build
(one function, `pipeline_folder`), its transformer re-saved in the dtype asked; a LoRA student is refused."""

from __future__ import annotations

import torch
from safetensors import safe_open

from wandistiller.state.formats.base import Request
from wandistiller.state.formats.diffusers import FORMAT, pipeline_folder, pipeline_student, write_diffusers
from wandistiller.state.runs import open_run


def test_the_pipeline_folder_loads_and_its_transformer_is_in_the_dtype_asked(finished, tmp_path):
    from diffusers import WanPipeline

    run = open_run(finished)
    assert FORMAT.refusal(run) is None and FORMAT.default_dtype is None  # as saved
    built = pipeline_folder(run, tmp_path / "a", pipeline_student(run, None), False, {})
    assert WanPipeline.from_pretrained(built).transformer.dtype == torch.float32
    (tmp_path / "b").mkdir()
    half = write_diffusers(run, tmp_path / "b", Request(dtype="bf16"))
    (weights,) = (half / "transformer").glob("*.safetensors")
    with safe_open(str(weights), "pt") as f:
        dtypes = [f.get_tensor(k).dtype for k in f.keys()]
    # bf16 but for the modules diffusers keeps in fp32 (the time embedding, the norms it names)
    assert dtypes.count(torch.bfloat16) > dtypes.count(torch.float32)
    assert WanPipeline.from_pretrained(half) is not None and "transformer/" in (half / "README.md").read_text()
