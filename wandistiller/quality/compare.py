"""`python -m wandistiller.quality`: what distilling buys, measured like the field, on the pocket teacher.

Rows: the teacher; students distilled with Gaussian x0, with teacher latents and with the images; the same
student trained without the teacher (task loss on the images); the blend of both. Columns: prompt
accuracy, FID and KID (the judge's features, against held-out real digits), latent MSE against the
teacher's sample from the same noise, parameters and seconds per image. Each row is a mean over seeds
(± the spread); every student trains through `wandistiller.train` with the same steps and batch.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from wandistiller.compose import register_configs
from wandistiller.core.errors import UserError
from wandistiller.core.files import read_json_in
from wandistiller.core.hydra import compose_config
from wandistiller.data.prompts import encode_prompts
from wandistiller.evaluation.metrics import heldout_reference, pocket_scores
from wandistiller.job.run import run
from wandistiller.pocket.classifier import load_classifier
from wandistiller.pocket.clips import video_prompt_file_order
from wandistiller.pocket.digits import PROMPTS
from wandistiller.state.checkpoint import checkpoint_step, list_checkpoints
from wandistiller.state.runs import open_run, student_sampler, student_scheduler, student_steps
from wandistiller.state.sampling import generate, load_teacher
from wandistiller.student.lora import ADAPTERS_JSON, is_lora
from wandistiller.teacher.fewstep import Schedule
from wandistiller.teacher.finetune import merge, read_lora
from wandistiller.teacher.image import load_image_encoder
from wandistiller.teacher.sampler import calls_per_image
from wandistiller.teacher.vae import decode_clips, decode_latents, load_vae

# (row, overrides): the same student, steps and batch; only where x0 comes from and the loss change.
ROWS = [
    ("distilled, Gaussian x0", ["data=static_prompts", "loss=distillation"]),
    ("distilled, teacher latents", ["data=teacher_latents", "data.latents_per_prompt=4", "loss=distillation"]),
    ("distilled, images", ["data=pocket_digits", "loss=distillation"]),
    ("no teacher (task loss, images)", ["data=pocket_digits", "loss=task"]),
    ("blend 0.5 task + 0.5 KD, images", ["data=pocket_digits", "loss=blend", "trainer.loss.alpha=0.5"]),
]
COLUMNS = ["prompt_accuracy", "fid", "kid", "latent_mse", "params", "s_per_image"]


@dataclass
class Settings:
    teacher: str = "pocket"
    # The teacher's width at half its blocks, started from them: `tiny` (42K parameters, 1/16 of the pocket
    # teacher) stays at 5% prompt accuracy even after 2000 steps (docs/QUALITY.md).
    student: str = "half"
    seeds: tuple[int, ...] = (0, 1, 2)
    max_steps: int = 1000
    batch_size: int = 16
    sample_steps: int = 20
    per_prompt: int = 2  # images per prompt and seed (40 prompts)
    prompts: int | None = None  # the first N pocket prompts only (the small mode)
    extra: tuple[str, ...] = ()  # more overrides for every student run


def seed_mean(runs: list[dict], key: str) -> float:
    """The mean of `key` over a row's seeds, leaving out the withheld (nan) ones; nan where none has it."""
    values = [r[key] for r in runs if key in r and not math.isnan(r[key])]
    return statistics.fmean(values) if values else math.nan


VIDEO_TEACHERS = ("pocket_video", "pocket_video_moe")  # judged on clips (quality/video.py)
I2V_TEACHERS = ("pocket_i2v", "pocket_i2v_moe")  # judged on clips from a given first frame (quality/i2v.py)
VIDEO_PROMPT_COUNT = 40  # the video prompts file's first 40: every (digit, colour) once, every motion 8 times


def as_flags(line: str) -> str:
    """A training job's refusal, the keys this command sets from its flags named as those flags: `--batch-size 16`
    was told "it would with trainer.batch_size=30314", a key the user never wrote."""
    line = re.sub(r"\btrainer\.batch_size=(\d+)", r"--batch-size \1", line)
    return re.sub(r"\btrainer\.max_steps=(\d+)", r"--steps \1", line)


