"""A run's student against its teacher: both sample through WanPipeline from the same noise and prompts (the teacher
with its CFG, experts and scheduler at `steps`; the student alone without CFG, at its own steps: a KD student with
the teacher's scheduler at `steps`, a few-step student with its few-step scheduler at its K, or at each count asked
for). Per prompt and on average: latent MSE, PSNR and SSIM of the decoded images against the teacher's
(torchmetrics), each one's seconds and network calls per image, and the quality figures (metrics.py: prompt
accuracy, FID/KID, intra-prompt diversity). One result per student and settings is written into the run folder, so
no evaluation overwrites another (`result_stem`): `eval.json` and `eval.png` (teacher | student) for the final
student at the run's own evaluation settings (its end-of-run one's, `hooks.evaluate`: what metrics.json's `eval_*`
figures come from), `eval_best.json`/`eval_step_XXXXXXXX.json` (and `.png`) for a checkpoint, and each setting
that differs from the run's own named in the file (`eval_student1.json`, `eval_best_steps20.json`); in it
one result per student step count (`results`, by steps), the first also as `mean`/`prompts`.
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig

from wandistiller.core.errors import UserError
from wandistiller.core.files import check_appended, output_problem, write_in_run
from wandistiller.core.precision import DTYPES, to_dtype
from wandistiller.data.prompts import encode_prompts, read_prompts
from wandistiller.data.sources import contents_problem, image_conditioned, source_of
from wandistiller.evaluation.clips import (
    FD_WITHHELD,
    eval_clip_quality,
    first_frame_psnr,
    is_video_pocket,
    motion_ratio,
    pil_tensor,
)
from wandistiller.evaluation.grids import save_clip_grid, save_grid
from wandistiller.evaluation.metrics import KID_MEANING, diversity_ratio, eval_quality
from wandistiller.state.runs import (
    RunFolder,
    check_frames,
    check_teacher_fits,
    open_run,
    other_teacher_tag,
    student_sampler,
    student_scheduler,
    student_source,
    teacher_identity,
)
from wandistiller.state.sampling import check_counts, generate, load_teacher
from wandistiller.state.trust import Trust
from wandistiller.teacher.image import load_image_encoder
from wandistiller.teacher.sampler import calls_per_image
from wandistiller.teacher.spec import read_json
from wandistiller.teacher.vae import decode_clips, decode_latents, load_vae

# What `python -m wandistiller.eval` samples unasked: a run without an end-of-run evaluation (no `hooks.evaluate` in
# its saved config) has these as its own settings, the ones `eval.json` names.
DEFAULTS = {"steps": 20, "limit": 8, "per_prompt": 1, "prompts_path": None}


def eval_prompts(
    run: RunFolder, prompts_path: str | None, limit: int, own_files: bool = False, allow_data: bool = False
) -> list[str]:
    """The given file, or the run's held-out prompts (never trained on: its data source's own split); `own_files`:
    the saved files are the user's own (the end-of-run eval), so they are read wherever they lie; `allow_data`:
    the user trusts a received run's data folders."""

    if prompts_path is not None:
        return read_prompts(prompts_path)[:limit]
    data = run.cfg.data
    for key in ("prompts_path", "val_prompts_path"):
        if data.get(key) is not None and not (own_files or allow_data) and not _readable_from_run(run, data[key]):
            raise UserError(
                f"data.{key}={str(data[key])!r} in the run's saved config lies outside the run folder and "
                "WanDistiller's shipped prompts, so eval does not read it unasked; add --allow-data if you trust that "
                "file (its held-out prompts, as eval.json was drawn from), or give --prompts FILE"
            )

    return source_of(data).held_out_prompts(data, data_readable(run, own_files or allow_data))[:limit]


