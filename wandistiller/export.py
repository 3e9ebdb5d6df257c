"""Export a run's student where Wan users run models: a diffusers pipeline folder, or single `.safetensors` files in
the Wan reference layout (bf16, fp16, fp32 or fp8 in ComfyUI's per-layer `.comfy_quant` layout) with a ComfyUI
workflow, README and model card.

`python -m wandistiller.export RUN --format diffusers|single-file|lora [--dtype bf16|fp16|fp32|fp8] --out DIR`

- `diffusers`: what `python -m wandistiller.pipeline RUN --out DIR` writes (WanPipeline.from_pretrained loads it),
  its transformer in `--dtype` (default: as saved, fp32).
- `single-file`: `<name>.safetensors` (an A14B pair: `<name>_high_noise` / `<name>_low_noise`) in the Wan reference
  layout (state/singlefile.py), its metadata the student's config, sampling and teacher; `config.json` beside it
  (diffusers' `from_single_file(config=DIR)`), `<name>.workflow.json` for ComfyUI (state/comfy.py) and README.md:
  the model card, every file and the lines that load it. `--dtype` default bf16. A LoRA student's single file is
  its teacher with the adapters merged (what `pipeline --merge-lora` writes), one per expert of a pair.
- `lora`: a LoRA student's adapters (student=lora; refused for any other student): `<name>.safetensors` (an A14B
  pair: `<name>_high_noise` / `<name>_low_noise`) in the Lightning layout ComfyUI's LoraLoader and diffusers'
  `load_lora_weights` read (state/loralayout.py), `diffusers/` with the files diffusers' `save_lora_weights` wrote
  (the student's own, copied or cast), a few-step student's `scheduler/`, `<name>.workflow.json` (the teacher's
  diffusion model, LoraLoaderModelOnly, the few-step sampler) and README.md. `--dtype` bf16 (default), fp16 or fp32.

An image-to-video student's workflow gives its clip's first frame through its teacher's own ComfyUI node (LoadImage
into WanImageToVideoPipeline's counterpart WanImageToVideo, with CLIPVisionEncode for Wan 2.1 I2V; TI2V 5B's
Wan22ImageToVideoLatent), and its lines load WanImageToVideoPipeline. `--workflow text-to-video|image-to-video` picks
the workflow (default the teacher's own); one the student's experts cannot run in is refused before any work.

Everything is written into a temporary folder beside `--out` and renamed into place at the end: an error, a full
disk or a kill leaves nothing partly written there. The run folder is only read (through core/files.py's guarded
helpers: a received run's link that leads out of it is refused), and `--out` may not lie inside it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from wandistiller.compose import register_configs
from wandistiller.core.atomic import _umask
from wandistiller.core.errors import OneLineParser, UserError, description, exit_on_user_error, internal_errors_reported
from wandistiller.core.files import check_tree, folder_problem, in_run, open_in, opened, read_json_in, write_in_run
from wandistiller.core.tensor_files import safetensors_problem
from wandistiller.pipeline import export as pipeline_export
from wandistiller.recipe.methods import card_phrases
from wandistiller.state.card import card_teacher, example_prompt, files_section, model_card, saved_prompts
from wandistiller.state.checkpoint import list_checkpoints, teacher_digest, teacher_problem
from wandistiller.state.comfy import (
    IMAGE_NODES,
    MANUAL,
    VAE,
    VAE_22,
    WORKFLOWS,
    Sampling,
    default_workflow,
    lora_readme,
    readme,
    teacher_files,
    workflow_problem,
    workflow_text,
)
from wandistiller.state.loralayout import adapter_rank, lightning_tensors
from wandistiller.state.loralayout import metadata as lora_metadata
from wandistiller.state.runs import image_scale, load_student, open_run, recorded_teacher, student_source, time_scale
from wandistiller.state.saved import raw_value, run_loras, saved_number, saved_word
from wandistiller.state.singlefile import DTYPES as TORCH_DTYPES
from wandistiller.state.singlefile import (
    FP8_LAYOUTS,
    block_count_problem,
    config_of,
    expert_names,
    loader_assumptions_broken,
    wan_key,
    wan_tensors,
)
from wandistiller.state.singlefile import metadata as single_file_metadata
from wandistiller.student.lora import ADAPTERS_JSON, WEIGHTS, merged_experts
from wandistiller.teacher.fewstep import few_step_scheduler, student_schedule
from wandistiller.teacher.spec import pipeline_name

log = logging.getLogger("wandistiller.export")

FORMATS = ("diffusers", "single-file", "lora")
DTYPES = ("bf16", "fp16", "fp32", "fp8")
DEFAULT_DTYPE = {"diffusers": None, "single-file": "bf16", "lora": "bf16"}  # None: as the student was saved
# Student shapes a loader that guesses from the weights reads right, given a Wan teacher (128-wide heads): the
# named students keep the teacher's head size (student/prune.py, core/arch.py).
COMFY_COMMIT = "0411153ac63b"  # ComfyUI's comfy/ops.py and comfy/quant_ops.py the fp8 layouts were read against
KEEPS_WAN_SHAPE = "student=base, small, half, quarter or tenth of a Wan teacher (128-wide heads, one FFN width)"


# -- reading the run (the only reads of the run folder: core/files.py's guarded helpers) ---------------------------
def read_student(run, checkpoint: str | None):
    """(the student's WanTransformer3DModel in fp32 on the CPU, the folder it came from). The final student unless
    `checkpoint` (best, latest, step_N, ema) names another; a run that never finished has no final student."""

    if checkpoint in (None, "ema"):
        source = final_student(run, checkpoint)
    else:
        source = student_source(run, checkpoint)
    return load_student(run, source, torch.device("cpu"), torch.float32), source


def final_student(run, checkpoint: str | None) -> Path:
    """The run's `student/` (`student_ema/` for --checkpoint ema), refused in one line where the run has none."""

    if checkpoint == "ema":
        source = in_run(run.path, "student_ema")
        if not source.is_dir():
            raise UserError(f"{run.path} has no student_ema/ (trainer.ema_decay was off); drop --checkpoint")
        return source
    source = in_run(run.path, "student")
    if not source.is_dir() and not list_checkpoints(run.path):  # stopped before its first checkpoint
        raise UserError(
            f"{run.path} has no student yet (no student/, checkpoints: none): it stopped before its first "
            "checkpoint; train it first (trainer.resume=auto)"
        )
    if not source.is_dir():
        raise UserError(
            f"{run.path} has no final student (student/): the run did not finish; finish it "
            "(trainer.resume=auto) or export a checkpoint's student with --checkpoint latest"
        )
    return source


def run_card(run) -> str:
    """The run's model card (state/card.py), its metrics.json read only where it is the run's own file."""

    in_run(run.path, "metrics.json")  # a received run's link to a file elsewhere is refused, never read
    return model_card(run.path, run.spec.path, phrases=card_phrases())


def is_lora_student(run) -> bool:
    """Whether the run's student is low-rank adapters on the teacher (`student.builder: lora`), as saved."""

    return raw_value(run.cfg.student, "builder") == "lora"


# -- checks before anything is read or written ---------------------------------------------------------------------
def check_out(out: Path, run_dir: Path, force: bool) -> None:
    """`--out` new, or empty, or (with --force) an existing folder to replace; never inside the run folder."""

    real_out, real_run = Path(os.path.realpath(out)), Path(os.path.realpath(run_dir))
    if real_out == real_run or real_run in real_out.parents:
        raise UserError(
            f"--out {out} is inside the run folder {run_dir}; choose a folder outside it (a run "
            "folder holds what training writes)"
        )
    if real_out in real_run.parents:  # --force would remove the run with the folder it replaces
        raise UserError(f"--out {out} holds the run folder {run_dir}; choose a folder outside it")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"--out {out} is a file or a link; choose a new folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--out {out} is not empty; choose a new folder, or add --force to replace it")
    run_inside = held_run(out) if force and out.is_dir() else None
    if run_inside is not None:  # --force replaces an earlier export, never a training run's outputs
        raise UserError(
            f"--out {out} holds the run folder {run_inside}; --force replaces an earlier export, never a run: "
            "choose another folder"
        )
    problem = folder_problem(out)
    if problem:
        raise UserError(f"--out {out}: {problem}; choose another folder")


