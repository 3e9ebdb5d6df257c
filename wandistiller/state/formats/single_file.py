"""`--format single-file`: `<name>.safetensors` (an A14B pair: `<name>_high_noise` / `<name>_low_noise`) in the Wan
reference layout (state/singlefile.py; bf16, fp16, fp32, or fp8 in ComfyUI's per-layer `.comfy_quant` layout or its
legacy `scaled_fp8`), its metadata the student's config, sampling and teacher; `config.json` beside it (diffusers'
`from_single_file(config=DIR)`), `<name>.workflow.json` for ComfyUI (state/comfy.py) and README.md: the model card,
every file and the lines that load it. A LoRA student's single file is its teacher with the adapters merged (what
`pipeline --merge-lora` writes), one per expert of a pair."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from wandistiller.core.errors import UserError
from wandistiller.core.files import read_json_in, write_in_run
from wandistiller.state.card import files_section
from wandistiller.state.checkpoint import teacher_problem
from wandistiller.state.comfy import (
    readme,
    workflow_text,
)
from wandistiller.state.formats.base import (
    ExportFormat,
    Request,
    comfy_sampling,
    exact_line,
    final_student,
    is_lora_student,
    read_student,
    run_card,
    sampling_facts,
    teacher_facts,
)
from wandistiller.state.runs import recorded_teacher
from wandistiller.state.saved import raw_value, saved_word
from wandistiller.state.singlefile import (
    block_count_problem,
    config_of,
    expert_names,
    loader_assumptions_broken,
    wan_key,
    wan_tensors,
)
from wandistiller.state.singlefile import metadata as single_file_metadata
from wandistiller.student.lora import ADAPTERS_JSON, merged_experts

log = logging.getLogger("wandistiller.export")

COMFY_COMMIT = "0411153ac63b"  # ComfyUI's comfy/ops.py and comfy/quant_ops.py the fp8 layouts were read against


KEEPS_WAN_SHAPE = "student=base, small, half, quarter or tenth of a Wan teacher (128-wide heads, one FFN width)"


def shape_warning(config: dict, tensors: dict, teacher_config: dict | None = None) -> str | None:
    """One line where a loader that guesses the shape from the weights would build this student wrong."""

    broken = loader_assumptions_broken(config, tensors)
    if not broken:
        return None
    said = (
        f"ComfyUI (and any loader that guesses a Wan model's shape from its weights) would build this student "
        f"wrong: {'; '.join(broken)}; diffusers with config= loads it."
    )
    if teacher_config is not None and loader_assumptions_broken(teacher_config, {}):  # the pocket and tiny teachers
        # A newcomer's make-train run is student=half already: "the shapes that keep them" alone did not say why.
        return (
            f"{said} This teacher's own shape breaks those guesses too, so none of its students loads in ComfyUI: "
            "only the students of a real Wan teacher do (docs/REAL_MODEL.md)"
        )
    return f"{said} The shapes that keep those guesses: {KEEPS_WAN_SHAPE}"


def ffn_weights(model) -> dict:
    """The model's FFN input weights under their Wan names (no copy): the widths a guessing loader reads."""
    return {
        wan_key(n): t
        for n, t in model.state_dict().items()
        if re.fullmatch(r"blocks\.\d+\.ffn\.net\.0\.proj\.weight", n)
    }


def comfy_detects(config: dict) -> str:
    """The line export says where ComfyUI will build this shape from the weights (comfy/model_detection.py: Wan's
    `num_heads = dim // 128`, its FFN width from block 0, the blocks counted)."""
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    return (
        f"ComfyUI will detect this file's shape from its weights: dim {dim}, num_heads {dim} // 128 = "
        f"{dim // 128}, ffn_dim {config['ffn_dim']}, {config['num_layers']} blocks"
    )


