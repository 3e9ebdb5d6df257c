"""A run folder's `pipeline/`: the student transformer beside the teacher's tokenizer, text encoder, VAE and
scheduler, with a model card, which `WanPipeline.from_pretrained` loads in one call. Written at the end of
every run (recipe/outputs.py) and by `python -m wandistiller.pipeline` (its export to a folder of real files).
Files are hard links where the filesystem allows (no extra disk, even for a 14B teacher's 11 GB text encoder);
on another filesystem small files are copied and large ones symlinked (a documented reference).

A few-step student (`method.steps` = K in the run's saved config) carries its step count: the pipeline's
`scheduler/` is its few-step scheduler (teacher/fewstep.py) rather than the teacher's, so
`WanPipeline.from_pretrained(...)(prompt, num_inference_steps=K, guidance_scale=1.0)` samples on its own
timesteps; `student/sampling.json` (and the pipeline's `transformer/sampling.json`) state K, its timesteps and
sigmas, and the model card says them. That scheduler is K's: at another count diffusers stretches its schedule
to end at K's last point (at 1 step, 0 / 0: NaN), so the card shows how to rebuild the n-step one with diffusers
alone (`other_steps`), as `eval`/`generate --student-steps n` do. A KD student's export is as before.

An image-to-video teacher's student is that teacher's own pipeline: its model_index.json (WanImageToVideoPipeline, or
TI2V 5B's WanPipeline with expand_timesteps) and, for Wan 2.1 I2V, its image encoder and processor; the card's snippet
loads it with WanImageToVideoPipeline and passes the clip's first frame (`PIPELINES`).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from wandistiller.core.arch import Layout
from wandistiller.core.errors import UserError, counted, human_count
from wandistiller.core.files import check_tree, in_run, open_in, read_json_in, replace_folder, write_in_run
from wandistiller.core.hydra import shipped_asset
from wandistiller.data.sources import sources
from wandistiller.state.checkpoint import teacher_digest
from wandistiller.state.received import load_yaml_config
from wandistiller.state.runs import image_scale, student_schedule_of, student_steps, time_scale
from wandistiller.student.lora import ADAPTERS_JSON, WEIGHTS, is_lora, is_lora_folder
from wandistiller.teacher.fewstep import Schedule, few_step_scheduler, student_schedule
from wandistiller.teacher.model import save_finetuned_expert
from wandistiller.teacher.spec import TeacherSpec, inspect_teacher

log = logging.getLogger("wandistiller.pipeline")

PIPELINE = "pipeline"
TEACHER_PARTS = ("tokenizer", "text_encoder", "vae", "scheduler")
# Wan 2.1 I2V's CLIP vision tower and its processor: the image-to-video pipeline encodes the given image with them, so
# a student of that teacher needs them beside it (teachers without them name them [null, null] or not at all).
IMAGE_PARTS = ("image_encoder", "image_processor")
SAMPLING = "sampling.json"  # a few-step student's K, timesteps and sigmas, in its folder


COPY_LIMIT = 2**30  # larger files that cannot be hard-linked are referenced (symlinked), not copied


def place(src: Path, dst: Path, root: Path | None = None) -> str:
    """`dst` as a hard link to `src` (a Hub cache's symlink followed to its blob); on another filesystem a
    copy, or for a file over COPY_LIMIT (a 14B teacher's text encoder) a symlink: every run would otherwise
    hold its own 11+ GB. The export (`--out`) always writes real files.

    `root`: the folder `src` was received in (a run's student/): `src` is opened through the guard (core.files), a
    link out of it refused, and `dst` is a hard link to (or a copy of) the file the guard opened -- never a link to
    whatever the name points at by then; never a symbolic link. None: the user's own teacher's file."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.unlink(missing_ok=True)
    if root is not None:
        return _place_guarded(root, src, dst)
    real = src.resolve()
    try:
        os.link(real, dst)
        return "linked"
    except OSError:  # another filesystem, or one without hard links
        if real.stat().st_size > COPY_LIMIT:
            os.symlink(real, dst)
            return "referenced"
        shutil.copy2(real, dst)
        return "copied"


def _place_guarded(root: Path, src: Path, dst: Path) -> str:
    """`dst` as a hard link to the file the guard opened at `src` (its device and inode compared after linking: a
    name swapped meanwhile is undone), else a copy of what the guard opened."""

    with open_in(root, src) as f:
        opened = os.fstat(f.fileno())
        try:  # the resolved name (no link followed), then checked: the new name must be the opened file's
            os.link(os.path.realpath(src), dst, follow_symlinks=False)
            made = os.stat(dst, follow_symlinks=False)
            if (made.st_dev, made.st_ino) == (opened.st_dev, opened.st_ino):
                return "linked"
            dst.unlink()
        except OSError:  # another filesystem, or one without hard links
            pass
        write_in_run(dst.parent, dst.name, write=lambda out: shutil.copyfileobj(f, out, 2**24))
    return "copied"


def run_pipeline(
    run_dir: Path, teacher_path: Path, phrases: Mapping[str, str] | None = None, spec: TeacherSpec | None = None
) -> Path:
    """`<run>/pipeline/`: the run's final student in the teacher's WanPipeline, with its model card; a few-step
    student's `student/sampling.json` first (its K read from the run's saved config). `spec`: the run's teacher, its
    LoRAs (teacher.lora) with it: a LoRA student's pipeline holds that fine-tuned teacher."""

    # The run's own teacher read once (preflight's spec), not again for the card and the log line.
    layout = spec.layout if spec is not None else teacher_layout(teacher_path)
    student, card = in_run(run_dir, "student"), model_card(run_dir, teacher_path, phrases=phrases, layout=layout)
    steps, schedule, loras = saved_steps(run_dir), saved_schedule(run_dir), run_loras(run_dir)
    if steps is not None:  # written whole, never through a link in its place
        write_in_run(student, SAMPLING, json.dumps(sampling(teacher_path, steps, schedule, loras), indent=2))
    # Written whole into a new folder that takes the old one's place: a received run's `pipeline/` that is a link
    # (or holds links) is replaced, never written through.
    if is_lora_folder(student):  # a LoRA student: the teacher's own pipeline (fine-tuned: with its LoRAs merged)
        finetuned = spec if spec is not None and spec.loras else None
        write: Callable[..., Path] = functools.partial(write_lora_pipeline, finetuned=finetuned)
    else:
        write = write_pipeline
    out = replace_folder(
        run_dir, PIPELINE, lambda tmp: write(tmp, teacher_path, student, card, steps, schedule=schedule, loras=loras)
    )
    log.info("student pipeline: %s (%s.from_pretrained loads it in one call)", out, PIPELINES[layout])
    return out


def write_pipeline(
    out: Path,
    teacher_path: Path,
    student_dir: Path,
    card: str,
    steps: int | None = None,
    student_root: Path | None = None,
    schedule: Schedule | None = None,
    loras: Sequence[dict] = (),
) -> Path:
    """A WanPipeline folder: `student_dir` as its transformer, the teacher's other parts, `card` as README.md. A
    few-step student (`steps` = K) has its few-step scheduler in place of the teacher's, and its sampling.json.
    `student_root`: the run folder `student_dir` lies in (default the folder itself): its files are placed through
    the guard (`place`), a link out of it refused."""

    how = set()
    check_tree(student_root or student_dir, student_dir)  # before anything is placed: a link out is one line
    for part, src in [("transformer", student_dir)] + [(p, teacher_path / p) for p in teacher_parts(teacher_path)]:
        if not src.is_dir():
            raise UserError(
                f"{src} is missing: the teacher folder has no {part}/; a {folder_class(teacher_path)} needs one"
            )
        if steps is not None and part == "scheduler":
            continue
        for file in sorted(f for f in src.rglob("*") if f.is_file()):
            if steps is not None and part == "transformer" and file == src / SAMPLING:
                continue  # written below, its own file (never a link to the student's)
            root = (student_root or student_dir) if part == "transformer" else None  # the teacher's: the user's own
            how.add(place(file, out / part / file.relative_to(src), root))
    if steps is not None:
        few_step_scheduler(inspect_teacher(teacher_path), steps).save_pretrained(out / "scheduler")
        facts = sampling(teacher_path, steps, schedule, loras)
        write_in_run(out, f"transformer/{SAMPLING}", json.dumps(facts, indent=2))
    write_in_run(out, "model_index.json", json.dumps(model_index(teacher_path, steps), indent=2))
    write_in_run(out, "README.md", card)
    if "referenced" in how:  # the folder then depends on the teacher's files staying where they are
        log.info(
            "pipeline %s: the teacher's large files are symlinks to %s (another filesystem); "
            "python -m wandistiller.pipeline RUN --out DIR writes a self-contained copy",
            out,
            teacher_path,
        )
    return out


def write_lora_pipeline(
    out: Path,
    teacher_path: Path,
    student_dir: Path,
    card: str,
    steps: int | None = None,
    schedule: Schedule | None = None,
    loras: Sequence[dict] = (),
    finetuned: TeacherSpec | None = None,
) -> Path:
    """A LoRA student's WanPipeline folder (student=lora): the teacher's own pipeline (its transformer, and
    transformer_2 of a pair, as they are), the adapters beside it as diffusers writes them (`pytorch_lora_weights
    .safetensors`, `..._transformer_2.safetensors`: `pipe.load_lora_weights(folder)` loads them), its adapters.json,
    a few-step student's scheduler and sampling.json, and `card` as README.md. `finetuned`: the teacher with the
    LoRAs it was fine-tuned with (teacher.lora), whose experts are written merged (the adapters' own base)."""

    index = teacher_index(teacher_path)
    parts = [
        p
        for p in ("transformer", "transformer_2", *TEACHER_PARTS, *IMAGE_PARTS)
        if isinstance(index.get(p), list) and index[p][0] is not None
    ]
    for part in parts:
        if steps is not None and part == "scheduler":
            continue
        src = teacher_path / part
        if not src.is_dir():
            raise UserError(
                f"{src} is missing: the teacher folder has no {part}/; a {folder_class(teacher_path)} needs one"
            )
        if finetuned is not None and any(part in lora.experts for lora in finetuned.loras):
            save_finetuned_expert(finetuned, part, out / part)  # the fine-tuned teacher the adapters were trained on
            continue
        for file in sorted(f for f in src.rglob("*") if f.is_file()):
            place(file, out / part / file.relative_to(src))
    for name in (*WEIGHTS, ADAPTERS_JSON):
        if (student_dir / name).is_file():  # through the guard: a received student's link out of it is refused
            place(student_dir / name, out / name, student_dir)
    if steps is not None:
        few_step_scheduler(inspect_teacher(teacher_path), steps).save_pretrained(out / "scheduler")
        facts = sampling(teacher_path, steps, schedule, loras)
        write_in_run(out, f"transformer/{SAMPLING}", json.dumps(facts, indent=2))
        index |= {"scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    write_in_run(out, "model_index.json", json.dumps(index, indent=2))
    write_in_run(out, "README.md", card)
    return out


def teacher_index(teacher_path: Path) -> dict:
    """The teacher's own model_index.json (the user's teacher, not a received folder's file)."""
    return json.loads((teacher_path / "model_index.json").read_text())


def teacher_parts(teacher_path: Path) -> tuple[str, ...]:
    """The teacher's parts a student's pipeline holds beside it: the text and VAE parts, and the image encoder and
    its processor where the teacher's model_index.json names them (Wan 2.1 I2V)."""
    index = teacher_index(teacher_path) if (teacher_path / "model_index.json").is_file() else {}
    named = tuple(p for p in IMAGE_PARTS if isinstance(index.get(p), list) and index[p][0] is not None)
    return TEACHER_PARTS + named


def folder_class(teacher_path: Path) -> str:
    """The pipeline class the teacher's model_index.json names (a missing part's line says it); WanPipeline if none."""
    index = teacher_index(teacher_path) if (teacher_path / "model_index.json").is_file() else {}
    return _word(index.get("_class_name")) or "WanPipeline"


# The diffusers pipeline a student of each layout samples with: an image-to-video teacher's takes the given image.
# TI2V 5B's own folder names WanPipeline (text to video); diffusers gives it an image through WanImageToVideoPipeline,
# so its folder keeps its own model_index.json and the card loads it with that class.
PIPELINES = {Layout.t2v: "WanPipeline", Layout.i2v: "WanImageToVideoPipeline", Layout.ti2v: "WanImageToVideoPipeline"}


def pipeline_name(teacher_path: Path | None) -> str:
    """The diffusers pipeline class that samples a student of this teacher (`PIPELINES`); WanPipeline without one."""
    return PIPELINES[teacher_layout(teacher_path)]


def teacher_layout(teacher_path: Path | None) -> Layout:
    """The teacher's layout (what its experts take besides noise and text), read off its configs; t2v without one."""
    return inspect_teacher(teacher_path).layout if teacher_path is not None else Layout.t2v


def model_index(teacher_path: Path, steps: int | None = None) -> dict:
    """The teacher's model_index.json, one expert and no boundary: the student is a single transformer; a few-step
    student's (`steps`) scheduler is its few-step FlowMatchEulerDiscreteScheduler."""
    index = teacher_index(teacher_path)  # an image-to-video teacher's class and image parts kept: the student's too
    few_step = {"scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]} if steps is not None else {}
    return (
        index
        | {"transformer": ["diffusers", "WanTransformer3DModel"], "transformer_2": [None, None], "boundary_ratio": None}
        | few_step
    )


def saved_steps(run_dir: Path) -> int | None:
    """The run's student's step count K from its saved config (`method.steps`); None for a KD student."""

    cfg = load_yaml_config(run_dir / ".hydra" / "config.yaml", root=run_dir)  # through the guard, its size bounded
    return student_steps(cfg) if isinstance(cfg, DictConfig) else None


def saved_schedule(run_dir: Path) -> Schedule:
    """The run's few-step student's schedule from its saved config (`method.schedule`, `method.shift`)."""

    cfg = load_yaml_config(run_dir / ".hydra" / "config.yaml", root=run_dir)  # through the guard, its size bounded
    return student_schedule_of(cfg) if isinstance(cfg, DictConfig) else Schedule()


def sampling(teacher_path: Path, steps: int, schedule: Schedule | None = None, loras: Sequence[dict] = ()) -> dict:
    """What `sampling.json` states of a K-step student: its steps, the schedule it was trained at (`schedule`),
    its timesteps and sigmas, and no CFG. Where that schedule is not diffusers' Euler, the saved scheduler (which
    only that one can be set to) samples other sigmas at num_inference_steps=K: `scheduler_sigmas` says which.
    `loras`: the LoRAs its teacher was fine-tuned with (`run_loras`), named as `teacher_loras`."""
    spec = inspect_teacher(teacher_path)
    schedule = schedule or Schedule()
    timesteps, sigmas = student_schedule(spec, steps, schedule)
    facts = {
        "steps": steps,
        "schedule": schedule.record(),
        "shift": schedule.shift if schedule.shift is not None else spec.flow_shift,
        "timesteps": [round(t, 4) for t in timesteps.tolist()],
        "sigmas": [round(s, 6) for s in sigmas.tolist()],
        "guidance_scale": 1.0,
        "scheduler": "FlowMatchEulerDiscreteScheduler",
    }
    if schedule.name != "euler":
        facts["scheduler_sigmas"] = [round(s, 6) for s in student_schedule(spec, steps)[1].tolist()]
    if loras:
        facts["teacher_loras"] = list(loras)
    return facts


SHA256 = re.compile(r"[0-9a-f]{64}")


def run_loras(run_dir: Path) -> list[dict]:
    """The LoRAs the run's teacher was fine-tuned with (teacher.lora), as metrics.json names them: each one's file
    name, strength, experts and sha256, read as data (a name that is not a plain word is left out); [] for none."""
    try:
        m = read_json_in(run_dir, "metrics.json", what="metrics.json") if (run_dir / "metrics.json").is_file() else {}
    except ValueError:
        return []
    found = m.get("teacher_loras") if isinstance(m, dict) else None
    out: list[dict] = []
    for r in found if isinstance(found, list) else []:
        if not isinstance(r, dict):
            continue
        experts = r.get("experts")
        experts = experts if isinstance(experts, list) else []
        sha = r.get("sha256") if isinstance(r.get("sha256"), str) and SHA256.fullmatch(r["sha256"]) else None
        out.append(
            {
                "file": _word(r.get("file")) or "?",
                "strength": _number(r.get("strength")),
                "experts": [e for e in experts if e in ("transformer", "transformer_2")],
                "sha256": sha,
            }
        )
    return out


SHIPPED = "${wd_assets:"  # a shipped asset's path in a saved config (a teacher, its prompts, its images)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
WORD = re.compile(r"[\w.+ -]{1,100}")


def _raw(node, key: str):
    """`node.key` as saved, never resolved: a received config's `${oc.env:HF_TOKEN}` stays unread."""
    saved = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else None
    return saved.get(key) if isinstance(saved, dict) else None


def _number(value) -> float | None:
    """A figure for the card: a finite int or float, else None (a string of a received file is no figure)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None


def _word(value) -> str | None:
    """A name safe on one line of the card: letters, digits and ._+- only (no newline, no markup)."""
    return value if isinstance(value, str) and WORD.fullmatch(value) else None


def _last_part(raw: str) -> str | None:
    """A saved path's last part, where it is a plain name (no folder of this machine); None for an
    interpolation, which is not evaluated (it may read the environment)."""
    return _word(Path(raw).name) if "${" not in raw else None


def _named(raw, what: str) -> str:
    """A path of the config as the card names it: shipped, or by its last part alone."""
    if raw is None:
        return f"the shipped {what}"
    if str(raw).startswith(SHIPPED):
        return f"the {what} shipped with WanDistiller"
    return f"`{_last_part(str(raw))}`" if _last_part(str(raw)) else f"your {what}"


def card_teacher(cfg: DictConfig) -> tuple[str, str | None]:
    """(how the card names the teacher, its Hub id or None): a Hub id, "pocket (shipped)", the built-in tiny
    teacher, or a local folder by its name; never a path of this machine or an evaluated resolver."""
    raw, name = str(_raw(cfg.teacher, "path")), _word(_raw(cfg.teacher, "name")) or "teacher"
    if raw.startswith(SHIPPED):
        return f"{name} (shipped)", None
    if raw.startswith("${paths.cache_dir}/teachers/"):
        return f"{name} (built-in, random weights)", None
    if HUB_ID.fullmatch(raw) and not Path(raw).expanduser().exists():
        return raw, raw
    return (f"{_last_part(raw)} (a local folder)" if _last_part(raw) else "a local folder"), None


def card_method(cfg: DictConfig) -> dict:
    """The method the student was trained with, as the saved config says (`method.name`; no `method` node: a
    pre-release run, kd): its name, and DMD's regression term's weight where it has one."""
    method = cfg.get("method") if isinstance(cfg, DictConfig) else None
    name = _word(_raw(method, "name")) if method is not None else "kd"
    regression = _number(_raw(method, "regression_weight")) if method is not None else None
    return {"name": name or "?", "regression": regression or None}


def _method_text(f: dict) -> str:
    """The card's phrase on what the student learned: its method's own (`Method.card_phrase`, handed down by the
    caller as `phrases`), or a plain one naming a method this process has no phrase for."""
    g = f["guidance"] if f["guidance"] is not None else "?"
    name, k = f["method"]["name"], f["steps"]
    plain = (
        "the student transformer was trained with the method `{name}` against the teacher's classifier-free-guided "
        "predictions (guidance scale {g})"
    )
    text = f["phrases"].get(name, plain).format(k=k if k is not None else "?", g=g, name=name)
    if f["method"]["regression"]:
        text += f", with trajectory's regression term (weight {f['method']['regression']:.3g})"
    return text


def model_card(
    run_dir: Path,
    teacher_path: Path | None = None,
    merged: bool = False,
    phrases: Mapping[str, str] | None = None,
    layout: Layout | None = None,
) -> str:
    """README.md for the pipeline: the teacher, the data, the training, the quality figures (metrics.json).
    Portable: nothing of this machine, no resolver evaluated, no text of a received file but figures. `merged`: a
    LoRA student's adapters merged into its transformers (`python -m wandistiller.pipeline --merge-lora`).
    `phrases`: what each method taught its student (recipe/methods' `card_phrases()`, from the caller); `layout`:
    the teacher's, where the caller has read it (else read off `teacher_path`)."""

    cfg = load_yaml_config(run_dir / ".hydra" / "config.yaml", root=run_dir)  # through the guard: never a link out
    if not isinstance(cfg, DictConfig):  # the run's own config, written by this project: a mapping
        raise UserError(f"{run_dir}/.hydra/config.yaml is not a saved config; restore it")
    try:  # a linked metrics.json (another run's figures) is refused in one line, never quoted
        m = read_json_in(run_dir, "metrics.json", what="metrics.json") if (run_dir / "metrics.json").is_file() else {}
    except ValueError:
        raise UserError(f"{run_dir}/metrics.json is not JSON; restore it from the run's backup") from None
    m = m if isinstance(m, dict) else {}
    d, t = cfg.data, cfg.trainer
    source = sources().get(str(_raw(d, "latents")), sources()["gaussian"]).description
    images, prompts = _raw(d, "root") or _raw(d, "dataset"), saved_prompts(cfg)
    steps = _number(m.get("steps_run")) or _number(_raw(t, "max_steps"))
    batch = _number(m.get("batch_size")) or _number(_raw(t, "batch_size"))
    params = _number(m.get("student_params_m"))
    few_step = student_steps(cfg) is not None
    # val_loss_best is a KD student's velocity error: the run itself calls it meaningless for a few-step student
    # (no checkpoints/best/), so its card does not quote it
    names = ("eval_latent_mse", "eval_psnr", "eval_ssim", "eval_speedup", *(() if few_step else ("val_loss_best",)))
    figures = [(k, _number(m.get(k))) for k in names]
    facts = {
        "teacher": card_teacher(cfg),
        "data": f"{source} ({_named(images, 'images')})" if images else source,  # a folder only an image source reads
        "prompts": _named(prompts, "prompts"),
        "training": (f"{steps:.0f} steps, batch {batch:.0f}" if steps and batch else "?")
        + (f", precision {m['precision']}" if _word(m.get("precision")) else ""),
        "latent": [int(_number(_raw(d, k)) or 0) for k in ("latent_height", "latent_width")],
        "scale": image_scale(teacher_path),
        # pixel frames of a clip run ((latent frames - 1) x the VAE's time factor + 1); 1 for an image run
        "frames": (int(_number(_raw(d, "latent_frames")) or 1) - 1) * time_scale(teacher_path) + 1,
        "tokens": int(_number(_raw(cfg.teacher, "max_sequence_length")) or 512),
        "guidance": _number(_raw(cfg.teacher, "guidance_scale")),
        "seed": _number(_raw(cfg, "seed")),
        "params": human_count(round(params * 1e6)) if params else "?",
        "rows": "\n".join(f"| `{k}` | {v:.4g} |" for k, v in figures if v is not None),
        "steps": (k := student_steps(cfg)),
        "method": card_method(cfg),
        "phrases": dict(phrases or {}),
        "prompt": example_prompt(prompts),
        "teacher_loras": run_loras(run_dir),
        "teacher_experts": _number(m.get("teacher_experts")),
        "layout": layout or teacher_layout(teacher_path),  # an image-to-video student's snippet passes the first frame
    }
    if k is not None and teacher_path is not None:
        schedule, spec = student_schedule_of(cfg), inspect_teacher(teacher_path)
        timesteps, sigmas = student_schedule(spec, k, schedule)
        facts["timesteps"] = ", ".join(f"{t:.0f}" for t in timesteps.tolist())
        if schedule.name != "euler":
            facts["schedule"] = (schedule.describe(), [round(v, 6) for v in sigmas.tolist()[:-1]])
    if is_lora(cfg.get("student")):
        facts["lora"] = lora_facts(cfg, m, teacher_path) | {"merged": merged}
    return _card_text(facts)


def saved_prompts(cfg) -> str | None:
    """The run's prompts file as saved (unresolved; the pocket teacher's through `${teacher.prompts_path}`)."""
    prompts = _raw(cfg.data, "prompts_path")
    return _raw(cfg.teacher, "prompts_path") if prompts == "${teacher.prompts_path}" else prompts


def example_prompt(raw_prompts) -> str:
    """The snippet's prompt: the first of the teacher's own prompts where they ship with WanDistiller (the pocket
    teacher draws digits: "a red 1", not the fox the Wan teachers know), else the first of the shipped 70. Never a
    line of the user's own file (the card carries no text of a received file)."""
    raw = str(raw_prompts) if raw_prompts is not None else ""
    rel = raw[len(SHIPPED) : -1] if raw.startswith(SHIPPED) and raw.endswith("}") else "prompts.txt"
    try:
        lines = Path(shipped_asset(rel)).read_text().splitlines()
    except (OSError, ValueError, UnicodeDecodeError):
        lines = []
    first = next((line.strip() for line in lines if line.strip()), "")
    return first if WORD.fullmatch(first) else "A red fox trotting through fresh snow at dawn"


def lora_facts(cfg: DictConfig, m: dict, teacher_path: Path | None) -> dict:
    """What a LoRA student's card says of its adapters: rank, alpha, layers, the teacher's experts they go on, and
    the teacher they belong to (its weights digest, as checkpoints record it: metrics.json's, else computed)."""

    student = cfg.student
    rank, alpha = _number(_raw(student, "rank")), _number(_raw(student, "alpha"))
    layers = _raw(student, "layers")
    digest = m.get("teacher_digest") if isinstance(m.get("teacher_digest"), str) else None
    experts = 1
    if teacher_path is not None:
        spec = inspect_teacher(teacher_path)
        digest, experts = digest or teacher_digest(spec), len(spec.experts)
    shown = ", ".join(str(x) for x in layers) if isinstance(layers, list) else _word(layers) or "all"
    return {
        "rank": int(rank) if rank else "?",
        "alpha": alpha if alpha else (int(rank) if rank else "?"),
        "layers": shown,
        "digest": _word(digest) or "?",
        "experts": experts,
    }


def _finetune_text(f: dict) -> tuple[str, str]:
    """(the card's paragraph, its table row) naming the LoRAs the teacher was fine-tuned with (teacher.lora): each
    file's name, strength and sha256 prefix; both empty for a plain teacher."""
    loras = f.get("teacher_loras") or []
    if not loras:
        return "", ""

    def named(r: dict) -> str:
        strength = f"{r['strength']:g}" if r["strength"] is not None else "?"
        sha = f", sha256 `{r['sha256'][:12]}`" if r["sha256"] else ""
        pair = f", on {r['experts'][0]} only" if f.get("teacher_experts") == 2 and len(r["experts"]) == 1 else ""
        return f"`{r['file']}` at strength {strength}{sha}{pair}"

    shown = "; ".join(named(r) for r in loras)
    text = (
        f"\nThe teacher it was distilled from is the teacher above fine-tuned with LoRA{'s' if len(loras) > 1 else ''}"
        f" {shown} (merged into its weights: `teacher.lora`); the student learned that fine-tuned teacher.\n"
    )
    if f.get("lora"):  # the adapters are a delta on the fine-tuned teacher, not on the plain one
        text += (
            "Its adapters go on that fine-tuned teacher: a pipeline folder of this run holds it (its transformer "
            "folders merged); anywhere else (ComfyUI, the plain teacher) load these LoRAs at these strengths first, "
            "then the adapters.\n"
        )
    return text, f"| teacher LoRAs | {shown} |\n"


def _lora_text(f: dict) -> tuple[str, str, str]:
    """(the card's paragraph, its table row, the snippet's lines loading the adapters) of a LoRA student; all
    empty for another student."""
    lora = f.get("lora")
    if not lora:
        return "", "", ""
    teacher = f["teacher"][0]
    pair = lora["experts"] == 2
    text = (
        f"\nThe student is the teacher itself with low-rank adapters (LoRA rank {lora['rank']}, alpha "
        f"{lora['alpha']}, on {lora['layers']} Linear layers of every block{' of both experts' if pair else ''}): "
        f"`pytorch_lora_weights.safetensors`{' and `pytorch_lora_weights_transformer_2.safetensors`' if pair else ''}"
        f" here, in the format `{PIPELINES[f.get('layout', Layout.t2v)]}.load_lora_weights` loads. They belong to "
        f"the teacher {teacher}, "
        f"weights digest `{lora['digest']}` (WanDistiller's `teacher_digest`); on another teacher they mean "
        "nothing. The transformer folders here are that teacher's own"
        + (", with the LoRAs it was fine-tuned with merged into them" if f.get("teacher_loras") else "")
        + ".\n"
    )
    row = f"| adapters | LoRA rank {lora['rank']}, alpha {lora['alpha']}, layers: {lora['layers']} |\n"
    if lora["merged"]:  # one self-contained pipeline: nothing to load on top
        text = (
            f"\nThe student is the teacher {teacher} (weights digest `{lora['digest']}`) with its low-rank "
            f"adapters (LoRA rank {lora['rank']}) merged into the transformer weights here.\n"
        )
        return text, row, ""
    load = 'pipe.load_lora_weights("PATH_OR_REPO")  # the adapters, onto the teacher\'s transformer\n'
    if pair:
        load += (
            'pipe.load_lora_weights("PATH_OR_REPO", weight_name="pytorch_lora_weights_transformer_2.safetensors",'
            "\n                       load_into_transformer_2=True)  # the low-noise expert's\n"
        )
    return text, row, load


def _few_step_text(f: dict) -> tuple[str, str, str, str]:
    """(the card's sentences, its table row, the snippet's argument, the paragraph on other step counts) on a
    few-step student's steps; all empty for a KD student, whose card is as before."""
    k = f["steps"]
    if k is None:
        return "", "", "", ""
    at = f" (timesteps {f['timesteps']})" if f.get("timesteps") else ""
    calls = counted(k, "network call")
    text = (
        f"\nIt is a {k}-step student: it samples in {calls} on its own timesteps{at},\nwith the "
        "few-step scheduler in `scheduler/` (Euler flow matching at the teacher's shift;\n"
        "`transformer/sampling.json` states its timesteps and sigmas). The tokenizer, text encoder and VAE are "
        "the teacher's.\n"
    )
    row = f"| sampling | {counted(k, 'step')}{at}, guidance 1 (no CFG) |\n"
    if f.get("schedule"):
        text += exact_sigmas_text(k, *f["schedule"])
        return text, row, f"num_inference_steps={k}, ", ""
    return text, row, f"num_inference_steps={k}, ", other_steps(k)


def exact_sigmas_text(k: int, described: str, sigmas: list[float]) -> str:
    """The card's paragraph for a student trained at a schedule diffusers' scheduler config cannot hold (ComfyUI's
    simple / beta, or a list): `scheduler/` is diffusers' own Euler at K (its sigmas are close, not equal), and
    WanPipeline passes no sigmas, so the exact ones are bound to the scheduler's set_timesteps (shift 1: as given)."""
    return f"""
It was trained at {described}: sigmas {sigmas}. A diffusers scheduler config cannot hold those, so `scheduler/` is
diffusers' own {k}-step Euler schedule (`sampling.json`'s `scheduler_sigmas`: close, not the trained ones). To sample
the trained sigmas exactly:

```python
import functools
from diffusers import FlowMatchEulerDiscreteScheduler

pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)  # shift 1: sigmas as given
pipe.scheduler.set_timesteps = functools.partial(pipe.scheduler.set_timesteps, sigmas={sigmas})
```
"""


def other_steps(k: int) -> str:
    """The card's paragraph on sampling a K-step student at another count n, with diffusers alone: the saved
    scheduler's `shift_terminal` is K's last point, and diffusers stretches every count's schedule to end there --
    at n=1 its stretch divides by zero (NaN). The snippet rebuilds what `few_step_scheduler(spec, n)` builds (the
    one formula, checked by tests/state/test_export.py), what `python -m wandistiller.eval/generate
    --student-steps n` sample with. A 1-step student's scheduler has no `shift_terminal` (few_step_scheduler), so
    none of that holds: its card says only the count it samples at."""
    if k == 1:
        return "\nSample it at `num_inference_steps=1`, the count it was trained for.\n"
    return f"""
Sample it at `num_inference_steps={k}`: its scheduler is set for {k} steps. For another count n, rebuild the
scheduler first, then call `pipe(..., num_inference_steps=n)` (at any other count diffusers ends the schedule
at the {k}-step one's last point, and at 1 step that gives NaN):

```python
from diffusers import FlowMatchEulerDiscreteScheduler

n, shift = 1, pipe.scheduler.config.shift  # n: the steps to sample
terminal = shift / n / (1 + (shift - 1) / n) if n > 1 else None  # the n-step schedule's last point
pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift_terminal=terminal)
```
"""


def _size_row(frames: int, height: int, width: int, lh: int, lw: int) -> str:
    if frames == 1:
        return f"| image size | {height}x{width} (latent {lh}x{lw}) |"
    return f"| clip size | {frames} frames of {height}x{width} (latent {lh}x{lw} per latent frame) |"


def _sample_lines(f: dict, few_arg: str, frames: int, height: int, width: int) -> str:
    """The snippet's call: one image, or a clip written as a GIF (diffusers' export_to_gif: PIL alone). An
    image-to-video student's call passes the clip's first frame (`image`), which the pipeline resizes to height x
    width and encodes as the teacher's pipeline does (its VAE; Wan 2.1 I2V's CLIP tower too), as the training did."""
    given = f.get("layout", Layout.t2v) != Layout.t2v
    call = (
        f"pipe({'image=image, prompt=' if given else ''}{json.dumps(f['prompt'])}, {few_arg}guidance_scale=1.0, "
        f"num_frames={frames},\n"
        f'             height={height}, width={width}, max_sequence_length={f["tokens"]}, output_type="pil").frames[0]'
    )
    if frames == 1:
        return f"image = {call}[0]"
    if given:
        return (
            "from diffusers.utils import export_to_gif, load_image\n\n"
            f'image = load_image("FIRST_FRAME.png")  # the first frame (path or URL), cropped to {width}:{height} as '
            "the run's\n"
            f'clip = {call}\nexport_to_gif(clip, "clip.gif")'
        )
    return f'from diffusers.utils import export_to_gif\n\nclip = {call}\nexport_to_gif(clip, "clip.gif")'


def _card_text(f: dict) -> str:
    (teacher, hub_id), (lh, lw) = f["teacher"], f["latent"]
    height, width, frames = lh * f["scale"], lw * f["scale"], f.get("frames", 1)
    layout = f.get("layout", Layout.t2v)
    kind = "image-to-video" if layout != Layout.t2v else "text-to-video" if frames > 1 else "text-to-image"
    pipeline = PIPELINES[layout]
    given = (
        f"\nIt takes the clip's first frame as its teacher does (`{pipeline}`'s `image`): the student was trained on "
        "the teacher's predictions given that image.\n"
        if layout != Layout.t2v
        else ""
    )
    few_text, few_row, few_arg, few_other = _few_step_text(f)
    lora_text, lora_row, lora_load = _lora_text(f)
    few_text += lora_text
    few_row += lora_row
    parts = "" if few_text else " The tokenizer, text encoder, VAE and scheduler are the teacher's."
    finetune_text, finetune_row = _finetune_text(f)
    few_text = finetune_text + few_text
    few_row = finetune_row + few_row
    method = f["method"]["name"]
    tags = ", ".join(["wan", "distillation", *([method] if method != "?" else [])])
    front = ["---", "library_name: diffusers", f"pipeline_tag: {kind}", f"tags: [{tags}]"]
    front += [f"base_model: {hub_id}"] if hub_id else []
    return (
        "\n".join([*front, "---", "", f"# A {f['params']}-parameter {kind} student of {teacher}", "", ""])
        + f"""\
Distilled with WanDistiller from the Wan teacher {teacher} with `method={method}`: {_method_text(f)}.
It samples without CFG.{parts}
{given}{few_text}
| | |
|---|---|
| method | `{method}` |
| data | {f["data"]}; prompts: {f["prompts"]} |
| training | {f["training"]}, seed {f["seed"] if f["seed"] is not None else "?"} |
{_size_row(frames, height, width, lh, lw)}
{few_row}
Quality against the teacher (same noise, prompts and sampler; `python -m wandistiller.eval`):

| figure | value |
|---|---|
{f["rows"] or "| (no evaluation in this run) | |"}

```python
import torch
from diffusers import {pipeline}

pipe = {pipeline}.from_pretrained("PATH_OR_REPO", dtype=torch.float32)
{lora_load}{_sample_lines(f, few_arg, frames, height, width)}
```
{few_other}"""
    )


# -- the exported files, listed on the card (python -m wandistiller.export) ---------------------------------------
def files_section(files: list[tuple[str, str, str, str]], intro: str = "") -> str:
    """The card's list of every exported file: (file, what it is, the lines that load it in diffusers, how ComfyUI
    loads it; "" where that loader does not take it), after `intro`."""
    rows = ["\n## Files\n", *([f"{intro}\n"] if intro else [])]
    for name, what, diffusers_lines, comfy in files:
        rows.append(f"- **`{name}`**: {what}")
        if diffusers_lines:
            rows.append(
                f"\n  diffusers:\n\n  ```python\n  {diffusers_lines.strip().replace(chr(10), chr(10) + '  ')}\n  ```\n"
            )
        if comfy:
            rows.append(f"  ComfyUI: {comfy}\n")
    return "\n".join(rows) + "\n"
