"""The model card (README.md) of a run's pipeline and of its exports: the teacher, the data, the training, the
sampling and the quality figures (metrics.json), and the files an export wrote with the lines that load them.
Portable: nothing of this machine, no resolver evaluated, no text of a received file but figures (state/saved.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from omegaconf import DictConfig

from wandistiller.core.arch import Layout
from wandistiller.core.errors import UserError, counted, human_count
from wandistiller.core.files import read_json_in
from wandistiller.core.hydra import shipped_asset
from wandistiller.data.sources import sources
from wandistiller.state.checkpoint import teacher_digest
from wandistiller.state.received import load_yaml_config
from wandistiller.state.runs import student_schedule_of, student_steps
from wandistiller.state.sampling import image_scale, time_scale
from wandistiller.state.saved import (
    HUB_ID,
    SHIPPED,
    WORD,
    last_part,
    named_path,
    raw_value,
    run_loras,
    saved_number,
    saved_word,
)
from wandistiller.student.lora import is_lora
from wandistiller.teacher.fewstep import student_schedule
from wandistiller.teacher.spec import PIPELINES, inspect_teacher, teacher_layout


def card_teacher(cfg: DictConfig) -> tuple[str, str | None]:
    """(how the card names the teacher, its Hub id or None): a Hub id, "pocket (shipped)", the built-in tiny
    teacher, or a local folder by its name; never a path of this machine or an evaluated resolver."""
    raw, name = str(raw_value(cfg.teacher, "path")), saved_word(raw_value(cfg.teacher, "name")) or "teacher"
    if raw.startswith(SHIPPED):
        return f"{name} (shipped)", None
    if raw.startswith("${paths.cache_dir}/teachers/"):
        return f"{name} (built-in, random weights)", None
    if HUB_ID.fullmatch(raw) and not Path(raw).expanduser().exists():
        return raw, raw
    return (f"{last_part(raw)} (a local folder)" if last_part(raw) else "a local folder"), None


def card_method(cfg: DictConfig) -> dict:
    """The method the student was trained with, as the saved config says (`method.name`; no `method` node: a
    pre-release run, kd): its name, and DMD's regression term's weight where it has one."""
    method = cfg.get("method") if isinstance(cfg, DictConfig) else None
    name = saved_word(raw_value(method, "name")) if method is not None else "kd"
    regression = saved_number(raw_value(method, "regression_weight")) if method is not None else None
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

    cfg, m = _saved(run_dir)
    d, t = cfg.data, cfg.trainer
    source = sources().get(str(raw_value(d, "latents")), sources()["gaussian"]).description
    images, prompts = raw_value(d, "root") or raw_value(d, "dataset"), saved_prompts(cfg)
    steps = saved_number(m.get("steps_run")) or saved_number(raw_value(t, "max_steps"))
    batch = saved_number(m.get("batch_size")) or saved_number(raw_value(t, "batch_size"))
    params = saved_number(m.get("student_params_m"))
    few_step = student_steps(cfg) is not None
    # val_loss_best is a KD student's velocity error: the run itself calls it meaningless for a few-step student
    # (no checkpoints/best/), so its card does not quote it
    names = ("eval_latent_mse", "eval_psnr", "eval_ssim", "eval_speedup", *(() if few_step else ("val_loss_best",)))
    figures = [(k, saved_number(m.get(k))) for k in names]
    facts = {
        "teacher": card_teacher(cfg),
        "data": f"{source} ({named_path(images, 'images')})"
        if images
        else source,  # a folder only an image source reads
        "prompts": named_path(prompts, "prompts"),
        "training": (f"{steps:.0f} steps, batch {batch:.0f}" if steps and batch else "?")
        + (f", precision {m['precision']}" if saved_word(m.get("precision")) else ""),
        "latent": [int(saved_number(raw_value(d, k)) or 0) for k in ("latent_height", "latent_width")],
        "scale": image_scale(teacher_path),
        # pixel frames of a clip run ((latent frames - 1) x the VAE's time factor + 1); 1 for an image run
        "frames": (int(saved_number(raw_value(d, "latent_frames")) or 1) - 1) * time_scale(teacher_path) + 1,
        "tokens": int(saved_number(raw_value(cfg.teacher, "max_sequence_length")) or 512),
        "guidance": saved_number(raw_value(cfg.teacher, "guidance_scale")),
        "seed": saved_number(raw_value(cfg, "seed")),
        "params": human_count(round(params * 1e6)) if params else "?",
        "rows": "\n".join(f"| `{k}` | {v:.4g} |" for k, v in figures if v is not None),
        "steps": (k := student_steps(cfg)),
        "method": card_method(cfg),
        "phrases": dict(phrases or {}),
        "prompt": example_prompt(prompts),
        "teacher_loras": run_loras(run_dir),
        "teacher_experts": saved_number(m.get("teacher_experts")),
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


def _saved(run_dir: Path) -> tuple[DictConfig, dict]:
    """(the run's saved config, its metrics.json or {}), each read through the guard: a link out of the run folder
    (another run's figures) is refused in one line, never quoted."""
    cfg = load_yaml_config(run_dir / ".hydra" / "config.yaml", root=run_dir)
    if not isinstance(cfg, DictConfig):  # the run's own config, written by this project: a mapping
        raise UserError(f"{run_dir}/.hydra/config.yaml is not a saved config; restore it")
    try:
        m = read_json_in(run_dir, "metrics.json", what="metrics.json") if (run_dir / "metrics.json").is_file() else {}
    except ValueError:
        raise UserError(f"{run_dir}/metrics.json is not JSON; restore it from the run's backup") from None
    return cfg, m if isinstance(m, dict) else {}


def saved_prompts(cfg) -> str | None:
    """The run's prompts file as saved (unresolved; the pocket teacher's through `${teacher.prompts_path}`)."""
    prompts = raw_value(cfg.data, "prompts_path")
    return raw_value(cfg.teacher, "prompts_path") if prompts == "${teacher.prompts_path}" else prompts


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
    rank, alpha = saved_number(raw_value(student, "rank")), saved_number(raw_value(student, "alpha"))
    layers = raw_value(student, "layers")
    digest = m.get("teacher_digest") if isinstance(m.get("teacher_digest"), str) else None
    experts = 1
    if teacher_path is not None:
        spec = inspect_teacher(teacher_path)
        digest, experts = digest or teacher_digest(spec), len(spec.experts)
    shown = ", ".join(str(x) for x in layers) if isinstance(layers, list) else saved_word(layers) or "all"
    return {
        "rank": int(rank) if rank else "?",
        "alpha": alpha if alpha else (int(rank) if rank else "?"),
        "layers": shown,
        "digest": saved_word(digest) or "?",
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