def held_run(folder: Path, depth: int = 3) -> Path | None:
    """A run folder (one with `.hydra/config.yaml`) at `folder` or up to `depth` folders below it (a run's
    `outputs/<date>/<time>`), without following links; None if there is none."""
    if (folder / ".hydra" / "config.yaml").is_file():
        return folder
    if depth == 0:
        return None
    try:
        children = [c for c in folder.iterdir() if c.is_dir() and not c.is_symlink()]
    except OSError:
        return None
    return next((found for c in children if (found := held_run(c, depth - 1)) is not None), None)


def check_format(run, fmt: str, dtype: str | None) -> None:
    lora = is_lora_student(run)
    if fmt == "lora" and not lora:
        builder = _saved_word(run.cfg.student, "builder")
        raise UserError(
            f"--format lora: the student of {run.path} is not a LoRA (student.builder={builder}); export it with "
            "--format single-file or diffusers"
        )
    if lora and fmt == "diffusers":
        raise UserError(
            f"--format diffusers: the student of {run.path} is a LoRA (adapters on its teacher, not a transformer of "
            "its own); export it with --format lora, --format single-file (merged into the teacher), or "
            "python -m wandistiller.pipeline RUN --out DIR --merge-lora"
        )
    if fmt == "lora" and dtype == "fp8":
        raise UserError(
            "--dtype fp8 is for --format single-file (ComfyUI's fp8); LoRA files take --dtype bf16, fp16 or "
            "fp32 (adapters are small: no loader reads fp8 ones)"
        )
    if fmt == "diffusers" and dtype == "fp8":
        raise UserError(
            "--dtype fp8 is for --format single-file (ComfyUI's fp8); a diffusers folder takes "
            "--dtype bf16, fp16 or fp32"
        )