def write_single_files(
    out: Path,
    experts: list,
    name: str,
    dtype: str,
    facts: dict,
    teacher: dict,
    comfy,
    card: str,
    teacher_config: dict | None = None,
    fp8_layout: str = "comfy_quant",
) -> list[Path]:
    """`experts` (one student, or an A14B pair: high-noise first) as single files in `out`, with config.json, the
    ComfyUI workflow and README.md (the card, every file and how to load it, the ComfyUI section). fp8 in
    `fp8_layout` (state/singlefile.py: ComfyUI's per-layer `.comfy_quant`, or its legacy `scaled_fp8`)."""

    files = expert_names(name, len(experts))
    config = config_of(experts[0])
    # Before anything is written: whether ComfyUI will build this shape from the file's weights alone.
    warning = next(
        (w for w in (shape_warning(config_of(m), ffn_weights(m), teacher_config) for m in experts) if w), None
    )
    if warning:
        log.warning("note: %s", warning)
    else:
        log.info("%s", comfy_detects(config))
    for i, (model, file) in enumerate(zip(experts, files)):
        tensors = wan_tensors(model, dtype, fp8_layout)
        bad = block_count_problem(tensors)
        if bad:
            raise ValueError(f"{file}: {bad}")
        expert = (
            {"expert": ("high_noise", "low_noise")[i], "boundary_ratio": teacher["boundary_ratio"]}
            if len(experts) == 2
            else None
        )
        save_file(tensors, str(out / file), metadata=single_file_metadata(config_of(model), facts, teacher, expert))
    write_in_run(out, "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    workflow_file = f"{name}.workflow.json"
    write_in_run(out, workflow_file, workflow_text(files, comfy))
    exact = ""
    if facts["few_step"]:
        exact = exact_line(facts)
    listing = _listing(files, dtype, fp8_layout, teacher, workflow_file)
    intro = "These are single files, not a pipeline folder (the snippet above loads `--format diffusers`' export):"
    sections = files_section(listing, intro) + readme(files, workflow_file, comfy, exact, warning)
    write_in_run(out, "README.md", card + sections)
    return [out / f for f in files]


def _listing(files: list[str], dtype: str, fp8_layout: str, teacher: dict, workflow_file: str) -> list:
    """The README's table of the single files, config.json and the workflow: what each is and what loads it."""
    listing = [
        (
            f,
            _what(dtype, i, len(files), fp8_layout),
            _diffusers_lines(f, dtype, teacher, i, files),
            f"`{f}` into models/diffusion_models, then Load Diffusion Model (UNETLoader); `{workflow_file}` does it",
        )
        for i, f in enumerate(files)
    ]
    listing += [
        (
            "config.json",
            "the student's diffusers config, which `from_single_file(config=...)` needs"
            + (" (for a 16-bit or fp32 export of it: not this fp8 file)" if dtype == "fp8" else ""),
            "",
            "",
        ),
        (workflow_file, "a ComfyUI workflow for the files above", "", "drop it on ComfyUI's canvas"),
    ]
    return listing


def _what(dtype: str, i: int, count: int, fp8_layout: str = "comfy_quant") -> str:
    which = "" if count == 1 else (" (the high-noise expert)", " (the low-noise expert)")[i]
    if dtype != "fp8":
        return f"the student transformer{which} in the Wan reference layout, {dtype}"
    if fp8_layout == "comfy_quant":
        kind = (
            "fp8 in ComfyUI's per-layer quantization layout (`.comfy_quant`): the blocks' Linear weights "
            "float8_e4m3fn with one float32 `weight_scale` each, every other tensor (biases, norms, embeddings, the "
            f"head) 16-bit or fp32, as ComfyUI then computes with them (read against ComfyUI commit {COMFY_COMMIT}; "
            "a ComfyUI older than `.comfy_quant` support cannot read it: export with `--fp8-layout scaled_fp8`)"
        )
    else:
        kind = (
            "ComfyUI's legacy scaled fp8 (`scaled_fp8` marker, one float32 `scale_weight` per block Linear), for "
            "ComfyUI builds older than `.comfy_quant`: they run every Linear and bias in fp8, the 16-bit layers "
            "included (about 5x this file's own rounding error); a newer ComfyUI reads the default "
            "`--fp8-layout comfy_quant` export right"
        )
    cannot = (
        ". **Not for diffusers**: `WanTransformer3DModel.from_single_file` cannot read it -- it loads the fp8 "
        "weights without their scales (with only a warning), so the model's output is wrong; diffusers users take "
        "the bf16 export (`--dtype bf16`) or the pipeline folder"
    )
    return f"the student transformer{which} in the Wan reference layout, {kind}{cannot}"


def _diffusers_lines(file: str, dtype: str, teacher: dict, i: int, files: list[str]) -> str:
    if dtype == "fp8":
        return ""  # diffusers does not read ComfyUI's scaled fp8: the bf16 export is its file
    torch_dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}[dtype]
    source = teacher["hub_id"] or "THE_TEACHER_FOLDER"
    part = "transformer" if i == 0 else "transformer_2"
    other = "" if len(files) == 1 else "  # and the other file as the other expert"
    pipeline = teacher.get("pipeline", "WanPipeline")
    return (
        f"from diffusers import {pipeline}, WanTransformer3DModel\n"
        'folder = "PATH_TO_THIS_FOLDER"  # it holds config.json\n'
        f'{part} = WanTransformer3DModel.from_single_file(f"{{folder}}/{file}", config=folder, '
        f"dtype={torch_dtype})\n"
        f'pipe = {pipeline}.from_pretrained("{source}", {part}={part}, dtype={torch_dtype}){other}'
    )


