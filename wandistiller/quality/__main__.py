"""`python -m wandistiller.quality [--compression] [--small] [--seeds 0 1 2] [--steps N] [--batch-size N]
[--student half] [--teacher pocket] [--jobs N] [--out docs/QUALITY.md]`.

Trains the comparison's students on the pocket teacher, prints the table (mean ± spread over seeds) and
writes it, with the command and the machine, to its own section of `--out` (the rest of the file, hand-written
notes included, is kept). Without `--compression`: where x0 comes from and which loss (compare.py); with it:
half, quarter and tenth students, pruned or random starts, output or several-layer KD, and `compression.png`
beside the report (compression.py). `--small` is the CI-sized run (2 steps, 6 prompts, 1 seed) that checks the
whole path in a minute or two; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from wandistiller.core.errors import OneLineParser, UserError, description, exit_on_user_error
from wandistiller.core.files import enclosing_run, output_problem, read_in, read_text_in, run_holding, write_in_run
from wandistiller.core.hydra import shipped_asset
from wandistiller.core.plugins import conf_options
from wandistiller.evaluation.metrics import KID_MEANING
from wandistiller.quality import compression, fewstep, i2v, stacking, video
from wandistiller.quality.compare import COLUMNS, Settings, compare, prompt_set
from wandistiller.teacher.finetune import with_loras
from wandistiller.teacher.spec import inspect_teacher

SHIPPED_REPORT = Path(__file__).resolve().parents[2] / "docs" / "QUALITY.md"  # in a clone of the project
SMALL_OUT = Path("outputs/quality-small.md")  # outputs/ is git-ignored
START = "<!-- quality:"  # how each section of a report begins (write_section): what marks a file as a report
FORMATS = {
    "prompt_accuracy": "{:.1%}",
    "fid": "{:.2f}",
    "kid": "{:.3f}",
    "latent_mse": "{:.4f}",
    "params": "{:,.0f}",
    "s_per_image": "{:.3f}",
    "train_s": "{:.0f}",
    "share": "{:.1%}",
    "calls": "{:.0f}",
    "diversity": "{:.2f}",
    "diversity_ratio": "{:.2f}",
    "peak_rss_gib": "{:.2f}",
    "style_brightness": "{:.3f}",
    "style_kept": "{:.0%}",
    "frame_accuracy": "{:.1%}",
    "motion_accuracy": "{:.1%}",
    "motion_ratio": "{:.2f}",
    "temporal_consistency": "{:.1%}",
    "clip_fd": "{:.2f}",
    "identity_held": "{:.1%}",
    "first_frame_psnr": "{:.1f}",
}


def cell(values: list[float], key: str) -> str:
    """Mean ± spread over seeds, leaving out the withheld (nan) ones as `seed_mean` does; nan where all are."""
    fmt = FORMATS[key]
    values = [v for v in values if not math.isnan(v)] or [math.nan]
    if len(values) < 2 or key in ("params", "share", "calls"):
        return fmt.format(statistics.fmean(values))
    return f"{fmt.format(statistics.fmean(values))} ± {fmt.format(statistics.pstdev(values)).rstrip('%')}"


def table(results: dict[str, list[dict]], keys: list[str] | None = None, formats: dict[str, str] | None = None) -> str:
    """Markdown: one row per setting, each column the mean (± population std) over seeds (`formats` names the
    format a column takes where it is not its own name's, e.g. params as a share)."""
    keys, formats = keys or COLUMNS + ["train_s"], formats or {}
    lines = ["| | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, runs in results.items():
        cells = [cell([r[k] for r in runs], formats.get(k, k)) if k in runs[0] else "" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(results: dict[str, list[dict]]) -> list[str]:
    """The teacher's and the data sources' targets, each met or missed, from the means."""
    mean = {
        row: {k: statistics.fmean(r[k] for r in runs) for k in ("prompt_accuracy", "fid")}
        for row, runs in results.items()
    }
    teacher, rows = mean.pop("teacher"), list(mean)
    gaussian, latents, images, task = (mean[r] for r in rows[:4])
    mark = lambda ok: "met" if ok else "MISSED"
    lines = [
        f"- teacher's guided samples >= 90% prompt accuracy: {teacher['prompt_accuracy']:.1%}, "
        f"{mark(teacher['prompt_accuracy'] >= 0.9)}"
    ]
    for row in rows[:3]:
        ratio = mean[row]["prompt_accuracy"] / max(teacher["prompt_accuracy"], 1e-9)
        fid = mean[row]["fid"] / teacher["fid"]
        lines.append(
            f"- {row}: {ratio:.0%} of the teacher's accuracy (target >= 85%), FID {fid:.2f}x the "
            f"teacher's (target <= 1.5x): {mark(ratio >= 0.85 and fid <= 1.5)}"
        )
    beats = images["prompt_accuracy"] > task["prompt_accuracy"] and images["fid"] < task["fid"]
    lines.append(f"- distilling (images) beats no teacher at the same steps: {mark(beats)}")
    better = latents["prompt_accuracy"] > gaussian["prompt_accuracy"] and latents["fid"] < gaussian["fid"]
    lines.append(f"- teacher latents beat Gaussian x0 on accuracy and FID: {mark(better)}")
    return lines


def shown(argv: list[str]) -> str:
    """The command as a report shows it: without `--work` and `--out` and their values, which are paths of the
    machine that ran it and mean nothing on a reader's."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--work", "--out"):
            skip = True
        elif not arg.startswith(("--work=", "--out=")):
            kept.append(arg)
    return " ".join(kept)


def written_by(argv: list[str], seconds: float, threads: str = ", torch threads 1") -> str:
    """Every report's first sentence: the command that wrote it, when, on what, and how long it took."""
    return (
        f"Written by `python -m wandistiller.quality {shown(argv)}` ({time.strftime('%Y-%m-%d')}, "
        f"{platform.machine()} CPU, {os.cpu_count()} cores{threads}; {seconds / 60:.1f} min in all)."
    )


def with_targets(table_text: str, issue: int, lines: list[str], between: str = "") -> str:
    """A report's table, then (after `between`) the issue's targets, each met or missed, from the means."""
    return table_text + f"\n\n{between}Targets (issue {issue}), from the means above:\n\n" + "\n".join(lines) + "\n"


def report(results: dict, settings: Settings, argv: list[str], seconds: float) -> str:

    return (
        written_by(argv, seconds)
        + f" Every student: `student={settings.student}`, {settings.max_steps} steps of batch {settings.batch_size}; "
        "samples: "
        f"{settings.sample_steps} UniPC steps, {settings.per_prompt} per prompt x {len(_prompts(settings))} "
        f"prompts per seed, the same noise for every row; mean ± std over seeds {list(settings.seeds)}.\n\n"
        "prompt_accuracy: digit and colour both as asked (the judge classifier); fid / kid: the judge's "
        f"features against the held-out real digits ({KID_MEANING}); latent_mse: against the teacher's sample "
        "from the same noise; s_per_image: one image per call; train_s: the training run's wall clock.\n\n"
        + with_targets(table(results), 17, targets(results))
    )


def compression_report(
    results: dict, settings: Settings, budgets: dict[str, int], argv: list[str], seconds: float, jobs: int
) -> str:
    steps = ", ".join(f"{size} {steps}" for size, steps in budgets.items())
    return (
        written_by(argv, seconds, f", torch threads 1, {jobs} run(s) at once")
        + " Every student trains on the teacher's images (`data=pocket_digits`) "
        f"with batch {settings.batch_size}, steps per size: {steps}; samples: {settings.sample_steps} UniPC "
        f"steps, {settings.per_prompt} per prompt x {len(_prompts(settings))} prompts per seed, the same noise "
        f"for every row; mean ± std over seeds {list(settings.seeds)}.\n\n"
        "Rows: `student=<size>`; `pruned` is `student.init=teacher` (blocks, heads and channels cut from the "
        "teacher), `random` is `student.init=random`; `output KD` is `loss=distillation`, `several-layer KD` is "
        "`loss=features`. params: the share of the teacher's transformer parameters; train_s: the training "
        "run's wall clock (beside the other runs when several ran at once).\n\n"
        + with_targets(
            table(results, compression.COLUMNS, {"params": "share"}),
            27,
            compression.targets(results),
            "![prompt accuracy against parameters](compression.png)\n\n",
        )
    )


def fewstep_report(results: dict, settings: Settings, argv: list[str], seconds: float) -> str:
    return (
        written_by(argv, seconds)
        + f" Every student: `student={settings.student}` on the teacher's images, {settings.max_steps} steps of batch "
        f"{settings.batch_size}; the teacher samples {settings.sample_steps} UniPC steps with CFG, each student "
        f"its own steps (a KD student on the teacher's scheduler, a few-step one on its own, no CFG); "
        f"{settings.per_prompt} noises per prompt x {len(_prompts(settings))} prompts per seed, the same for every "
        f"row; mean ± std over seeds {list(settings.seeds)}.\n\n"
        "calls: transformer forwards per image; diversity_ratio: the mean pairwise distance of the judge's features "
        "over each prompt's noises, over the teacher's; peak_rss_gib: the training run's peak host memory.\n\n"
        + with_targets(table(results, fewstep.COLUMNS), 28, fewstep.targets(results))
    )


def stacking_report(results: dict, settings: Settings, argv: list[str], seconds: float) -> str:
    """The "Stacking and schedules" subsection of the LoRA students: issue 44's rows and targets."""
    return (
        written_by(argv, seconds)
        + " Every student: `student=lora` with +experiment=pocket_lora's settings (rank 6, dmd + regression 0.1, "
        f"4 steps; the one distilled from the styled teacher at {' '.join(stacking.FINE_TUNED_TEACHER)}), "
        f"{settings.max_steps} steps of batch {settings.batch_size}; the teachers sample {settings.sample_steps} "
        f"UniPC steps with CFG; {settings.per_prompt} noises per prompt x {len(_prompts(settings))} prompts per seed, "
        f"the same for every row; mean ± std over seeds {list(settings.seeds)}.\n\n"
        "prompt_accuracy and fid: the judge on every image scaled to its peak brightness; style_brightness: the "
        "digit's brightness (the mean of its 32 brightest pixels, pocket/style.py); style_kept: the row's change of "
        "it from the plain teacher's, over the styled teacher's change.\n\n"
        + with_targets(table(results, stacking.COLUMNS), 44, stacking.targets(results))
    )


def write_section(out: Path, key: str, text: str) -> None:
    """`text` as the section `key` of `out`, between its markers: replaced where the file has them, appended
    where it does not; the rest of the file (other sections, hand-written notes) stays as it is."""
    start, end = f"{START}{key} -->", f"<!-- /quality:{key} -->"
    section = f"{start}\n{text.rstrip()}\n{end}"
    old = read_text_in(out.parent, out.name) if out.is_file() else "# Student quality on the pocket teacher\n"
    if start in old and end in old:
        new = old[: old.index(start)] + section + old[old.index(end) + len(end) :]
    else:
        new = old.rstrip() + "\n\n" + section + "\n"
    write_in_run(out.parent, out.name, new)  # whole, a link in its place replaced (never written through)


def video_report(results: dict, settings: Settings, argv: list[str], seconds: float) -> str:
    """The "Video" section: the clip comparison's table and issue 40's targets."""
    return (
        written_by(argv, seconds, "")
        + f" Teacher `{settings.teacher}`, clips of 9 frames (`data.latent_frames=5`, the teacher's own clips as "
        "data); every "
        f"cut student `student={settings.student}`, {settings.max_steps} steps of batch {settings.batch_size}; the "
        f"teacher samples {settings.sample_steps} UniPC steps with CFG, {settings.per_prompt} noises per prompt x "
        f"{len(_prompts(settings))} prompts per seed, the same noises for every row; mean ± std over seeds "
        f"{list(settings.seeds)}.\n\n"
        "frame_accuracy: digit and colour as asked on every frame (the frame judge); motion_accuracy: the digit's "
        "fitted centroid track goes the asked way; motion_ratio: the row's mean speed over the teacher's, same "
        "noises; temporal_consistency: clips whose judged digit and colour hold on every frame; clip_fd: Fréchet "
        "distance of the frame judge's clip features (time mean + frame-to-frame change) to the held-out digits' "
        "clips (nan: withheld below 65 clips); diversity_ratio: intra-prompt diversity over the teacher's.\n\n"
        + with_targets(table(results, video.COLUMNS), 40, video.targets(results))
    )


def i2v_report(results: dict, settings: Settings, argv: list[str], seconds: float) -> str:
    """The "Image to video" section of one teacher: the table and issue 42's targets."""
    pair = settings.teacher.endswith("_moe")
    return (
        written_by(argv, seconds, "")
        + f" Teacher `{settings.teacher}`{' (two experts, Wan 2.2 I2V A14B layout)' if pair else ''}, clips of 9 "
        f"frames from a given first frame (`data=image_folder` on the shipped pairs, `data.latent_frames=5`); every "
        f"student {settings.max_steps} steps of batch {settings.batch_size}; the teacher samples "
        f"{settings.sample_steps} UniPC steps with CFG, {settings.per_prompt} noises per prompt x "
        f"{len(_prompts(settings))} prompts per seed, each noise with its own held-out first frame, the same for "
        f"every row; mean ± std over seeds {list(settings.seeds)}.\n\n"
        "identity_held: the given digit and colour on every frame (the frame judge); motion_accuracy: the digit's "
        "fitted centroid track goes the asked way; motion_ratio: the row's mean speed over the teacher's; "
        "first_frame_psnr: frame 0 against the given image (dB, 8-bit); clip_fd: as in the video table.\n\n"
        + with_targets(table(results, i2v.COLUMNS), 42, i2v.targets(results, pair))
    )


def _prompts(settings: Settings) -> list[str]:

    return prompt_set(settings)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m wandistiller.quality", description=description(__doc__))
    parser.add_argument(
        "--compression",
        action="store_true",
        help="the compression curve: half, quarter and tenth "
        "students, pruned or random, output or several-layer KD (writes compression.png too)",
    )
    parser.add_argument(
        "--fewstep",
        action="store_true",
        help="few-step students (trajectory, dmd at 4 and 1 steps) against today's KD student sampled at 4",
    )
    parser.add_argument(
        "--stacking",
        action="store_true",
        help="the 4-step LoRA student at its trained sigmas and at ComfyUI's simple ones, and stacked with a style "
        "LoRA or distilled from the styled teacher (quality/stacking.py)",
    )
    parser.add_argument("--style", type=Path, help="--stacking: the style LoRA (default: the shipped dim-digits LoRA)")
    parser.add_argument("--small", action="store_true", help="CI-sized: 2 steps, 6 prompts, 1 seed, 2 sampling steps")
    parser.add_argument("--jobs", type=int, default=1, help="--compression: runs trained at once (default 1)")
    parser.add_argument("--seeds", type=int, nargs="+", help="training and noise seeds (default 0 1 2)")
    parser.add_argument(
        "--steps",
        type=int,
        help=f"training steps of every student (default 1000; with --compression, per size: {compression.BUDGETS})",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        help=f"batch of every student (default 16; clips {video.BATCH}, as +experiment=pocket_video)",
    )
    parser.add_argument(
        "--teacher",
        default="pocket",
        choices=["pocket", "pocket_moe", *video.VIDEO_TEACHERS, *i2v.I2V_TEACHERS],
        help="pocket_video / pocket_video_moe: the video comparison, judged on clips (quality/video.py); "
        "pocket_i2v / pocket_i2v_moe: the image-to-video one, clips from a given first frame (quality/i2v.py)",
    )
    parser.add_argument(
        "--rows",
        nargs="+",
        metavar="WORD",
        help="the video or --stacking comparison: only the rows whose name holds one of these words (e.g. --rows "
        "LoRA 'KD student'); the teacher's row always",
    )
    parser.add_argument(
        "--student",
        default="half",
        choices=conf_options("student"),  # a name no option has was composition's line, naming no flag
        help="the student config of every row (default half)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="where the report goes (default docs/QUALITY.md; with --small "
        f"{SMALL_OUT}, never over the shipped report)",
    )
    parser.add_argument("--work", type=Path, help="run folders and caches (default: a temporary folder)")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    small: dict[str, Any] = dict(seeds=(0,), max_steps=2, batch_size=2, sample_steps=2, per_prompt=1, prompts=6)
    small = small if args.small else {}
    settings = Settings(teacher=args.teacher, student=args.student, **small)
    if args.seeds:
        settings.seeds = tuple(args.seeds)
    if args.steps:
        settings.max_steps = args.steps
    clips = video.VIDEO_TEACHERS + i2v.I2V_TEACHERS
    if args.teacher in clips and not args.small:
        settings.batch_size = video.BATCH  # clips: as many tokens a step as the image rows' 16 images
    if args.teacher in i2v.I2V_TEACHERS and not args.small and not args.steps:
        settings.max_steps = i2v.STEPS
    if args.batch_size:
        settings.batch_size = args.batch_size
    return settings


def check_counts(args: argparse.Namespace) -> None:
    """Each count named by its flag before the work: `--steps 0` and `--batch-size 0` read as unset (the defaults
    ran), a seed out of range was refused minutes in as `seed=`."""
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--jobs", args.jobs)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value} is not 1 or more; give a whole number of 1 or more, e.g. {flag} 2")
    bad = [seed for seed in args.seeds or () if not 0 <= seed < 2**63]
    if bad:
        raise UserError(f"--seeds {bad[0]} is not in [0, 2**63); give whole numbers of 0 or more, e.g. --seeds 0 1 2")
    repeated = [seed for i, seed in enumerate(args.seeds or ()) if seed in args.seeds[:i]]
    if repeated:  # `--seeds 0 0` reported "± 0.0" over one seed's numbers twice
        raise UserError(f"--seeds repeats {repeated[0]}: each seed is one sample of the mean; give distinct seeds")
    # Flags of one report given to another were dropped without a word (an audit's --style without --stacking)
    if args.style is not None and not args.stacking:
        raise UserError("--style is --stacking's style LoRA; add --stacking, or drop --style")
    if args.jobs != 1 and not args.compression:
        raise UserError(f"--jobs {args.jobs} trains --compression's sizes at once; add --compression, or drop --jobs")
    work = args.work.expanduser() if args.work is not None else None
    if work is not None and work.exists() and not work.is_dir():
        raise UserError(f"--work {args.work} is a file; give a folder for the run folders and caches")
    run = work is not None and run_holding(work)
    if run:  # its refusal named paths.cache_dir or hydra.run.dir, not the flag typed
        raise UserError(f"--work {args.work} is or lies in the run folder {run}; give a folder outside runs")


def report_path(args: argparse.Namespace) -> Path:
    """Where the report goes, checked before the work (which takes minutes): a file that can be written, and
    for `--small`, whose numbers mean nothing, never the shipped docs/QUALITY.md."""
    out = args.out or (SMALL_OUT if args.small else Path("docs/QUALITY.md"))
    if args.small and out.resolve() == SHIPPED_REPORT:
        raise UserError(
            f"--out {out}: --small's numbers mean nothing and would replace the shipped report; "
            f"drop --out (it writes {SMALL_OUT}) or run without --small"
        )
    problem = f"{out} is a folder" if out.is_dir() else output_problem(out.parent)  # tried, before the work
    if problem:
        raise UserError(f"--out {out}: {problem}; choose another file")
    run = enclosing_run(out)
    if run is not None:  # its metrics.json, say, appended to: the run's tools then read it as damaged
        raise UserError(
            f"--out {out} lies in the run folder {run}, whose files are the run's; choose a file outside it"
        )
    report = read_in(out.parent, out.name, what="quality report") if out.is_file() else b""
    if report.strip() and START.encode() not in report:  # an empty file (`touch`ed for it) is a new report
        raise UserError(
            f"--out {out} is a file no quality run wrote (it holds no '{START}…' section), which the report would "
            "be added to; choose a new file, or a report written before"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def check_reports(args) -> None:
    """One report at a time, its --rows and --teacher its own: each mistake one line before the work."""
    if args.compression and args.fewstep:
        raise UserError("--compression and --fewstep are two reports; run them one after the other")
    if sum([args.compression, args.fewstep, args.stacking]) > 1:
        raise UserError("--compression, --fewstep and --stacking are separate reports; run them one after the other")
    if args.rows and args.teacher not in video.VIDEO_TEACHERS + i2v.I2V_TEACHERS and not args.stacking:
        raise UserError(
            "--rows chooses rows of the video or --stacking comparison; give --stacking or --teacher pocket_video"
        )
    if args.stacking:
        if args.teacher != "pocket":
            raise UserError("--stacking measures the image teacher's LoRA student; drop --teacher or give pocket")
        if not stacking.chosen(args.rows):
            raise UserError(f"--rows {' '.join(args.rows)} names no --stacking row; e.g. --rows simple style")
        if args.style is not None:  # read against the teacher now: it was refused after the teacher's ODE points
            teacher = inspect_teacher(Path(shipped_asset("pocket/pocket-wan-t2v")))
            try:
                with_loras(teacher, str(args.style.expanduser().absolute()))
            except UserError as e:  # its words name teacher.lora, which --style gives
                raise UserError(f"--style: {str(e).split('=', 1)[-1].replace('teacher.lora', '--style')}") from None
    elif args.teacher in i2v.I2V_TEACHERS:
        i2v.chosen(args.rows)
    else:
        video.chosen(args.rows)  # no row named: one line before the work
    if args.teacher in video.VIDEO_TEACHERS + i2v.I2V_TEACHERS and (args.compression or args.fewstep):
        raise UserError(
            f"--teacher {args.teacher} runs the video comparison (its own rows: kd, trajectory, dmd, LoRA on "
            "clips); drop --compression/--fewstep, or give an image teacher (--teacher pocket)"
        )


def write_report(args, out: Path, results, settings: Settings, budgets: dict, argv: list[str], seconds: float) -> None:
    """The report's section in `out` (the others kept) and its table on the terminal."""
    if args.compression:
        compression.plot(results, out.parent / "compression.png")
        write_section(out, "compression", compression_report(results, settings, budgets, argv, seconds, args.jobs))
        print(table(results, compression.COLUMNS, {"params": "share"}))
    elif args.fewstep:
        write_section(out, "fewstep", fewstep_report(results, settings, argv, seconds))
        print(table(results, fewstep.COLUMNS))
    elif args.stacking:
        write_section(out, "stacking", stacking_report(results, settings, argv, seconds))
        print(table(results, stacking.COLUMNS))
    elif args.teacher in video.VIDEO_TEACHERS:
        write_section(out, "video", video_report(results, settings, argv, seconds))
        print(table(results, video.COLUMNS))
    elif args.teacher in i2v.I2V_TEACHERS:
        write_section(out, f"i2v-{args.teacher}", i2v_report(results, settings, argv, seconds))
        print(table(results, i2v.COLUMNS))
    else:
        write_section(out, "data", report(results, settings, argv, seconds))
        print(table(results))


def main(argv: list[str] | None = None) -> None:

    argv = sys.argv[1:] if argv is None else argv
    args, start = parse_args(argv), time.perf_counter()
    with exit_on_user_error():
        check_counts(args)
        settings = settings_from(args)
        out = report_path(args)
        check_reports(args)
    budgets = {
        size: settings.max_steps if args.small or args.steps else steps for size, steps in compression.BUDGETS.items()
    }
    work = args.work or Path(tempfile.mkdtemp(prefix="wandistiller-quality-"))
    try:
        with exit_on_user_error():
            if args.compression:
                results = compression.compare_compression(settings, work, budgets, args.jobs)
            elif args.fewstep:
                results = fewstep.compare_fewstep(settings, work)
            elif args.stacking:
                style = args.style.resolve() if args.style else stacking.STYLE_LORA_FILE
                results = stacking.compare_stacking(settings, work, stacking.chosen(args.rows), style)
            elif args.teacher in video.VIDEO_TEACHERS:
                results = video.compare_video(settings, work, video.chosen(args.rows))
            elif args.teacher in i2v.I2V_TEACHERS:
                results = i2v.compare_i2v(settings, work, i2v.chosen(args.rows))
            else:
                results = compare(settings, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    with exit_on_user_error():  # checked before the work; one line all the same if the file changed meanwhile
        write_report(args, out, results, settings, budgets, argv, time.perf_counter() - start)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