def _saved_word(node, key: str) -> str:
    return saved_word(raw_value(node, key)) or "?"


# -- what the files say about sampling -----------------------------------------------------------------------------
def sampling_facts(run) -> dict:
    """The student's sampling as the file's metadata and README state it: K steps on its own Euler schedule for a
    few-step student (its timesteps and sigmas), else the run's evaluation steps on the teacher's scheduler; the
    flow shift; guidance 1."""

    k, spec = run.trained_steps, run.spec
    facts: dict = {"guidance_scale": 1.0, "shift": spec.flow_shift, "num_train_timesteps": spec.num_train_timesteps}
    if k is not None:
        schedule = run.trained_schedule
        timesteps, sigmas = student_schedule(spec, k, schedule)
        shift = schedule.shift if schedule.shift is not None else spec.flow_shift
        return facts | {
            "steps": k,
            "few_step": True,
            "scheduler": "FlowMatchEulerDiscreteScheduler",
            "schedule": schedule.record(),
            "shift": shift,
            "timesteps": [round(t, 4) for t in timesteps.tolist()],
            "sigmas": [round(s, 8) for s in sigmas.tolist()],
        }
    hooks = run.cfg.get("hooks")
    evaluate = hooks.get("evaluate") if hooks is not None and hasattr(hooks, "get") else None
    steps = saved_number(raw_value(evaluate, "steps")) if evaluate is not None else None
    return facts | {
        "steps": int(steps) if steps and steps >= 1 else 20,
        "few_step": False,
        "scheduler": "the teacher's",
    }


def exact_line(facts: dict) -> str:
    """The README's sentence on the sigmas the workflow samples at: the trained ones, and how it sets them."""
    sigmas = [round(v, 6) for v in facts["sigmas"]]
    if facts["schedule"] in ("simple", "beta"):
        how = (
            f"ComfyUI's own `{facts['schedule']}` scheduler at shift {facts['shift']:g} gives exactly these (the "
            "student was trained at them); another scheduler or shift samples it at sigmas it never saw."
        )
    else:
        how = (
            "The workflow sets exactly these with the core ManualSigmas node into SamplerCustomAdvanced (ComfyUI's "
            "KSampler schedulers give other sigmas: `simple` at this shift is close, not equal, and the student never "
            "saw them). ManualSigmas is a recent core node (checked against ComfyUI commit 065c1df); an older build "
            "lacks it."
        )
    return f"Its trained sigmas: {sigmas}. {how}"


def comfy_sampling(run, facts: dict, experts: int, wanted: str | None = None):
    """How the workflow samples: a few-step student at exactly its trained sigmas -- KSampler with ComfyUI's own
    scheduler of that name where it was trained at `simple` or `beta` (at the shift ModelSamplingSD3 is set to),
    else (diffusers' Euler, a list) the sigmas themselves (ManualSigmas); the teacher's steps with uni_pc else. An
    image-to-video student's (`wanted`: the workflow, default its teacher's own) samples its run's clip length
    through its teacher's first-frame node (state/comfy.py's IMAGE_NODES)."""
    scale, d = image_scale(run.spec.path), run.cfg.data
    boundary = run.spec.boundary_ratio if experts == 2 else None
    sampler, sigmas = ("uni_pc", "simple"), None
    if facts["few_step"]:
        named = facts["schedule"] in ("simple", "beta")
        sampler, sigmas = ("euler", facts["schedule"] if named else MANUAL), tuple(facts["sigmas"])
    layout = str(run.spec.layout)
    given: dict = {}
    if layout in IMAGE_NODES:  # its clip's length, and how its experts take the first frame
        given = {
            "frames": (int(d.latent_frames) - 1) * time_scale(run.spec.path) + 1,
            "image_node": IMAGE_NODES[layout],
            "first_frame": (wanted or default_workflow(layout)) == "image-to-video",
            "clip_vision": run.spec.image_encoder,
            "vae": VAE_22 if layout == "ti2v" else VAE,
        }
    return Sampling(
        facts["steps"],
        *sampler,
        facts["shift"],
        int(d.latent_width) * scale,
        int(d.latent_height) * scale,
        boundary,
        example_prompt(saved_prompts(run.cfg)),
        sigmas,
        **given,
    )