def data_readable(run: RunFolder, trusted: bool):
    """`readable(key)` for a data source: refuses a data folder of the saved config outside the run folder (the
    sender's files) unless `trusted` (the run's own eval, or --allow-data)."""
    data = run.cfg.data

    def readable(key: str) -> None:
        if data.get(key) is None:
            return
        # An image-to-video run's held-out captions come with their first frames, which --prompts cannot give.
        way = "" if image_conditioned(data, run.spec.layout) else "give --prompts FILE, or "
        if not trusted and not _readable_from_run(run, data[key]):
            raise UserError(
                f"data.{key}={str(data[key])!r} in the run's saved config lies outside the run folder, so eval "
                f"does not read its captions; {way}--allow-data if you trust that folder"
            )
        problem = contents_problem(run.path, data)  # files added since: the last val_fraction are others
        if problem:
            raise UserError(
                f"{problem}, so its held-out items would be others, some of them trained on; {way}restore the folder "
                "as the run had it"
            )

    return readable


def given_first_frames(run: RunFolder, prompts_path: str | None, count: int, trusted: bool) -> list | None:
    """An image-to-video run's first frames, one per eval prompt: its data source's held-out images (in the held-out
    captions' order, fitted as training fits them); None for a run on text alone. Prompts of another file have no
    first frame of theirs: one line."""
    data = run.cfg.data
    if not image_conditioned(data, run.spec.layout):
        return None
    if prompts_path is not None:
        raise UserError(
            f"--prompts {prompts_path}: this student of an image-to-video teacher continues each held-out caption's "
            "own first frame, and those prompts have none; drop --prompts (eval draws the run's held-out images and "
            "captions), or draw your own first frames with python -m wandistiller.generate RUN --image FILE"
        )
    vae_config = read_json(run.spec.path / "vae" / "config.json", "teacher.path")
    frames = source_of(data).held_out_first_frames(data, vae_config, data_readable(run, trusted))
    if frames is None:
        raise UserError(
            f"data.val_prompts_path={data.val_prompts_path} held out prompts of the user's own, which have no first "
            "frames, so this image-to-video run cannot be evaluated on them; draw its student with python -m "
            "wandistiller.generate RUN --image FILE, or train with the folder's own held-out images "
            "(data.val_prompts_path=null)"
        )
    return frames[:count]


def _readable_from_run(run: RunFolder, path: str) -> bool:
    """A saved prompts file eval may read without being told: inside the run folder, or a shipped asset.
    Anything else is the sender's choice of file on this machine; the user names a file with --prompts."""
    where = Path(str(path)).expanduser()
    where = where.resolve()  # as read_prompts reads it: relative to the working directory
    shipped = (Path(__file__).parents[1] / "assets").resolve()
    return where.is_relative_to(run.path.resolve()) or where.is_relative_to(shipped)


def clip_metrics(student_clips: torch.Tensor, teacher_clips: torch.Tensor) -> list[dict]:
    """PSNR and SSIM of [N, F, 3, H, W] clips against the teacher's: each clip's mean over its frames."""
    frames = student_clips.shape[1]
    rows = image_metrics(student_clips.flatten(0, 1), teacher_clips.flatten(0, 1))
    return [
        {k: statistics.fmean(r[k] for r in rows[i : i + frames]) for k in ("psnr", "ssim")}
        for i in range(0, len(rows), frames)
    ]


def image_metrics(student_imgs: torch.Tensor, teacher_imgs: torch.Tensor) -> list[dict]:
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    rows = []
    for s, t in zip(student_imgs, teacher_imgs):
        psnr = peak_signal_noise_ratio(s[None], t[None], data_range=1.0)
        ssim = structural_similarity_index_measure(s[None], t[None], data_range=1.0)
        assert isinstance(psnr, torch.Tensor) and isinstance(ssim, torch.Tensor)  # one value each, as asked
        rows.append({"psnr": float(psnr), "ssim": float(ssim)})
    return rows


@dataclass(frozen=True)
class EvalSettings:
    """What one evaluation asks for. `steps`, `limit`, `per_prompt` and `prompts_path` left None are the run's own
    (`own_settings`), so a plain `eval RUN` reproduces its eval.json."""

    checkpoint: str | None = None  # a checkpoint's name (best, latest, step_N); None: the final student
    prompts_path: str | None = None  # None: the run's own, else its held-out prompts
    steps: int | None = None  # the teacher's sample steps (and a KD student's)
    limit: int | None = None  # prompts at most
    per_prompt: int | None = None  # noises per prompt: FID/KID need 65 images or more, diversity 2 a prompt
    student_steps: Sequence[int] | None = None  # the student's step counts; None: its own K (a KD student `steps`)
    dtype: str | None = None  # the teacher's; None: the run's precision.teacher_dtype
    device: torch.device | None = None  # None: CUDA where there is one
    clip_model: str | None = None  # a CLIP model's path: CLIP score beside the pocket judge
    fid_reference: str | None = None  # a folder of real images: Inception FID against them
    trust: Trust = field(default_factory=Trust)  # what the user allows a received run folder


