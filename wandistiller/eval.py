"""`python -m wandistiller.eval <run_dir>`: how close the student's samples come to its teacher's.

Both sample through WanPipeline from the same noise, prompt, scheduler and steps (the teacher with its
CFG and experts, the student alone without CFG). Per prompt and on average: latent MSE, PSNR and SSIM of
the decoded images against the teacher's (torchmetrics), and each one's seconds per image. Writes one
result per student evaluated into the run folder, so no evaluation overwrites another: `eval.json` and
`eval.png` (teacher | student) for the final student (what metrics.json's `eval_*` figures come from),
`eval_best.json`/`eval_step_XXXXXXXX.json` (and `.png`) for a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

import torch

from wandistiller.core.errors import UserError, exit_on_user_error, internal_errors_reported, positive_int
from wandistiller.core.files import check_appended, folder_problem, in_run, write_in_run
from wandistiller.core.precision import to_dtype
from wandistiller.data.prompts import encode_prompts, read_prompts
from wandistiller.data.validation import split_prompts
from wandistiller.job.stopping import stop_at_once
from wandistiller.quality.metrics import eval_quality
from wandistiller.state.runs import (
    RunFolder,
    Trust,
    add_trust_args,
    as_sampler,
    check_teacher_fits,
    generate,
    load_student,
    load_teacher,
    open_run,
    student_source,
)

log = logging.getLogger(__name__)


def eval_prompts(run: RunFolder, prompts_path: str | None, limit: int, own_files: bool = False,
                 allow_data: bool = False) -> list[str]:  # fmt: skip
    """The given file, or the run's held-out prompts (never trained on); `own_files`: the saved prompts
    files are the user's own (the end-of-run eval), so they are read wherever they lie."""
    if prompts_path is not None:
        return read_prompts(prompts_path)[:limit]
    data = run.cfg.data
    for key in ("prompts_path", "val_prompts_path"):
        if data.get(key) is not None and not own_files and not _readable_from_run(run, data[key]):
            raise UserError(
                f"data.{key}={str(data[key])!r} in the run's saved config lies outside the run folder and "
                "WanDistiller's shipped prompts, so eval does not read it; give --prompts FILE"
            )
    if data.get("latents") == "images":  # an image run holds out the last val_fraction of its own captions
        from wandistiller.data.images import image_source

        for key in ("root", "dataset") if not data.get("val_prompts_path") else ():  # the sender's files: read
            if data.get(key) is not None and not (own_files or allow_data) and not _readable_from_run(run, data[key]):
                raise UserError(
                    f"data.{key}={str(data[key])!r} in the run's saved config lies outside the run folder, so eval "
                    "does not read its captions; give --prompts FILE, or --allow-data if you trust that folder"
                )

        captions = read_prompts(data.val_prompts_path) if data.get("val_prompts_path") else image_source(data).captions
        held_out = split_prompts(captions, None, data.get("val_fraction", 0.1)) if not data.get("val_prompts_path") \
            else (None, captions)  # fmt: skip
        return held_out[1][:limit]
    held_out = split_prompts(
        read_prompts(data.prompts_path), data.get("val_prompts_path"), data.get("val_fraction", 0.1)
    )
    return held_out[1][:limit]


def _readable_from_run(run: RunFolder, path: str) -> bool:
    """A saved prompts file eval may read without being told: inside the run folder, or a shipped asset.
    Anything else is the sender's choice of file on this machine; the user names a file with --prompts."""
    where = Path(str(path)).expanduser()
    where = where.resolve()  # as read_prompts reads it: relative to the working directory
    shipped = (Path(__file__).parent / "assets").resolve()
    return where.is_relative_to(run.path.resolve()) or where.is_relative_to(shipped)