def check_workflow(run, fmt: str, wanted: str | None) -> None:
    """`--workflow` one a format writes and the student's teacher takes, before any work: an image-to-video
    student's experts cannot run in a text-to-video workflow (no image to give them), nor the reverse."""
    if wanted is None:
        return
    if wanted not in WORKFLOWS:
        raise UserError(f"--workflow {wanted!r} is not one of {', '.join(WORKFLOWS)}")
    if fmt not in ("single-file", "lora"):
        raise UserError(f"--workflow is for --format single-file or lora (a {fmt} export has no workflow); drop it")
    layout = str(run.spec.layout)
    problem = workflow_problem(layout, wanted)
    if problem:
        teacher = _saved_word(run.cfg.teacher, "name")
        raise UserError(
            f"--workflow {wanted}: the student of {run.path} was trained on teacher={teacher} ({layout}): {problem}; "
            f"drop --workflow (its teacher's own: {default_workflow(layout)})"
        )


def teacher_facts(run, source: Path) -> dict:

    name, hub_id = card_teacher(run.cfg)
    recorded = recorded_teacher(run, source) or {}
    digest = recorded.get("digest") if isinstance(recorded.get("digest"), str) else None
    return {
        "name": name,
        "hub_id": hub_id,
        "digest": digest,
        "boundary_ratio": run.spec.boundary_ratio,
        "pipeline": pipeline_name(run.spec.path),  # the diffusers class that samples it: I2V's takes the image
    }


def shape_warning(config: dict, tensors: dict, teacher_config: dict | None = None) -> str | None:
    """One line where a loader that guesses the shape from the weights would build this student wrong."""

    broken = loader_assumptions_broken(config, tensors)
    if not broken:
        return None
    keeps = KEEPS_WAN_SHAPE
    if teacher_config is not None and loader_assumptions_broken(teacher_config, {}):
        keeps += " (this teacher's own shape breaks them too: only a Wan teacher's students keep them)"
    return (
        f"ComfyUI (and any loader that guesses a Wan model's shape from its weights) would build this student "
        f"wrong: {'; '.join(broken)}; diffusers with config= loads it. The shapes that keep those guesses: {keeps}"
    )


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


# -- the writers ----------------------------------------------------------------------------------------------------
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
    intro = "These are single files, not a pipeline folder (the snippet above loads `--format diffusers`' export):"
    sections = files_section(listing, intro) + readme(files, workflow_file, comfy, exact, warning)
    write_in_run(out, "README.md", card + sections)
    return [out / f for f in files]


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


def write_diffusers(run, tmp: Path, out_name: str, checkpoint: str | None, dtype: str | None) -> Path:
    """The pipeline command's export, its transformer re-saved in `dtype` (diffusers keeps its fp32 modules)."""
    from diffusers import WanTransformer3DModel

    built = pipeline_export(run.path, tmp / out_name, checkpoint)
    if dtype not in (None, "fp32"):
        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        folder = check_tree(built, "transformer")  # the export's own folder, checked as every folder it reads
        model = WanTransformer3DModel.from_pretrained(folder, dtype=torch_dtype)
        for weights in folder.glob("*.safetensors*"):
            weights.unlink()
        model.save_pretrained(folder, safe_serialization=True)
        config = read_json_in(built, "transformer/config.json")
        config.pop("_name_or_path", None)
        write_in_run(built, "transformer/config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    listing = [
        (
            ".",
            "the whole pipeline: the student transformer with the teacher's tokenizer, text encoder, VAE and scheduler",
            f'pipe = {pipeline_name(run.spec.path)}.from_pretrained("PATH_OR_REPO")',
            "",
        ),
        (
            "transformer/",
            f"the student alone ({dtype or 'fp32'})",
            'transformer = WanTransformer3DModel.from_pretrained("PATH_OR_REPO", subfolder="transformer")',
            "",
        ),
    ]
    with open_in(built, "README.md", "a") as card:
        card.write(files_section(listing))
    return built


