"""`python -m wandistiller.eval <run_dir>`: how close the student's samples come to its teacher's (the library:
wandistiller/evaluation/).

Both sample through WanPipeline from the same noise and prompts: the teacher with its CFG, experts and
scheduler at --steps; the student alone without CFG at its own steps (a few-step student at its K with its
few-step scheduler, a KD student at --steps with the teacher's), or at each of --student-steps 1,2,4. Per prompt
and on average: latent MSE, PSNR and SSIM of the decoded images against the teacher's (torchmetrics), each one's
seconds and network calls per image, and quality (prompt accuracy, FID/KID, intra-prompt diversity). Writes one
result per student and settings into the run folder, so no evaluation overwrites another: `eval.json` and
`eval.png` (teacher | student) for the final student at the run's own evaluation settings (what metrics.json's
`eval_*` figures come from), `eval_best.json`/`eval_step_XXXXXXXX.json` (and `.png`) for a checkpoint, and each
setting that differs from the run's own in the name: `eval_student1.json`, `eval_best_steps20.json`. Unset,
--steps, --limit, --per-prompt and --prompts are the run's own (its `hooks.evaluate`): `eval RUN` is its eval.json.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from wandistiller.compose import register_configs
from wandistiller.core.errors import (
    OneLineParser,
    UserError,
    counted,
    description,
    whole_number,
)
from wandistiller.core.stopping import tool_session
from wandistiller.data.prompts import read_prompts
from wandistiller.evaluation.evaluate import DEFAULTS, EvalSettings, evaluate
from wandistiller.evaluation.logged import log_to_run, login_problem
from wandistiller.evaluation.metrics import check_real_metrics
from wandistiller.state.runs import given_run_folder, run_config_file
from wandistiller.state.trust import Trust, add_trust_args

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; a count that is not a whole number of 1 or more is one `error:` line (UserError)."""
    parser = OneLineParser(prog="python -m wandistiller.eval", description=description(__doc__))
    parser.add_argument("run_dir", help="a run folder (outputs/<date>/<time>)")
    parser.add_argument("--checkpoint", help="best, latest, step_N or ema (default: the final student, else latest)")
    own = "the run's own end-of-run evaluation's, hooks.evaluate."  # what eval.json was drawn at
    parser.add_argument(
        "--prompts", help=f"prompts file, one per line (default: {own}prompts_path, else the run's held-out prompts)"
    )
    parser.add_argument(
        "--steps",
        metavar="N",
        help=f"the teacher's steps, a KD student's too (default: {own}steps, else {DEFAULTS['steps']})",
    )
    parser.add_argument(
        "--student-steps",
        metavar="N[,N...]",
        help="the student's steps, one result each (e.g. 1,2,4; default: a few-step student's own K, a KD student "
        "--steps)",
    )
    parser.add_argument(
        "--limit", metavar="N", help=f"at most this many prompts (default: {own}limit, else {DEFAULTS['limit']})"
    )
    parser.add_argument(
        "--per-prompt",
        metavar="N",
        help=f"images per prompt, each from its own noise (default: {own}per_prompt, else "
        f"{DEFAULTS['per_prompt']}; FID/KID need 65 images or more in all)",
    )
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="teacher dtype (default: the run's)")
    parser.add_argument("--clip-model", help="CLIP score with this CLIP model (Hub id or folder; real Wan teachers)")
    parser.add_argument("--fid-reference", help="Inception FID against this folder of images (needs torch-fidelity)")
    add_trust_args(parser, wandb=True)
    parser.add_argument(
        "--allow-data",
        action="store_true",
        help="read the run's saved data files outside the run folder: its prompts files (data.prompts_path, "
        "data.val_prompts_path, hooks.evaluate.prompts_path) and an image run's captions (data.root/data.dataset); "
        "only for run folders you trust",
    )
    args = parser.parse_args(argv)
    # unset: the run's own settings (evaluate reads them from the run's saved config), so `eval RUN` is its eval.json
    args.steps = None if args.steps is None else whole_number(str(args.steps), "--steps", example=20)
    args.limit = None if args.limit is None else whole_number(str(args.limit), "--limit", example=8)
    args.per_prompt = None if args.per_prompt is None else whole_number(str(args.per_prompt), "--per-prompt", example=2)
    args.student_counts = step_counts(args.student_steps)
    return args


