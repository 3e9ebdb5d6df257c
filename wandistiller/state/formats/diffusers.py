"""`--format diffusers`, and `python -m wandistiller.pipeline RUN --out DIR`: the student as a whole diffusers
pipeline folder (`save_pretrained`, every file a real copy), what `push_to_hub` would upload; its transformer in
`--dtype` (default: as saved, fp32). A LoRA student's: the teacher's pipeline with the adapters beside it as diffusers
writes them, or merged into its transformers (`pipeline --merge-lora`; `--format diffusers` refuses a LoRA student)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from wandistiller.core.files import check_tree, open_in, read_json_in, write_in_run
from wandistiller.state.card import files_section, model_card
from wandistiller.state.checkpoint import load_checkpoint
from wandistiller.state.export import PIPELINE, SAMPLING, write_lora_pipeline, write_pipeline
from wandistiller.state.formats.base import ExportFormat, Request, final_student, is_lora_student
from wandistiller.state.runs import load_student, student_source
from wandistiller.student.lora import ADAPTERS_JSON, WEIGHTS, adapters_from, is_lora_folder, save_adapters
from wandistiller.teacher.model import load_expert
from wandistiller.teacher.spec import pipeline_name


def _build_lora(run, tmp: Path, source: Path, merge: bool, phrases) -> Path:
    """A LoRA student's export: the teacher's pipeline (`save_pretrained`, real copies) with the adapters beside it
    as diffusers writes them, or (`merge`) with them merged into its transformers (W + alpha/rank B A)."""
    from diffusers import DiffusionPipeline

    if not is_lora_folder(source):  # a checkpoint: its adapters written as a student/ folder first
        experts = [load_expert(run.spec, name, torch.float32) for name in run.spec.experts]
        state = load_checkpoint(source)["student"]
        save_adapters(tmp / "student", adapters_from(source, run.cfg.student, experts, state))
        source = tmp / "student"
    card = model_card(run.path, run.spec.path, merged=merge, phrases=phrases)
    root = run.path if source.is_relative_to(run.path) else source  # the run's, or the folder written here
    folder = write_lora_pipeline(
        tmp / PIPELINE,
        run.spec.path,
        source,
        card,
        run.trained_steps,
        schedule=run.trained_schedule,
        loras=[lora.public() for lora in run.spec.loras],
        finetuned=run.spec if run.spec.loras else None,  # the fine-tuned teacher the adapters were trained on
        root=root,
    )
    # The class the folder's model_index.json names: an image-to-video teacher's pipeline keeps its image parts
    pipe = DiffusionPipeline.from_pretrained(folder)
    experts = [pipe.transformer] + ([pipe.transformer_2] if getattr(pipe, "transformer_2", None) is not None else [])
    if merge:
        for expert, adapters in zip(experts, adapters_from(source, run.cfg.student, experts, root=root)):
            adapters.merge_into(expert)
    built = tmp / "export"
    pipe.save_pretrained(built, safe_serialization=True)
    shutil.copy2(folder / "README.md", built / "README.md")
    for name in () if merge else (*WEIGHTS, ADAPTERS_JSON):
        if (folder / name).is_file():
            shutil.copy2(folder / name, built / name)
    if (folder / "transformer" / SAMPLING).is_file():
        shutil.copy2(folder / "transformer" / SAMPLING, built / "transformer" / SAMPLING)
    _drop_local_paths(built)
    return built


def _drop_local_paths(built: Path) -> None:
    """diffusers records where it loaded from: this machine's temporary path, dropped from every config."""
    for config in built.rglob("*.json"):
        name = config.relative_to(built)
        body = read_json_in(built, name)
        if isinstance(body, dict) and body.pop("_name_or_path", None) is not None:
            write_in_run(built, name, json.dumps(body, indent=2, sort_keys=True) + "\n")


def _build(run, tmp: Path, student, phrases) -> Path:
    """The export in `tmp`/export, from the pipeline folder assembled in `tmp`/pipeline."""
    from diffusers import DiffusionPipeline

    if not isinstance(student, Path):
        student.save_pretrained(tmp / "student")
        student = tmp / "student"
    root = run.path if student.is_relative_to(run.path) else student  # the received run's, or the one saved here
    folder = write_pipeline(
        tmp / PIPELINE,
        run.spec.path,
        student,
        model_card(run.path, run.spec.path, phrases=phrases),
        run.trained_steps,
        root,
        schedule=run.trained_schedule,
        loras=[lora.public() for lora in run.spec.loras],
    )
    built = tmp / "export"
    # The class the folder's model_index.json names (an image-to-video teacher's, with its image parts)
    DiffusionPipeline.from_pretrained(folder).save_pretrained(built, safe_serialization=True)
    shutil.copy2(folder / "README.md", built / "README.md")
    if (folder / "transformer" / SAMPLING).is_file():  # a few-step student's K and timesteps, which diffusers drops
        shutil.copy2(folder / "transformer" / SAMPLING, built / "transformer" / SAMPLING)
    for config in built.rglob("*.json"):  # diffusers records where it loaded from: this machine's temporary path
        body = read_json_in(built, config)
        if isinstance(body, dict) and body.pop("_name_or_path", None) is not None:
            write_in_run(built, config, json.dumps(body, indent=2, sort_keys=True) + "\n")
    return built


def pipeline_student(run, checkpoint: str | None):
    """The student a pipeline folder is built from, read before anything is written (a damaged one is one line):
    `student_ema/`'s folder (`final_student`'s, refused where there is none), a LoRA student's adapters folder, else
    its final or a checkpoint's WanTransformer3DModel."""
    if checkpoint == "ema":
        return final_student(run, "ema")
    source = student_source(run, checkpoint)
    return source if is_lora_student(run) else load_student(run, source, torch.device("cpu"))


def pipeline_folder(run, tmp: Path, student, merge: bool, phrases) -> Path:
    """The pipeline's export built in `tmp` (its `export/`) from `pipeline_student`'s student. `merge`: a LoRA
    student's adapters merged into its transformers; `phrases`: what each method taught its student (the card)."""
    if is_lora_student(run):
        return _build_lora(run, tmp, student, merge, phrases)
    return _build(run, tmp, student, phrases)


def write_diffusers(run, tmp: Path, request: Request) -> Path:
    """The pipeline command's export, its transformer re-saved in `dtype` (diffusers keeps its fp32 modules)."""
    from diffusers import WanTransformer3DModel

    dtype = request.dtype
    built = pipeline_folder(run, tmp, pipeline_student(run, request.checkpoint), False, request.phrases)
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


def refusal(run) -> str | None:
    if is_lora_student(run):
        return (
            f"--format diffusers: the student of {run.path} is a LoRA (adapters on its teacher, not a transformer of "
            "its own); export it with --format lora, --format single-file (merged into the teacher), or "
            "python -m wandistiller.pipeline RUN --out DIR --merge-lora"
        )
    return None


FORMAT = ExportFormat(
    "diffusers",
    ("bf16", "fp16", "fp32"),
    None,
    "a diffusers folder takes --dtype bf16, fp16 or fp32",
    False,
    refusal,
    write_diffusers,
    order=0,
    named=False,
)