# -- a LoRA student's files (--format lora) ---------------------------------------------------------------------
def read_lora_student(run, source: Path) -> list[tuple[dict, dict]]:
    """(the adapters' state dict, peft keys without diffusers' `transformer.` prefix; their LoraConfig as saved)
    per expert of the teacher, from the run's `student/` (WEIGHTS: diffusers' files), read through the guard: a
    link out of the run is refused, a damaged file is one line."""

    out = []
    for name in WEIGHTS[: len(run.spec.experts)]:
        if not (source / name).is_file():
            raise UserError(
                f"the LoRA student in {source} has no {name} (one file per expert of the teacher); finish the run "
                "(trainer.resume=auto)"
            )
        problem = safetensors_problem(source / name, root=run.path)
        if problem:
            raise UserError(f"the LoRA student in {source}: {problem}; restore it from the run's backup")
        with opened(run.path, source / name) as path, safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            state = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}
        try:
            config = json.loads(meta.get("lora_adapter_metadata") or "{}")
        except ValueError:
            config = {}
        config = {k.removeprefix("transformer."): v for k, v in config.items()} if isinstance(config, dict) else {}
        out.append((state, config))
    return out


def lora_teacher(run, source: Path) -> dict:
    """The teacher the adapters belong to: its name, Hub id and weights digest as the run recorded them
    (adapters.json, else metrics.json), else the digest of the run's teacher now; a pair's boundary."""

    facts = teacher_facts(run, source)
    if not facts["digest"] and (source / ADAPTERS_JSON).is_file():
        try:
            saved = read_json_in(run.path, source / ADAPTERS_JSON, what="adapters.json")
        except ValueError:
            saved = {}
        recorded = saved.get("teacher") if isinstance(saved, dict) else None
        digest = recorded.get("digest") if isinstance(recorded, dict) else None
        facts["digest"] = digest if isinstance(digest, str) and len(digest) < 200 else None
    facts["digest"] = facts["digest"] or teacher_digest(run.spec)
    return facts


def copy_diffusers_lora(run, source: Path, out: Path, dtype: str) -> list[str]:
    """The student's adapters as diffusers wrote them, into `out` (what `load_lora_weights(out)` reads): each file
    copied byte for byte where it is already in `dtype`, else its tensors cast and saved with its metadata."""

    out.mkdir()
    names = list(WEIGHTS[: len(run.spec.experts)])
    for name in names:
        with opened(run.path, source / name) as path, safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
        if all(t.dtype == TORCH_DTYPES[dtype] for t in state.values()):
            with open_in(run.path, source / name) as f:
                write_in_run(out, name, write=lambda w: _copy(f, w))
        else:
            save_file({k: t.to(TORCH_DTYPES[dtype]).contiguous() for k, t in state.items()}, str(out / name), meta)
    return names


def _copy(src, dst) -> None:

    shutil.copyfileobj(src, dst, 2**24)


