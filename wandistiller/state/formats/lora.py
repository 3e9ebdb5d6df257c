"""`--format lora`: a LoRA student's adapters (student=lora; refused for any other student): `<name>.safetensors` (an
A14B pair: `<name>_high_noise` / `<name>_low_noise`) in the Lightning layout ComfyUI's LoraLoader and diffusers'
`load_lora_weights` read (state/loralayout.py), `diffusers/` with the files diffusers' `save_lora_weights` wrote (the
student's own, copied or cast), a few-step student's `scheduler/`, `<name>.workflow.json` (the teacher's diffusion
model, LoraLoaderModelOnly, the few-step sampler) and README.md."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from wandistiller.core.errors import UserError
from wandistiller.core.files import in_run, open_in, opened, read_json_in, write_in_run
from wandistiller.core.tensor_files import safetensors_problem
from wandistiller.state.card import files_section
from wandistiller.state.checkpoint import teacher_digest
from wandistiller.state.comfy import (
    lora_readme,
    teacher_files,
    workflow_text,
)
from wandistiller.state.formats.base import (
    ExportFormat,
    Request,
    comfy_sampling,
    exact_line,
    final_student,
    is_lora_student,
    run_card,
    sampling_facts,
    saved_name,
    teacher_facts,
)
from wandistiller.state.loralayout import adapter_rank, lightning_tensors
from wandistiller.state.loralayout import metadata as lora_metadata
from wandistiller.state.saved import raw_value, run_loras, saved_word
from wandistiller.state.singlefile import DTYPES as TORCH_DTYPES
from wandistiller.state.singlefile import (
    expert_names,
)
from wandistiller.student.lora import ADAPTERS_JSON, WEIGHTS
from wandistiller.teacher.fewstep import few_step_scheduler
from wandistiller.teacher.spec import pipeline_name


def read_lora_student(run, source: Path) -> list[tuple[dict, dict]]:
    """(the adapters' state dict, peft keys without diffusers' `transformer.` prefix; their LoraConfig as saved)
    per expert of the teacher, from the run's `student/` (WEIGHTS: diffusers' files), read through the guard: a
    link out of the run is refused, a damaged file is one line."""

    out = []
    for name in WEIGHTS[: len(run.spec.experts)]:
        in_run(run.path, source / name)  # a link out (a dangling one too) is named as such, not as missing
        if not (source / name).is_file():
            raise UserError(
                f"the LoRA student in {source} has no {name} (one file per expert of the teacher); finish the run "
                "(trainer.resume=auto)"
            )
        problem = safetensors_problem(source / name, root=run.path)
        if problem:
            raise UserError(f"the LoRA student in {source}: {problem}; restore it from a copy of the run")
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


def write_lora_files(
    run, out: Path, name: str, dtype: str, workflow: str | None = None, phrases: Mapping[str, str] | None = None
) -> list[Path]:
    """A LoRA student's export into `out`: the Lightning-layout files (one per expert), `diffusers/`, a few-step
    student's `scheduler/`, the ComfyUI workflow and README.md (the card, every file and the lines that load it)."""

    source = final_student(run, None)
    adapters = read_lora_student(run, source)
    facts, teacher = sampling_facts(run), lora_teacher(run, source)
    files = expert_names(name, len(adapters))
    _write_adapters(out, adapters, files, source, dtype, facts, teacher)
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
    listing = _listing(run, files, diffusers_files, adapters, models, workflow_file, facts, dtype, teacher)
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
    write_in_run(out, "README.md", run_card(run, phrases or {}) + files_section(listing, intro) + section)
    return [out / f for f in files]


def _write_adapters(out: Path, adapters: list, files: list[str], source: Path, dtype: str, facts: dict, teacher: dict):
    """Each expert's adapters as one Lightning-layout file, its metadata the sampling and the teacher (a pair's
    expert and boundary); a damaged adapter is one line."""
    for i, ((state, config), file) in enumerate(zip(adapters, files)):
        try:
            rank = adapter_rank(state)
            alpha = float(config.get("lora_alpha") or rank)
            tensors = lightning_tensors(state, alpha, dtype)
        except (ValueError, TypeError) as e:
            raise UserError(f"the LoRA student in {source}: {e}; restore it from a copy of the run") from None
        expert = (
            {"expert": ("high_noise", "low_noise")[i], "boundary_ratio": teacher["boundary_ratio"]}
            if len(files) == 2
            else None
        )
        save_file(tensors, str(out / file), metadata=lora_metadata(rank, alpha, facts, teacher, expert))


def _listing(run, files, diffusers_files, adapters, models, workflow_file: str, facts: dict, dtype: str, teacher: dict):
    """The README's table of a LoRA export's files: each one, what it is, the diffusers lines and the ComfyUI steps
    that load it."""
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
    return listing


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


def _lora(run, tmp: Path, request: Request) -> Path:
    teacher_name = saved_word(raw_value(run.cfg.teacher, "name")) or "wan"
    dtype = request.dtype or "bf16"  # the format's default, where none was asked
    name = request.name or f"{teacher_name}_lora_{dtype}".replace(".", "_")
    built = tmp / "export"
    built.mkdir()
    write_lora_files(run, built, name, dtype, request.workflow, request.phrases)
    return built


def refusal(run) -> str | None:
    if not is_lora_student(run):
        return (
            f"--format lora: the student of {run.path} is not a LoRA (student.builder="
            f"{saved_name(run.cfg.student, 'builder')}); export it with --format single-file or diffusers"
        )
    return None


FORMAT = ExportFormat(
    "lora",
    ("bf16", "fp16", "fp32"),
    "bf16",
    "LoRA files take --dtype bf16, fp16 or fp32 (adapters are small: no loader reads fp8 ones)",
    True,
    refusal,
    _lora,
    order=2,
)