@dataclass
class _Plan:
    """An evaluation's settings resolved against its run, every check passed: nothing sampled or written yet."""

    run: RunFolder
    source: Path  # the student's folder (final or a checkpoint)
    steps: int
    per_prompt: int
    counts: list[int]  # the student's step counts, in the order asked
    schedulers: dict  # by count: a few-step student's sigmas at its K
    other: str | None  # the tag of a teacher other than the recorded one (its own file)
    named: list[str]  # the settings its file names carry
    device: torch.device
    teacher_dtype: torch.dtype
    prompts: list[str]
    firsts: list | None  # an image-to-video run's held-out first frames, by prompt


def evaluate(run_dir: str | Path, settings: EvalSettings | None = None) -> dict:
    """Run the evaluation and write its json and png (`result_stem`); returns what the json holds. The teacher
    samples `steps` steps; the student each of `student_steps`. Each prompt is drawn from `per_prompt` noises; the
    grid shows each prompt's first, by the first student step count."""
    s = settings or EvalSettings()
    plan = _planned(run_dir, s)
    run, per_prompt, device = plan.run, plan.per_prompt, plan.device
    t_cfg = run.cfg.teacher
    emb = encode_prompts(
        run.spec, plan.prompts, t_cfg.negative_prompt, t_cfg.max_sequence_length, plan.teacher_dtype, device,
        run.cfg.paths.cache_dir,
    )  # fmt: skip
    idx, seed, shape = list(range(len(plan.prompts))), int(run.cfg.seed), run.latent_shape
    teacher = load_teacher(run, device, plan.teacher_dtype)
    teacher_calls = calls_per_image(plan.steps, teacher.guidance_scales[0])
    # An image-to-video run: the teacher and the student continue the same held-out first frame, each noise k of
    # prompt i from prompt i's, through the model's own WanImageToVideoPipeline (which encodes it as training did).
    # A text-to-video run's VAE waits until the teacher is gone.
    firsts = plan.firsts
    vae = None if firsts is None else load_vae(run.spec, device)
    images = None if firsts is None else (vae, load_image_encoder(run.spec, device), lambda i, k: firsts[i])
    teacher_lat, teacher_s = generate(
        teacher, emb, idx, seed, plan.steps, shape, "eval: the teacher", per_prompt, None, images
    )
    del teacher
    student = student_sampler(run, plan.source, device)
    prompts = [p for p in plan.prompts for _ in range(per_prompt)]  # image by image
    vae = vae or load_vae(run.spec, device)
    video = shape[1] > 1  # clips: every frame decoded and judged (evaluation/clips.py); one frame: an image
    decode = decode_clips if video else decode_latents
    teacher_imgs = decode(vae, teacher_lat)
    given = None if firsts is None else torch.stack([pil_tensor(firsts[i]) for i in idx for _ in range(per_prompt)])
    judged = _Judged(prompts, teacher_lat, teacher_imgs, teacher_s, teacher_calls, given, video, s)
    results: dict[str, dict] = {}
    first, grid = slice(None, None, per_prompt), None  # the grid: each prompt's first image, by the first count
    for n in plan.counts:
        what = "eval: the student" + (f" at {n} steps" if len(plan.counts) > 1 else "")
        student_lat, student_s = generate(
            student, emb, idx, seed, n, shape, what, per_prompt, plan.schedulers[n], images
        )
        student_imgs = decode(vae, student_lat)  # one count's images held at a time
        results[str(n)] = judged.student(n, student_lat, student_imgs, student_s)
        grid = grid or (teacher_imgs[first], student_imgs[first], prompts[first])
    assert grid is not None  # one student step count at least
    result = _record(plan, s.checkpoint, results, prompts, video)
    _write(run.path, result_stem(plan.source, plan.named), result, grid, video)
    return result