def write_lora_files(run, out: Path, name: str, dtype: str, workflow: str | None = None) -> list[Path]:
    """A LoRA student's export into `out`: the Lightning-layout files (one per expert), `diffusers/`, a few-step
    student's `scheduler/`, the ComfyUI workflow and README.md (the card, every file and the lines that load it)."""

    source = final_student(run, None)
    adapters = read_lora_student(run, source)
    facts, teacher = sampling_facts(run), lora_teacher(run, source)
    files = expert_names(name, len(adapters))
    for i, ((state, config), file) in enumerate(zip(adapters, files)):
        try:
            rank = adapter_rank(state)
            alpha = float(config.get("lora_alpha") or rank)
            tensors = lightning_tensors(state, alpha, dtype)
        except (ValueError, TypeError) as e:
            raise UserError(f"the LoRA student in {source}: {e}; restore it from the run's backup") from None
        expert = (
            {"expert": ("high_noise", "low_noise")[i], "boundary_ratio": teacher["boundary_ratio"]}
            if len(files) == 2
            else None
        )
        save_file(tensors, str(out / file), metadata=lora_metadata(rank, alpha, facts, teacher, expert))
    diffusers_files = copy_diffusers_lora(run, source, out / "diffusers", dtype)
    if facts["few_step"]:
        few_step_scheduler(run.spec, facts["steps"]).save_pretrained(out / "scheduler")
    comfy = comfy_sampling(run, facts, len(files), workflow)
    teacher_word = (saved_word(raw_value(run.cfg.teacher, "name")) or "wan").replace(".", "_")
    models, known = teacher_files(teacher["hub_id"], teacher_word, len(files))
    workflow_file = f"{name}.workflow.json"
    # A student distilled from a fine-tuned teacher samples on that teacher: its LoRAs chained before the student's.
    tuned = run_loras(run.path)
    under = [
        [(lora["file"], lora["strength"]) for lora in tuned if expert in lora["experts"]]
        for expert in ("transformer", "transformer_2")[: len(files)]
    ]
    write_in_run(out, workflow_file, workflow_text(models, comfy, loras=files, under=under))
    exact = ""
    if facts["few_step"]:
        exact = exact_line(facts)
    source_of = teacher["hub_id"] or "THE_TEACHER_FOLDER"
    torch_dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}[dtype]
    which = [""] if len(files) == 1 else [" (the high-noise expert's)", " (the low-noise expert's)"]
    listing = []
    for i, file in enumerate(files):
        into = ", load_into_transformer_2=True" if i == 1 else ""
        lines = (
            _lora_pipe_lines(source_of, torch_dtype, facts, pipeline_name(run.spec.path))
            + f'pipe.load_lora_weights("PATH_TO_THIS_FOLDER", weight_name="{file}"{into})'
        )
        listing.append(
            (
                file,
                f"the adapters{which[i]} in the Lightning layout (ComfyUI's, diffusers "
                f"converts it), {dtype}, rank {adapter_rank(adapters[i][0])}",
                lines if i == 0 else f'pipe.load_lora_weights("PATH_TO_THIS_FOLDER", weight_name="{file}"{into})',
                f"`{file}` into models/loras, then LoraLoaderModelOnly on the teacher's diffusion model "
                f"(`{models[i]}`); `{workflow_file}` does it",
            )
        )
    for i, file in enumerate(diffusers_files):
        into = f', weight_name="{file}", load_into_transformer_2=True' if i == 1 else ""
        listing.append(
            (
                f"diffusers/{file}",
                f"the same adapters{which[i]} as diffusers' `save_lora_weights` wrote them (peft's names), {dtype}",
                (_lora_pipe_lines(source_of, torch_dtype, facts, pipeline_name(run.spec.path)) if i == 0 else "")
                + f'pipe.load_lora_weights("PATH_TO_THIS_FOLDER/diffusers"{into})',
                "",
            )
        )
    if facts["few_step"]:
        what = f"the {facts['steps']}-step student's scheduler (diffusers)"
        if facts["schedule"] != "euler":
            what = f"diffusers' own {facts['steps']}-step Euler scheduler: close to the trained sigmas, not equal"
        listing.append(("scheduler/", what, "", ""))
    listing.append((workflow_file, "a ComfyUI workflow for the files above", "", "drop it on ComfyUI's canvas"))
    intro = (
        f"LoRA files for the teacher {teacher['name']} (weights digest `{teacher['digest']}`): on another teacher "
        "they mean nothing. The snippet above loads the run's pipeline folder (`python -m wandistiller.pipeline RUN "
        "--out DIR`); these files go on the teacher's own pipeline or diffusion model:"
    )
    section = lora_readme(files, models, known, teacher["name"], workflow_file, comfy, exact)
    if tuned:
        named = ", ".join(f"`{lora['file']}` at strength {lora['strength']:g}" for lora in tuned)
        section += (
            f"\nThese adapters were distilled from the teacher fine-tuned with {named} (`teacher.lora`): put "
            f"{'that file' if len(tuned) == 1 else 'those files'} into models/loras too; `{workflow_file}` chains a "
            "LoraLoaderModelOnly of each before the student's, as `load_lora_weights` with two adapter names and "
            "`set_adapters` do in diffusers.\n"
        )
    write_in_run(out, "README.md", run_card(run) + files_section(listing, intro) + section)
    return [out / f for f in files]