ON_STOP = "eval.json is written only at the end, so nothing was; run it again"  # what a SIGTERM or Ctrl-C leaves


def step_counts(text: str | None) -> list[int] | None:
    """--student-steps: whole numbers of 1 or more, comma-separated; a bad one is one line (exit 2)."""
    if text is None:
        return None
    counts = []
    for part in text.split(","):
        try:
            counts.append(int(part.strip()))
        except ValueError:
            raise UserError(
                f"--student-steps {text!r}: {part.strip()!r} is not a whole number; give step counts "
                "of 1 or more, e.g. --student-steps 1,2,4"
            ) from None
        if counts[-1] < 1:
            raise UserError(
                f"--student-steps {text!r}: {counts[-1]} is not 1 or more; give step counts of 1 or "
                "more, e.g. --student-steps 1,2,4"
            )
    return counts


def main(argv: list[str] | None = None) -> None:
    with tool_session(stop=ON_STOP):
        args = parse_args(argv)
        trust, counts = Trust.from_args(args), args.student_counts
        if args.prompts is not None:  # named by its flag (evaluate reads it as a data.prompts_path would be)
            read_prompts(args.prompts, "--prompts")
        run_dir = given_run_folder(args.run_dir)
        run_config_file(run_dir)  # a mistyped folder first, before a model loads
        check_real_metrics(args.clip_model, args.fid_reference)
        register_configs()  # the registries' options, which the run's config may name
        login = login_problem(run_dir, trust) if args.wandb_mode == "online" else None
        if login:  # said now, not after the teacher sampled
            raise UserError(f"--wandb-mode online: {login}; log in first, or drop the flag")
        asked = EvalSettings(
            checkpoint=args.checkpoint,
            prompts_path=args.prompts,
            steps=args.steps,
            limit=args.limit,
            per_prompt=args.per_prompt,
            student_steps=counts,
            dtype=args.dtype,
            clip_model=args.clip_model,
            fid_reference=args.fid_reference,
            trust=trust,
        )
        result = evaluate(args.run_dir, asked)
        for one in result["results"].values():
            m = one["mean"]
            print(
                f"student at {counted(one['student_steps'], 'step')}: latent MSE {m['latent_mse']:.4g}  PSNR "
                f"{m['psnr']:.2f} dB  SSIM {m['ssim']:.3f}  student {m['student_s']:.3f} s/img "
                f"({counted(m['student_calls_per_image'], 'call')})  teacher {m['teacher_s']:.3f} s/img "
                f"({counted(m['teacher_calls_per_image'], 'call')})  ({m['speedup']:.1f}x)"
            )
            quality = {
                k: v
                for k, v in m.items()
                if k.startswith(("teacher_", "student_", "diversity", "motion_ratio"))
                and not k.endswith(("_s", "_calls_per_image"))
            }
            if quality:
                print("  ".join(f"{k} {v:.3g}" for k, v in quality.items()))
        if "scales" in result:  # what an unscaled figure (KID) is, once
            print(*result["scales"].values(), sep="\n")
        m = result["mean"]
        if "diversity" in result.get("withheld", {}):
            print(f"diversity withheld: {result['withheld']['diversity']}")
        if "clip_fd" in result.get("withheld", {}):
            print(f"clip_fd withheld: {result['withheld']['clip_fd']}")
        if "teacher_samples" in m and "teacher_fid" not in m and "teacher_frame_accuracy" not in m:
            print(
                f"FID/KID withheld: {m['teacher_samples']} images each, too few for the judge's features to mean "
                "anything (65 or more: raise --limit or --per-prompt)"
            )
        print(f"wrote {Path(args.run_dir) / result['files'][0]} and {' and '.join(result['files'][1:])}")
        log_to_run(Path(args.run_dir), result, trust)


if __name__ == "__main__":
    main()
