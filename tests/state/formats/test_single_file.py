"""`wandistiller.state.formats.single_file`: the single files a student is written as -- an A14B pair as two files with
its boundary and a two-sampler workflow, and the line, before any file, on whether ComfyUI will detect the shape.
The whole command (`python -m wandistiller.export --format single-file`) is tests/test_export.py's."""

from __future__ import annotations

import json

from safetensors import safe_open

TEACHER = {"name": "wan", "hub_id": None, "digest": None, "boundary_ratio": None}


def test_an_a14b_pair_is_two_files_with_the_boundary_and_a_two_sampler_workflow(tmp_path):
    from diffusers import WanPipeline, WanTransformer3DModel

    from wandistiller.core.assets import ASSETS
    from wandistiller.state.comfy import Sampling
    from wandistiller.state.formats.single_file import write_single_files

    folder = ASSETS / "pocket" / "pocket-wan-t2v-moe"
    pipe = WanPipeline.from_pretrained(folder)
    teacher = {"name": "pocket_moe", "hub_id": None, "digest": None, "boundary_ratio": pipe.config.boundary_ratio}
    comfy = Sampling(4, "euler", "simple", 3.0, 32, 32, pipe.config.boundary_ratio)
    files = write_single_files(
        tmp_path,
        [pipe.transformer, pipe.transformer_2],
        "pair",
        "bf16",
        {"steps": 4, "few_step": False},
        teacher,
        comfy,
        "# card\n",
    )
    assert [f.name for f in files] == ["pair_high_noise.safetensors", "pair_low_noise.safetensors"]
    for file, kind in zip(files, ("high_noise", "low_noise")):
        with safe_open(str(file), "pt") as f:
            assert json.loads(f.metadata()["expert"]) == {"expert": kind, "boundary_ratio": 0.875}
    loaded = [WanTransformer3DModel.from_single_file(str(f), config=str(tmp_path)) for f in files]
    both = WanPipeline.from_pretrained(folder, transformer=loaded[0], transformer_2=loaded[1])
    assert both.transformer_2 is loaded[1] and both.config.boundary_ratio == 0.875
    flow = json.loads((tmp_path / "pair.workflow.json").read_text())
    assert [n["type"] for n in flow["nodes"]].count("KSamplerAdvanced") == 2
    card = (tmp_path / "README.md").read_text()
    assert "the high-noise expert" in card and "transformer_2 = WanTransformer3DModel.from_single_file" in card


def test_export_says_before_writing_whether_comfyui_will_detect_the_files_shape(tmp_path):
    """ComfyUI reads a Wan model's shape from its weights alone (num_heads = dim // 128, one FFN width): the export
    says which, before the first file is written, and what to do where it will not."""
    import logging

    from diffusers import WanTransformer3DModel

    from wandistiller.state.comfy import Sampling
    from wandistiller.state.formats.single_file import write_single_files

    wan_shaped = dict(num_attention_heads=2, attention_head_dim=128, ffn_dim=64, num_layers=1, text_dim=4096)
    tiny = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=1, text_dim=4096)
    seen: list[tuple[str, list]] = []

    class Seen(logging.Handler):
        def emit(self, record):
            if "ComfyUI" in record.getMessage():
                seen.append((record.getMessage(), sorted(p.name for p in out.iterdir())))

    handler, logger = Seen(), logging.getLogger("wandistiller.export")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for i, shape in enumerate((wan_shaped, tiny)):
            out = tmp_path / str(i)
            out.mkdir()
            model = WanTransformer3DModel(in_channels=16, out_channels=16, freq_dim=256, **shape)
            sampling = Sampling(20, "uni_pc", "simple", 5.0, 64, 64)
            write_single_files(out, [model], "m", "bf16", {"steps": 20, "few_step": False}, TEACHER, sampling, "# c\n")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    (detected, before), (note, before_note) = seen
    assert detected.startswith("ComfyUI will detect this file's shape from its weights: dim 256, num_heads 256")
    assert note.startswith("note: ComfyUI (and any loader that guesses") and "attention_head_dim=16, not 128" in note
    assert "The shapes that keep those guesses: student=" in note  # what to do
    assert before == before_note == []  # said before anything was written