def _lora_pipe_lines(source: str, torch_dtype: str, facts: dict, pipeline: str = "WanPipeline") -> str:
    """The snippet's first lines: the teacher's pipeline (`pipeline`: an image-to-video teacher's is
    WanImageToVideoPipeline) and, for a few-step student, its scheduler from here."""
    lines = (
        f"import torch\nfrom diffusers import FlowMatchEulerDiscreteScheduler, {pipeline}\n"
        if facts["few_step"]
        else f"import torch\nfrom diffusers import {pipeline}\n"
    )
    lines += f'pipe = {pipeline}.from_pretrained("{source}", dtype={torch_dtype})\n'
    if facts["few_step"] and facts["schedule"] != "euler":  # a config cannot hold them: bound as the card says
        sigmas = [round(v, 8) for v in facts["sigmas"][:-1]]
        lines = lines.replace("import torch\n", "import functools\nimport torch\n")
        lines += (
            f"pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps={facts['num_train_timesteps']}, "
            "shift=1.0)  # shift 1: the trained sigmas as given\n"
            f"pipe.scheduler.set_timesteps = functools.partial(pipe.scheduler.set_timesteps, sigmas={sigmas})\n"
        )
    elif facts["few_step"]:
        lines += (
            'pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained("PATH_TO_THIS_FOLDER", '
            'subfolder="scheduler")\n'
        )
    return lines


def _lora(
    run, tmp: Path, checkpoint: str | None, dtype: str, name: str | None, fp8_layout: str, workflow: str | None
) -> Path:

    teacher_name = saved_word(raw_value(run.cfg.teacher, "name")) or "wan"
    name = name or f"{teacher_name}_lora_{dtype}".replace(".", "_")
    built = tmp / "export"
    built.mkdir()
    write_lora_files(run, built, name, dtype, workflow)
    return built


# Writers by format: (run, tmp folder, checkpoint, dtype, name, fp8 layout, workflow) -> the folder to rename into
# --out.
WRITERS: dict[str, Callable] = {}


def export(
    run_dir: Path,
    out: Path,
    fmt: str = "single-file",
    dtype: str | None = None,
    checkpoint: str | None = None,
    force: bool = False,
    name: str | None = None,
    fp8_layout: str | None = None,
    workflow: str | None = None,
) -> Path:
    """Write the run's student to `out` in `fmt`, whole or not at all. `fp8_layout`: --dtype fp8's layout
    (comfy_quant, the default, or scaled_fp8). `workflow`: the ComfyUI workflow's kind (state/comfy.py's WORKFLOWS;
    default the teacher's own)."""

    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if name is not None and (not re.fullmatch(r"[\w+-][\w.+-]{0,99}", name)):  # never a path out of --out
        raise UserError(f"--name {name!r} is not a plain file name; use letters, digits and ._+- (e.g. my_student)")
    if fp8_layout is not None and fp8_layout not in FP8_LAYOUTS:
        raise UserError(f"--fp8-layout {fp8_layout!r} is not one of {', '.join(FP8_LAYOUTS)}")
    if fp8_layout is not None and dtype != "fp8":
        raise UserError(f"--fp8-layout {fp8_layout} is for --dtype fp8 (single-file); drop it, or add --dtype fp8")
    register_configs()  # the registries' options, which the run's config may name
    run = open_run(run_dir)
    check_out(out, run.path, force)
    check_format(run, fmt, dtype)
    check_workflow(run, fmt, workflow)
    if is_lora_student(run) and checkpoint is not None:
        raise UserError(
            f"--checkpoint {checkpoint} with a LoRA student: its files are written from the run's final student/; "
            "drop --checkpoint (or finish the run: trainer.resume=auto)"
        )
    if is_lora_student(run) and fmt == "single-file":
        merged_teacher_at_hand(run)  # before any work
    if checkpoint in (None, "ema"):
        final_student(run, checkpoint)  # before any work
    dtype = dtype or DEFAULT_DTYPE[fmt]
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        with claimed(out) as unchanged, tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
            built = WRITERS[fmt](run, Path(tmp), checkpoint, dtype, name, fp8_layout or "comfy_quant", workflow)
            unchanged()
            _replace(out, built, Path(tmp))
    except OSError as e:  # a full disk, a quota
        raise UserError(
            f"--out {out}: the export could not be written ({e.strerror or e}); free some space or "
            "choose another folder (nothing was left there)"
        ) from None
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    log.info(
        "exported %s (%s, %s): %.1f MB in %.1f s",
        out,
        fmt,
        dtype or "as saved",
        size / 1e6,
        time.perf_counter() - start,
    )
    return out