def _planned(run_dir: str | Path, s: EvalSettings) -> _Plan:
    """The settings resolved and every check made, before anything is sampled: each mistake one line."""
    trust = s.trust
    run = open_run(run_dir, *trust.open_args())
    check_frames(run)  # before anything is sampled or written
    steps, limit, per_prompt, prompts_path = run_settings(run, s.steps, s.limit, s.per_prompt, s.prompts_path, trust)
    trained = run.trained_steps  # before any sampling: a bad saved method.steps is one line
    counts = list(dict.fromkeys(s.student_steps or [trained or steps]))  # in the order asked, each once
    source = student_source(run, s.checkpoint)
    check_teacher_fits(run, source, trust.other_teacher or trust.own_files)
    # A result against another teacher (--allow-other-teacher) goes to its own file, named for that teacher.
    other = other_teacher_tag(run, source, trust.other_teacher and not trust.own_files)
    check_counts(run, {"--steps": steps, "--student-steps": max(counts)})  # before any work
    try:  # a few-step student samples on the sigmas it was trained at; K explicit ones only at K steps
        schedulers = {n: student_scheduler(run.spec, trained, n, run.trained_schedule) for n in counts}
    except UserError as e:
        raise UserError(f"--student-steps {','.join(map(str, counts))}: {e}") from None
    problem = output_problem(run.path)
    if problem:  # eval.json and eval.png go there: said before minutes of sampling, not after
        raise UserError(f"{run.path}: {problem}; evaluate a writable copy of the run folder")
    check_appended(run.path)  # the loggers' files it adds to, checked before the sampling, not after
    device = s.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    teacher_dtype = to_dtype(s.dtype or run.cfg.precision.teacher_dtype, "--dtype")
    asked = {"student": counts, "steps": steps, "limit": limit, "per_prompt": per_prompt, "prompts": prompts_path,
             "dtype": teacher_dtype, "clip": s.clip_model, "fid": s.fid_reference}  # fmt: skip
    named = variant(run, asked) + ([other] if other else [])  # the settings its file names carry: known before
    prompts = eval_prompts(run, prompts_path, limit, trust.own_files, trust.data)
    firsts = given_first_frames(run, prompts_path, len(prompts), trust.own_files or trust.data)  # image to video
    check_counts(run, {}, len(prompts) * per_prompt, f"--per-prompt {per_prompt} ({len(prompts)} prompts)")
    return _Plan(run, source, steps, per_prompt, counts, schedulers, other, named, device, teacher_dtype, prompts,
                 firsts)  # fmt: skip


@dataclass
class _Judged:
    """The teacher's side of an evaluation, against which each student step count is judged."""

    prompts: list[str]  # one per image
    latents: torch.Tensor
    images: torch.Tensor
    seconds: list[float]
    calls: float
    given: torch.Tensor | None  # an image-to-video run's first frames, one per image
    video: bool
    settings: EvalSettings

    def __post_init__(self):
        # Quality as the field measures it (accuracy, FID/KID, diversity on the pocket teacher; CLIP / Inception FID).
        self.quality_of = eval_clip_quality if self.video else eval_quality
        s = self.settings
        self.quality = self.quality_of(self.prompts, {"teacher": self.images}, s.clip_model, s.fid_reference)

    def student(self, n: int, latents: torch.Tensor, images: torch.Tensor, seconds: list[float]) -> dict:
        """One step count's result: its rows (per image), their means and quality figures."""
        mse = ((latents - self.latents) ** 2).flatten(1).mean(1).tolist()
        pictures = (clip_metrics if self.video else image_metrics)(images, self.images)
        if self.given is not None:  # how well each clip keeps its given first frame (frame 0 against the image, dB)
            pictures = [p | {"first_frame_psnr": f} for p, f in zip(pictures, first_frame_psnr(images, self.given))]
        rows = [
            {"prompt": p, "latent_mse": m, **im, "student_s": s, "teacher_s": t}
            for p, m, im, s, t in zip(self.prompts, mse, pictures, seconds, self.seconds)
        ]
        keys = ("latent_mse", "psnr", "ssim", "student_s", "teacher_s")
        mean = {k: statistics.fmean(r[k] for r in rows) for k in keys}
        if self.given is not None:
            mean["teacher_first_frame_psnr"] = statistics.fmean(first_frame_psnr(self.images, self.given))
            mean["student_first_frame_psnr"] = statistics.fmean(r["first_frame_psnr"] for r in rows)
        mean["speedup"] = mean["teacher_s"] / mean["student_s"]
        mean |= {"student_calls_per_image": calls_per_image(n, 1.0), "teacher_calls_per_image": self.calls}
        s = self.settings
        quality = self.quality | self.quality_of(self.prompts, {"student": images}, s.clip_model, s.fid_reference)
        mean |= quality | diversity_ratio(quality) | (motion_ratio(quality) if self.video else {})
        return {"student_steps": n, "mean": mean, "prompts": rows}


