"""A run's student against its teacher: both sample through WanPipeline from the same noise, prompt, scheduler and
steps (the teacher with its CFG and experts, the student alone without CFG). Per prompt and on average: latent MSE,
PSNR and SSIM of the decoded images against the teacher's (torchmetrics), each one's seconds per image, and the
quality figures (metrics.py). One result per student evaluated is written into the run folder, so no evaluation
overwrites another: `eval.json` and `eval.png` (teacher | student) for the final student (what metrics.json's
`eval_*` figures come from), `eval_best.json`/`eval_step_XXXXXXXX.json` (and `.png`) for a checkpoint.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from wandistiller.core.errors import UserError
from wandistiller.core.files import check_appended, folder_problem, write_in_run
from wandistiller.core.precision import to_dtype
from wandistiller.data.prompts import encode_prompts, read_prompts
from wandistiller.evaluation.grids import save_grid
from wandistiller.evaluation.metrics import eval_quality
from wandistiller.state.runs import (
    RunFolder,
    Trust,
    as_sampler,
    check_teacher_fits,
    generate,
    load_student,
    load_teacher,
    open_run,
    student_source,
)


def eval_prompts(run: RunFolder, prompts_path: str | None, limit: int, own_files: bool = False,
                 allow_data: bool = False) -> list[str]:  # fmt: skip
    """The given file, or the run's held-out prompts (never trained on: its data source's own split); `own_files`:
    the saved files are the user's own (the end-of-run eval), so they are read wherever they lie; `allow_data`:
    the user trusts a received run's data folders."""
    from wandistiller.data.sources import source_of

    if prompts_path is not None:
        return read_prompts(prompts_path)[:limit]
    data = run.cfg.data
    for key in ("prompts_path", "val_prompts_path"):
        if data.get(key) is not None and not own_files and not _readable_from_run(run, data[key]):
            raise UserError(
                f"data.{key}={str(data[key])!r} in the run's saved config lies outside the run folder and "
                "WanDistiller's shipped prompts, so eval does not read it; give --prompts FILE"
            )

    def readable(key: str) -> None:  # a data folder the source reads its captions from: the sender's files
        if data.get(key) is not None and not (own_files or allow_data) and not _readable_from_run(run, data[key]):
            raise UserError(
                f"data.{key}={str(data[key])!r} in the run's saved config lies outside the run folder, so eval "
                "does not read its captions; give --prompts FILE, or --allow-data if you trust that folder"
            )

    return source_of(data).held_out_prompts(data, readable)[:limit]


def _readable_from_run(run: RunFolder, path: str) -> bool:
    """A saved prompts file eval may read without being told: inside the run folder, or a shipped asset.
    Anything else is the sender's choice of file on this machine; the user names a file with --prompts."""
    where = Path(str(path)).expanduser()
    where = where.resolve()  # as read_prompts reads it: relative to the working directory
    shipped = (Path(__file__).parents[1] / "assets").resolve()
    return where.is_relative_to(run.path.resolve()) or where.is_relative_to(shipped)


def image_metrics(student_imgs: torch.Tensor, teacher_imgs: torch.Tensor) -> list[dict]:
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    rows = []
    for s, t in zip(student_imgs, teacher_imgs):
        psnr = peak_signal_noise_ratio(s[None], t[None], data_range=1.0)
        ssim = structural_similarity_index_measure(s[None], t[None], data_range=1.0)
        assert isinstance(psnr, torch.Tensor) and isinstance(ssim, torch.Tensor)  # one value each, as asked
        rows.append({"psnr": float(psnr), "ssim": float(ssim)})
    return rows