@contextlib.contextmanager
def claimed(out: Path) -> Iterator[Callable[[], None]]:
    """`out` held by this export alone from its check to its final rename: made here when new (an empty folder, gone
    again if the export fails), locked (`flock` on the folder itself: a second export into it is refused at once),
    its entries noted. Yields the check made again just before the rename: `out` is still that folder with those
    entries, else nothing is replaced (another process wrote there meanwhile)."""
    made = False
    with contextlib.suppress(FileExistsError):
        out.mkdir()
        made = True
    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        raise UserError(f"--out {out} cannot be opened as a folder ({e.strerror}); choose a new folder") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(
            f"--out {out} is being written by another export; wait for it to finish, or choose another folder"
        ) from None
    inode, entries = os.fstat(fd).st_ino, sorted(os.listdir(fd))

    def unchanged() -> None:
        try:
            now = os.lstat(out).st_ino
            now_entries = sorted(os.listdir(out))
        except OSError:
            now, now_entries = None, []
        if now != inode or now_entries != entries:
            new = sorted(set(now_entries) - set(entries))[:3]
            raise UserError(
                f"--out {out} changed while this export ran (another process wrote there{': ' if new else ''}"
                f"{', '.join(new)}); nothing was replaced: look at it, then export again"
            )

    try:
        yield unchanged
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()  # only while still empty: whatever another process put there stays
        raise
    finally:
        os.close(fd)


def _replace(out: Path, built: Path, tmp: Path) -> None:
    """`built` takes `out`'s place: an empty folder (or, with --force, a full one) goes only once the export is
    whole, moved aside into the temporary folder first (removed with it)."""

    mask = _umask()  # a temporary folder's files are owner-only: give them what a plain write would
    for path in [built, *built.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
    if out.is_dir():
        os.rename(out, tmp / ".replaced")
    os.rename(built, out)


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


def _single_file(
    run, tmp: Path, checkpoint: str | None, dtype: str, name: str | None, fp8_layout: str, workflow: str | None
) -> Path:
    """The student's single file; a LoRA student's: the teacher with its adapters merged (W + alpha/rank B A, in
    float64, then fp32: what `pipeline --merge-lora` writes), one file per expert of a pair."""

    teacher_name = saved_word(raw_value(run.cfg.teacher, "name")) or "wan"
    if is_lora_student(run):
        source = final_student(run, None)
        experts = merged_experts(run.spec, source, run.cfg.student, torch.float32, torch.device("cpu"))
        name = name or f"{teacher_name}_lora_merged_{dtype}".replace(".", "_")
    else:
        student, source = read_student(run, checkpoint)
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
        comfy_sampling(run, facts, len(experts), workflow),
        run_card(run),
        run.spec.transformer_config,
        fp8_layout,
    )
    return built


def _diffusers(
    run, tmp: Path, checkpoint: str | None, dtype: str | None, name: str | None, fp8_layout: str, workflow: str | None
) -> Path:
    return write_diffusers(run, tmp, "export", checkpoint, dtype)


WRITERS.update({"single-file": _single_file, "diffusers": _diffusers, "lora": _lora})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m wandistiller.export", description=description(__doc__))
    parser.add_argument("run_dir", help="a run folder (outputs/<date>/<time>)")
    parser.add_argument("--format", required=True, choices=FORMATS, dest="fmt", help="what to write")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        help="the weights' dtype (default: bf16 for single-file, as "
        "saved (fp32) for diffusers, bf16 for lora); fp8: ComfyUI's fp8 (--fp8-layout), single-file only",
    )
    parser.add_argument("--out", required=True, help="a new folder (or an empty one; --force replaces a full one)")
    parser.add_argument("--force", action="store_true", help="replace --out if it holds files")
    parser.add_argument("--checkpoint", help="best, latest, step_N or ema (default: the final student)")
    parser.add_argument("--name", help="the single or LoRA files' name (default: <teacher>_<student>_<dtype>)")
    parser.add_argument(
        "--fp8-layout",
        choices=FP8_LAYOUTS,
        help="--dtype fp8's layout: comfy_quant (default: ComfyUI's per-layer quantization, the rest 16-bit) or "
        "scaled_fp8 (ComfyUI's legacy layout, for builds older than .comfy_quant)",
    )
    parser.add_argument(
        "--workflow",
        choices=list(WORKFLOWS),
        help="the ComfyUI workflow (single-file, lora): "
        + "; ".join(f"{k}: {v}" for k, v in WORKFLOWS.items())
        + " (default: the teacher's own; TI2V 5B takes both)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # unwinds: the temporary folder goes
    with internal_errors_reported(), exit_on_user_error():
        out = export(
            Path(args.run_dir),
            Path(args.out),
            args.fmt,
            args.dtype,
            args.checkpoint,
            args.force,
            args.name,
            args.fp8_layout,
            args.workflow,
        )
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