def _record(plan: _Plan, checkpoint: str | None, results: dict, prompts: list[str], video: bool) -> dict:
    """What the json holds: the first step count's result as `mean`/`prompts`, every one under `results`."""
    head = results[str(plan.counts[0])]
    result: dict[str, object] = {
        "student": str(plan.source),
        "checkpoint": checkpoint,
        "steps": plan.steps,
        "teacher_steps": plan.steps,
        "student_trained_steps": plan.run.trained_steps,
        "student_steps": plan.counts,
        "seed": int(plan.run.cfg.seed),
        "per_prompt": plan.per_prompt,
        "images": len(prompts),
        "mean": head["mean"],
    }
    if any(key.endswith("_kid") for key in head["mean"]):
        result["scales"] = {"kid": KID_MEANING}
    withheld = {} if "student_diversity" in head["mean"] else {"diversity": diversity_withheld(plan.per_prompt)}
    if video and is_video_pocket(prompts) and "student_clip_fd" not in head["mean"]:
        withheld["clip_fd"] = FD_WITHHELD  # too few clips for a Fréchet distance of the clip features
    if withheld:
        result["withheld"] = withheld
    result |= {
        "device": str(plan.device),
        "teacher_dtype": str(plan.teacher_dtype).removeprefix("torch."),
        "prompts": head["prompts"],
        "results": results,
    }
    result["variant"] = plan.named
    result["teacher"] = teacher_identity(plan.run.spec) | {"recorded": plan.other is None}  # what it was judged against
    stem = result_stem(plan.source, plan.named)
    result["files"] = [f"{stem}.json", f"{stem}.png"] + ([f"{stem}.gif"] if video else [])
    return result


def diversity_withheld(per_prompt: int) -> str:
    """Why eval.json has no `diversity`: one image a prompt, or no judge of these prompts' images."""
    if per_prompt < 2:
        return f"per_prompt {per_prompt}: intra-prompt diversity needs 2 or more images of a prompt (--per-prompt 2)"
    return "no judge for these prompts: diversity reads the pocket judge's features (pocket prompts only)"


def _write(folder: Path, stem: str, result: dict, grid: tuple, video: bool = False) -> None:
    """`<stem>.png` (teacher | student, one image per prompt; for clips the still strip, and `<stem>.gif` the
    animation) then `<stem>.json`, each whole or not at all and never through a link (core.files): no json without its
    figure; a full disk is one line and keeps what was there."""
    teacher, student, prompts = grid
    as_hwc = lambda x: x.movedim(-3, -1).numpy()  # [..., 3, H, W] -> [..., H, W, 3]
    try:
        if video:
            save_clip_grid(as_hwc(teacher), as_hwc(student), prompts, folder / f"{stem}.png", root=folder)
        else:
            save_grid(as_hwc(teacher), as_hwc(student), prompts, folder / f"{stem}.png", root=folder)
        write_in_run(folder, f"{stem}.json", json.dumps(result, indent=2))
    except OSError as e:
        raise UserError(
            f"{folder}: {stem}.png/.json{'/.gif' if video else ''} cannot be written ({e.strerror}); free some "
            "space and run it again (what was there is kept)"
        ) from None


def result_stem(source: Path, variant: Sequence[str] = ()) -> str:
    """`eval` for the final student, `eval_<checkpoint>` (eval_best, eval_step_00000050; eval_ema for student_ema/)
    for a checkpoint, then the settings that differ from the run's own (`variant`: eval_student1,
    eval_best_steps20_limit1): evaluating a checkpoint, or at other settings, must not overwrite the end-of-run result
    that metrics.json quotes."""
    return "_".join(["eval", *([] if source.name == "student" else [source.name.removeprefix("student_")]), *variant])