def evaluate(
    run_dir: str | Path,
    checkpoint: str | None = None,
    prompts_path: str | None = None,
    steps: int = 20,
    limit: int = 8,
    dtype: str | None = None,
    device: torch.device | None = None,
    clip_model: str | None = None,
    fid_reference: str | None = None,
    trust: Trust | None = None,
    per_prompt: int = 1,
) -> dict:
    """Run the evaluation and write its json and png (`result_stem`); returns what the json holds. Each prompt is
    drawn from `per_prompt` noises (FID/KID need 65 images or more: 4 held-out prompts x 17, say); the grid shows
    each prompt's first."""
    from wandistiller.teacher.vae import decode_latents, load_vae

    run = open_run(run_dir, *(trust or Trust()).open_args())
    source = student_source(run, checkpoint)
    check_teacher_fits(run, source, (trust or Trust()).other_teacher or (trust or Trust()).own_files)
    problem = folder_problem(run.path)
    if problem:  # eval.json and eval.png go there: said before minutes of sampling, not after
        raise UserError(f"{run.path}: {problem}; evaluate a writable copy of the run folder")
    check_appended(run.path)  # the loggers' files it adds to, checked before the sampling, not after
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    teacher_dtype = to_dtype(dtype or run.cfg.precision.teacher_dtype, "--dtype")
    prompts = eval_prompts(run, prompts_path, limit, (trust or Trust()).own_files, (trust or Trust()).data)
    t_cfg = run.cfg.teacher
    cache_dir = run.cfg.paths.cache_dir
    emb = encode_prompts(
        run.spec, prompts, t_cfg.negative_prompt, t_cfg.max_sequence_length, teacher_dtype, device, cache_dir
    )
    idx, seed, shape = list(range(len(prompts))), int(run.cfg.seed), run.latent_shape
    teacher_lat, teacher_s = generate(load_teacher(run, device, teacher_dtype), emb, idx, seed, steps, shape,
                                      "eval: the teacher", per_prompt)  # fmt: skip
    student = as_sampler(run.spec, load_student(run, source, device), device)
    student_lat, student_s = generate(student, emb, idx, seed, steps, shape, "eval: the student", per_prompt)
    prompts, first = [p for p in prompts for _ in range(per_prompt)], slice(None, None, per_prompt)  # image by image
    vae = load_vae(run.spec, device)
    teacher_imgs, student_imgs = decode_latents(vae, teacher_lat), decode_latents(vae, student_lat)
    mse = ((student_lat - teacher_lat) ** 2).flatten(1).mean(1).tolist()
    rows = [
        {"prompt": p, "latent_mse": m, **im, "student_s": s, "teacher_s": t}
        for p, m, im, s, t in zip(prompts, mse, image_metrics(student_imgs, teacher_imgs), student_s, teacher_s)
    ]
    mean = {k: statistics.fmean(r[k] for r in rows) for k in ("latent_mse", "psnr", "ssim", "student_s", "teacher_s")}
    mean["speedup"] = mean["teacher_s"] / mean["student_s"]
    # Quality as the field measures it (prompt accuracy, FID/KID on the pocket teacher; CLIP / Inception FID).
    mean |= eval_quality(prompts, {"teacher": teacher_imgs, "student": student_imgs}, clip_model, fid_reference)
    result: dict[str, object] = {"student": str(source), "checkpoint": checkpoint, "steps": steps, "seed": seed,
                                 "per_prompt": per_prompt, "images": len(prompts)}  # fmt: skip
    result["mean"] = mean
    result |= {"device": str(device), "teacher_dtype": str(teacher_dtype).removeprefix("torch."), "prompts": rows}
    stem = result_stem(source)
    result["files"] = [f"{stem}.json", f"{stem}.png"]
    _write(run.path, stem, result, (teacher_imgs[first], student_imgs[first], prompts[first]))
    return result


def _write(folder: Path, stem: str, result: dict, grid: tuple) -> None:
    """`<stem>.png` (teacher | student, one image per prompt) then `<stem>.json`, each whole or not at all and never
    through a link (core.files): no json without its figure; a full disk is one line and keeps what was there."""
    teacher, student, prompts = grid
    as_hwc = lambda x: x.permute(0, 2, 3, 1).numpy()  # noqa: E731
    try:
        save_grid(as_hwc(teacher), as_hwc(student), prompts, folder / f"{stem}.png", root=folder)
        write_in_run(folder, f"{stem}.json", json.dumps(result, indent=2))
    except OSError as e:
        raise UserError(f"{folder}: {stem}.png/.json cannot be written ({e.strerror}); free some space and "
                        "run it again (what was there is kept)") from None  # fmt: skip


def result_stem(source: Path) -> str:
    """`eval` for the final student, `eval_<checkpoint>` (eval_best, eval_step_00000050) for a checkpoint:
    evaluating a checkpoint must not overwrite the end-of-run result that metrics.json quotes."""
    return "eval" if source.name == "student" else f"eval_{source.name}"