def prompt_set(settings: Settings) -> list[str]:

    if settings.teacher in VIDEO_TEACHERS + I2V_TEACHERS:
        return video_prompt_file_order()[: settings.prompts or VIDEO_PROMPT_COUNT]
    return PROMPTS[: settings.prompts] if settings.prompts else PROMPTS


def train_student(settings: Settings, overrides: list[str], seed: int, run_dir: Path, cache_dir: Path) -> dict:
    """One student through the framework's own entry point (`wandistiller.job.run.run`, as `python -m
    wandistiller.train` runs it). `trainer.resume=auto`: a comparison run again with the same `--work` takes the
    students it already finished (the video table is ~80 min a seed here, so its seeds can be run one sitting at a
    time) and refuses one trained under other settings, or for more steps than `settings.max_steps` (fewer: it
    trains on)."""

    register_configs()

    # Teacher latents are sampled with the steps the rows are judged at (a data option of another source has no key).
    latents_steps = [f"data.sample_steps={settings.sample_steps}"] if "data=teacher_latents" in overrides else []
    cfg = compose_config(
        [
            f"teacher={settings.teacher}",
            f"student={settings.student}",
            f"seed={seed}",
            f"trainer.max_steps={settings.max_steps}",
            f"trainer.batch_size={settings.batch_size}",
            "hooks.monitor.val_every=0",
            "~hooks.evaluate",
            "trainer.progress_bar=false",
            "hooks.samples.every=0",
            f"trainer.checkpoint_every={settings.max_steps}",
            "logger=none",
            f"paths.output_dir={run_dir}",
            f"paths.cache_dir={cache_dir}",
            "trainer.resume=auto",
            *overrides,
            *latents_steps,
            *settings.extra,
        ]
    )
    # A student trained further than --steps is never reported as one of --steps (nor resumed: nothing to train).
    trained = max((checkpoint_step(p) for p in list_checkpoints(run_dir)), default=0)
    if trained > settings.max_steps:
        raise UserError(
            f"--work: {run_dir} holds a student trained {trained} steps, more than --steps {settings.max_steps}; "
            f"give --steps {trained}, or another --work"
        )
    try:
        return run(cfg, register_configs)
    except UserError as e:  # a job's line names the keys this command set from its flags: said as those flags
        raise UserError(as_flags(str(e))) from None


def sample(
    run_dir: Path,
    source: str | None,
    settings: Settings,
    seed: int,
    steps: int | None = None,
    schedule: Schedule | None = None,
    loras: tuple[Path, ...] = (),
    first_frames: list[torch.Tensor] | None = None,
) -> dict:
    """Latents, images, seconds per image and network calls per image of the teacher (source None) or the run's
    student, for every prompt x `per_prompt` noises (noise seeds seed*1000 + k: the same for every row). The
    teacher and a KD student sample `settings.sample_steps` (or `steps`) on the teacher's scheduler; a few-step
    student its own K (or `steps`) on its own (state/runs.py `student_scheduler`), at its trained sigmas or at
    `schedule`'s (e.g. ComfyUI's simple at the same shift). `loras`: LoRA files stacked on it at strength 1 (merged
    into every expert beside the student's own adapters: what diffusers' `set_adapters` with weights 1 computes).
    `first_frames`: an image-to-video teacher's given frames, [P, 3, H, W] in [0, 1] per noise k (noise k starts
    from frame k of each prompt), sampled through the model's own WanImageToVideoPipeline."""

    register_configs()  # the registries' options, which the run's config may name
    run, device, prompts = open_run(run_dir), torch.device("cpu"), prompt_set(settings)
    t = run.cfg.teacher
    emb = encode_prompts(
        run.spec, prompts, t.negative_prompt, t.max_sequence_length, torch.float32, device, run.cfg.paths.cache_dir
    )
    trained = student_steps(run.cfg) if source is not None else None
    steps = steps or trained or settings.sample_steps
    at = schedule or run.trained_schedule
    scheduler = student_scheduler(run.spec, trained, steps, at) if source is not None else None
    sampler, params = _sampler(run, source, device, loras)
    vae = load_vae(run.spec, device)
    encoder = load_image_encoder(run.spec, device) if first_frames is not None else None
    drawn: list[torch.Tensor] = []
    seconds: list[float] = []
    for k in range(settings.per_prompt):
        given = None if first_frames is None else (vae, encoder, lambda i, _k, k=k: as_pil(first_frames[k][i]))
        lat, sec = generate(
            sampler,
            emb,
            list(range(len(prompts))),
            seed * 1000 + k,
            steps,
            run.latent_shape,
            scheduler=scheduler,
            images=given,
        )
        drawn.append(lat)
        seconds += sec
    latents = torch.cat(drawn)
    decode = decode_clips if run.latent_shape[1] > 1 else decode_latents  # clips: every frame [N, F, 3, H, W]
    images = decode(vae, latents)
    return {
        "latents": latents,
        "images": images,
        "prompts": prompts * settings.per_prompt,
        "params": params,
        "s_per_image": statistics.fmean(seconds),
        "steps": steps,
        "calls": calls_per_image(steps, max(sampler.guidance_scales)),
    }