def image_metrics(student_imgs: torch.Tensor, teacher_imgs: torch.Tensor) -> list[dict]:
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    rows = []
    for s, t in zip(student_imgs, teacher_imgs):
        rows.append(
            {
                "psnr": float(peak_signal_noise_ratio(s[None], t[None], data_range=1.0)),
                "ssim": float(structural_similarity_index_measure(s[None], t[None], data_range=1.0)),
            }
        )
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
) -> dict:
    """Run the evaluation and write its json and png (`result_stem`); returns what the json holds."""
    from wandistiller.recipe.samples import save_grid
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
    idx, seed = list(range(len(prompts))), int(run.cfg.seed)
    teacher_lat, teacher_s = generate(load_teacher(run, device, teacher_dtype), emb, idx, seed, steps, run.latent_shape,
                                      "eval: the teacher")  # fmt: skip
    student = as_sampler(run.spec, load_student(run, source, device), device)
    student_lat, student_s = generate(student, emb, idx, seed, steps, run.latent_shape, "eval: the student")
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
    result = {"student": str(source), "checkpoint": checkpoint, "steps": steps, "seed": seed, "mean": mean}
    result |= {"device": str(device), "teacher_dtype": str(teacher_dtype).removeprefix("torch."), "prompts": rows}
    stem = result_stem(source)
    result["files"] = [f"{stem}.json", f"{stem}.png"]
    as_hwc = lambda x: x.permute(0, 2, 3, 1).numpy()
    try:  # each whole or not at all, the figure first, never through a link (core.files): no eval.json without its png
        save_grid(as_hwc(teacher_imgs), as_hwc(student_imgs), prompts, run.path / f"{stem}.png", root=run.path)
        write_in_run(run.path, f"{stem}.json", json.dumps(result, indent=2))
    except OSError as e:
        raise UserError(f"{run.path}: {stem}.png/.json cannot be written ({e.strerror}); free some space and "
                        "run it again (what was there is kept)") from None  # fmt: skip
    return result