def merged_teacher_at_hand(run) -> None:
    """A merged export of a LoRA student needs the teacher the adapters were trained on: each expert's weights in
    the run's teacher folder, and (where the run recorded it) the same weights. One line otherwise."""

    for expert in run.spec.experts:
        if not any((Path(run.spec.path) / expert).glob("*.safetensors")):
            raise UserError(
                f"--format single-file merges the LoRA student's adapters into its teacher, and the teacher's "
                f"{expert} weights are not at {run.spec.path}/{expert}; put the teacher there (teacher.path of the "
                "run's config), or export the adapters alone with --format lora"
            )
    source = final_student(run, None)
    recorded = recorded_teacher(run, source)
    if not (isinstance(recorded, dict) and recorded.get("digest")) and (source / ADAPTERS_JSON).is_file():
        try:  # the adapters' own record of their teacher (written with them at the run's end)
            saved = read_json_in(run.path, source / ADAPTERS_JSON, what="adapters.json")
        except ValueError:
            saved = {}
        recorded = saved.get("teacher") if isinstance(saved, dict) else None
    problem = teacher_problem(recorded, run.spec)
    if problem:
        raise UserError(
            f"--format single-file merges the LoRA student's adapters into its teacher, and the teacher at "
            f"{run.spec.path} is not the one they were trained on ({problem}); put that teacher there, or export "
            "the adapters alone with --format lora"
        )


def _single_file(run, tmp: Path, request: Request) -> Path:
    """The student's single file; a LoRA student's: the teacher with its adapters merged (W + alpha/rank B A, in
    float64, then fp32: what `pipeline --merge-lora` writes), one file per expert of a pair."""

    dtype, name = request.dtype or "bf16", request.name  # the format's default, where none was asked
    teacher_name = saved_word(raw_value(run.cfg.teacher, "name")) or "wan"
    if is_lora_student(run):
        source = final_student(run, None)
        experts = merged_experts(run.spec, source, run.cfg.student, torch.float32, torch.device("cpu"), root=run.path)
        name = name or f"{teacher_name}_lora_merged_{dtype}".replace(".", "_")
    else:
        student, source = read_student(run, request.checkpoint)
        experts = [student]
        builder = saved_word(raw_value(run.cfg.student, "builder")) or "student"
        name = name or f"{teacher_name}_{builder}_{dtype}".replace(".", "_")
    facts = sampling_facts(run)
    built = tmp / "export"
    built.mkdir()
    write_single_files(
        built,
        experts,
        name,
        dtype,
        facts,
        teacher_facts(run, source),
        comfy_sampling(run, facts, len(experts), request.workflow),
        run_card(run, request.phrases),
        run.spec.transformer_config,
        request.fp8_layout,
    )
    return built


def ready(run) -> None:
    """A LoRA student's single file merges its adapters into its teacher: the teacher must be at hand."""
    if is_lora_student(run):
        merged_teacher_at_hand(run)


FORMAT = ExportFormat(
    "single-file",
    ("bf16", "fp16", "fp32", "fp8"),
    "bf16",
    "a single file takes --dtype bf16, fp16, fp32 or fp8",
    True,
    lambda run: None,  # every student: a LoRA one merged into its teacher
    _single_file,
    ready=ready,
    order=1,
)