def _sampler(run, source: str | None, device: torch.device, loras: tuple[Path, ...]):
    """(the teacher's sampler (source None) or the student's, its stored parameters: a LoRA student's adapters alone),
    with `loras` merged into every expert at strength 1."""
    if source is None:
        sampler = load_teacher(run, device, torch.float32)
    else:
        sampler = student_sampler(run, run.path / source, device)
    params = sum(p.numel() for e in sampler.experts for p in e.parameters())
    if source is not None and is_lora(run.cfg.student):  # what must be stored beside the teacher: the adapters
        params = read_json_in(run.path, f"{source}/{ADAPTERS_JSON}")["params"]
    for path in loras:
        for expert in sampler.experts:
            merge(expert, read_lora(path), 1.0)
    return sampler, params


def as_pil(frame: torch.Tensor) -> Image.Image:
    """A [3, H, W] frame in [0, 1] as the 8-bit image a user would pass."""
    return Image.fromarray((frame.permute(1, 2, 0) * 255).round().byte().numpy())


def score(made: dict, teacher_latents: torch.Tensor, judge, reference) -> dict:

    scores = pocket_scores(made["images"], made["prompts"], judge, reference)
    mse = float(((made["latents"] - teacher_latents) ** 2).mean())
    return {k: scores.get(k, math.nan) for k in ("prompt_accuracy", "fid", "kid", "diversity")} | {  # nan: withheld
        "latent_mse": mse,
        "params": made["params"],
        "s_per_image": made["s_per_image"],
    }


def compare(settings: Settings, work: Path, log=print) -> dict[str, list[dict]]:
    """{row: [scores per seed]}: trains every student row for every seed and scores it beside the teacher."""

    judge, reference = load_classifier(), heldout_reference()
    cache = work / "cache"
    results: dict[str, list[dict]] = {name: [] for name in ["teacher", *(name for name, _ in ROWS)]}
    for seed in settings.seeds:
        teacher = None
        for name, overrides in ROWS:
            start = time.perf_counter()
            run_dir = work / f"seed{seed}" / name.split(",")[0].split()[0] / str(ROWS.index((name, overrides)))
            summary = train_student(settings, overrides, seed, run_dir, cache)
            if teacher is None:  # the teacher's samples once per seed, from the first run folder
                teacher = sample(run_dir, None, settings, seed)
                results["teacher"].append(score(teacher, teacher["latents"], judge, reference))
            row = score(sample(run_dir, "student", settings, seed), teacher["latents"], judge, reference)
            row["train_s"] = summary.get("wall_s", time.perf_counter() - start)
            results[name].append(row)
            log(f"seed {seed} {name}: " + "  ".join(f"{k} {v:.4g}" for k, v in row.items()))
    return results