def result_stem(source: Path) -> str:
    """`eval` for the final student, `eval_<checkpoint>` (eval_best, eval_step_00000050) for a checkpoint:
    evaluating a checkpoint must not overwrite the end-of-run result that metrics.json quotes."""
    return "eval" if source.name == "student" else f"eval_{source.name}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m wandistiller.eval", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run folder (outputs/<date>/<time>)")
    parser.add_argument("--checkpoint", help="best, latest or step_N (default: the final student, else latest)")
    parser.add_argument("--prompts", help="prompts file, one per line (default: the run's held-out prompts)")
    parser.add_argument("--steps", type=positive_int, default=20, help="sampling steps for both (default 20)")
    parser.add_argument("--limit", type=positive_int, default=8, help="at most this many prompts (default 8)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="teacher dtype (default: the run's)")
    parser.add_argument("--clip-model", help="CLIP score with this CLIP model (Hub id or folder; real Wan teachers)")
    parser.add_argument("--fid-reference", help="Inception FID against this folder of images (needs torch-fidelity)")
    add_trust_args(parser, wandb=True)
    parser.add_argument("--allow-data", action="store_true", help="read an image run's captions from its saved "
                        "data.root/data.dataset outside the run folder (only for run folders you trust)")  # fmt: skip
    return parser.parse_args(argv)


ON_STOP = "eval.json is written only at the end, so nothing was; run it again"  # what a SIGTERM or Ctrl-C leaves


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with (
        internal_errors_reported(),
        exit_on_user_error(),
        stop_at_once(ON_STOP),
    ):
        trust = Trust.from_args(args)
        result = evaluate(args.run_dir, args.checkpoint, args.prompts, args.steps, args.limit, args.dtype, None,
                          args.clip_model, args.fid_reference, trust)  # fmt: skip
        m = result["mean"]
        print(
            f"latent MSE {m['latent_mse']:.4g}  PSNR {m['psnr']:.2f} dB  SSIM {m['ssim']:.3f}  "
            f"student {m['student_s']:.3f} s/img  teacher {m['teacher_s']:.3f} s/img  ({m['speedup']:.1f}x)"
        )
        quality = {k: v for k, v in m.items() if k.startswith(("teacher_", "student_")) and not k.endswith("_s")}
        if quality:
            print("  ".join(f"{k} {v:.3g}" for k, v in quality.items()))
        if "teacher_samples" in m and "teacher_fid" not in m:
            print(f"FID/KID withheld: {m['teacher_samples']} images each, too few for the judge's features to mean "
                  "anything (65 or more: raise --limit)")  # fmt: skip
        print(f"wrote {Path(args.run_dir) / result['files'][0]} and {result['files'][1]}")
        log_to_run(Path(args.run_dir), result, trust)


def log_to_run(run_dir: Path, result: dict, trust: Trust | None = None) -> None:
    """Add the evaluation to every logger the run was saved with (csv, tensorboard, wandb, ...), in the run folder.
    wandb continues the run's own run (its id is in the run's checkpoints; none: wandb is skipped), offline,
    whatever the saved config says, unless `--wandb-mode online` is given here."""

    from omegaconf import OmegaConf

    from wandistiller.state.checkpoint import STATE_FILE, list_checkpoints
    from wandistiller.state.received import load_json, load_received
    from wandistiller.tracking import loggers

    trust = trust or Trust()
    checkpoints = list_checkpoints(run_dir)
    saved = load_received(in_run(run_dir, ".hydra/config.yaml"), trust.targets)  # its `_target_`s vetted
    run_id = load_json(checkpoints[-1] / STATE_FILE).get("tracker_run_id") if checkpoints else None
    nodes = {}
    for key, node in loggers.entries(saved.logger):
        if str(node.get("_target_", "")).endswith("WandbTracker"):
            if not run_id:
                continue  # no run to continue: a new wandb run for one evaluation would be a stray
            node = OmegaConf.merge(node, {"mode": trust.wandb_mode})
        nodes[key] = node
    if not nodes:
        return
    tracker = loggers.build(OmegaConf.create(nodes))
    tracker.start(run_dir, {}, run_id)  # start_step None: a finished run's rows are kept
    try:
        step = evaluated_step(run_dir, Path(result["student"]))
        metrics = {f"eval/{k}": v for k, v in result["mean"].items()}
        at_step, past_step = _split_by_step(tracker.loggers, step)
        named = {} if step is None else {"eval/step": step}
        for group, at, extra in ((at_step, step, {}), (past_step, None, named)):
            if group.loggers:
                group.log(metrics | extra, step=at)
                group.log_image("eval", run_dir / result["files"][1], step=at)
        tracker.finish({f"eval_{k}": v for k, v in result["mean"].items()})
    finally:
        tracker.close()
    if tracker.run_id:
        print(f"logged to the run's wandb run {tracker.run_id}")
    print(f"logged to the run's loggers: {', '.join(nodes)}")


def evaluated_step(run_dir: Path, student: Path) -> int | None:
    """The training step of the student evaluated, where its numbers belong in the run's charts: a checkpoint's
    own step; for the final student the run's last step (metrics.json's final_step, written with it; else the
    latest checkpoint's, as the last step is always checkpointed). None where neither can be read."""
    from wandistiller.state.checkpoint import checkpoint_step, list_checkpoints
    from wandistiller.state.received import load_json

    if student.name != "student":
        step = checkpoint_step(student)
        return step if step >= 0 else None
    try:
        final = load_json(in_run(run_dir, "metrics.json")).get("final_step")
    except (OSError, ValueError, AttributeError, UserError):
        final = None
    if isinstance(final, int) and not isinstance(final, bool):
        return final
    checkpoints = list_checkpoints(run_dir)
    step = checkpoint_step(checkpoints[-1]) if checkpoints else -1
    return step if step >= 0 else None


def _split_by_step(started: list, step: int | None) -> tuple:
    """(the loggers that take numbers at `step`, those that do not) as two `Loggers`. wandb keeps only steps at or
    after its run's current one and drops an earlier step's numbers with a warning: a resumed online run continues
    after the run's last step (an offline one starts at 0), so there the numbers go to wandb's next step, with
    `eval/step` naming the step evaluated (a chart's x-axis in wandb)."""
    from wandistiller.tracking.loggers import Loggers
    from wandistiller.tracking.loggers.wandb import WandbTracker

    def takes(logger) -> bool:
        run = getattr(logger, "run", None) if isinstance(logger, WandbTracker) else None
        return step is not None and (run is None or step >= run.step)

    return Loggers([lg for lg in started if takes(lg)]), Loggers([lg for lg in started if not takes(lg)])


if __name__ == "__main__":
    sys.exit(main())