def run_settings(
    run: RunFolder, steps: int | None, limit: int | None, per_prompt: int | None, prompts_path: str | None, trust: Trust
) -> tuple[int, int, int, str | None]:
    """The settings an evaluation samples at: each one given, else the run's own (`own_settings`: what its eval.json
    was drawn at). The run's own prompts file is read where eval may read it unasked (inside the run folder,
    shipped, or the run's own end-of-run evaluation); a received run's file elsewhere is not: its held-out prompts
    are taken, and the result's name says so (`_heldout`), never eval.json."""
    own = own_settings(run)
    # An image-to-video run's own prompts file has no first frames: its held-out captions are drawn (their images).
    takes_file = not image_conditioned(run.cfg.data, run.spec.layout)
    if prompts_path is None and own["prompts_path"] is not None and takes_file:
        readable = trust.own_files or trust.data or _readable_from_run(run, str(own["prompts_path"]))
        prompts_path = str(own["prompts_path"]) if readable else None
    return (
        int(own["steps"]) if steps is None else steps,
        int(own["limit"]) if limit is None else limit,
        int(own["per_prompt"]) if per_prompt is None else per_prompt,
        prompts_path,
    )


def own_settings(run: RunFolder) -> dict:
    """The run's own evaluation settings, the ones `eval.json` stands for: its end-of-run evaluation's
    (`hooks.evaluate` of its saved config: steps, limit, per_prompt, prompts_path), else eval's defaults."""

    hooks = run.cfg.get("hooks")
    node = hooks.get("evaluate") if isinstance(hooks, DictConfig) else None
    if not isinstance(node, DictConfig):
        return dict(DEFAULTS)
    return {key: node.get(key, default) for key, default in DEFAULTS.items()}


def variant(run: RunFolder, asked: dict) -> list[str]:
    """The settings of an evaluation (`asked`: student step counts, teacher steps, limit, per_prompt, a prompts
    file, the teacher dtype, a CLIP model, an FID reference) that differ from the run's own (`own_settings`, its
    own K, its teacher dtype, no CLIP or reference folder), as its file name carries them: `student1-2-4`,
    `steps20`, `limit1`, `perprompt2`, `prompts-<name>-<hash>` (or `heldout`), `bf16`, `clip-…`, `fid-…`."""
    own = own_settings(run)
    own_counts = [run.trained_steps or asked["steps"]]  # a KD student samples at the teacher's steps
    parts = []
    if list(asked["student"]) != own_counts:
        parts.append("student" + "-".join(str(n) for n in asked["student"]))
    parts += [f"{k.replace('_', '')}{asked[k]}" for k in ("steps", "limit", "per_prompt") if asked[k] != own[k]]
    if not _same_file(asked["prompts"], own["prompts_path"]):
        parts.append(_tag("prompts", asked["prompts"]) if asked["prompts"] is not None else "heldout")
    if asked["dtype"] != DTYPES.get(str(run.cfg.precision.teacher_dtype)):
        parts.append({v: k for k, v in DTYPES.items()}[asked["dtype"]])
    parts += [_tag(key, asked[key]) for key in ("clip", "fid") if asked[key] is not None]
    return parts


def _same_file(a: str | None, b: str | None) -> bool:
    """Whether two prompts files are one (None: the run's held-out prompts), as read: relative to here."""
    if a is None or b is None:
        return a is None and b is None
    return Path(str(a)).expanduser().resolve() == Path(str(b)).expanduser().resolve()


def _tag(key: str, value: str) -> str:
    """A file or model in a file name: its last part as letters and digits, and a short hash of the whole (two
    folders' `prompts.txt` are two names)."""
    slug = re.sub(r"[^a-z0-9]+", "-", Path(str(value)).stem.lower()).strip("-")[:24] or key
    where = str(Path(str(value)).expanduser().resolve()) if Path(str(value)).expanduser().exists() else str(value)
    return f"{key}-{slug}-{hashlib.blake2b(where.encode(), digest_size=3).hexdigest()}"
