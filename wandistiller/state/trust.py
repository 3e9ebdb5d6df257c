"""What the user allows a received run folder on their own command line (eval, generate): `Trust`, built from the
flags every such CLI takes (`add_trust_args`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from wandistiller.teacher.spec import TeacherSpec


@dataclass(frozen=True)
class Trust:
    """What the user allows a received run folder on their own command line (eval, generate)."""

    targets: tuple[str, ...] = ()  # `_target_`s beyond the project's own (--allow-target)
    teacher_path: str | None = None  # a local teacher in place of the saved teacher.path (--teacher-path)
    allow_download: bool = False  # a saved Hub-id teacher.path may download (--allow-download)
    wandb_mode: str = "offline"  # never what the saved config says (--wandb-mode)
    cache_dir: str | None = None  # None: this machine's (a sender's paths.cache_dir is never written into)
    own_files: bool = False  # the run's own end-of-run eval: its saved prompts files are the user's own
    other_teacher: bool = False  # a teacher other than the one the run recorded (--allow-other-teacher)
    data: bool = False  # the saved data.root / data.dataset outside the run folder may be read (--allow-data)
    spec: TeacherSpec | None = None  # the run's own end-of-run eval: `teacher_path` as its preflight inspected it
    teacher_loras: Sequence[str] | None = None  # the run's teacher.lora files where they lie now (--teacher-lora)

    @classmethod
    def from_args(cls, args) -> Trust:
        mode = getattr(args, "wandb_mode", "offline")
        return cls(
            tuple(args.allow_target or ()),
            args.teacher_path,
            args.allow_download,
            mode,
            other_teacher=args.allow_other_teacher,
            data=getattr(args, "allow_data", False),
            teacher_loras=tuple(args.teacher_lora) if args.teacher_lora else None,
        )

    def open_args(self) -> tuple:
        return self.teacher_path, self.targets, self.allow_download, self.cache_dir, self.spec, self.teacher_loras


def add_trust_args(parser, wandb: bool = False) -> None:
    parser.add_argument(
        "--allow-target",
        action="append",
        metavar="NAME",
        help="a _target_ the run's config may name besides "
        "WanDistiller's own (repeat for several); only for run folders you trust",
    )
    add_teacher_args(parser)
    parser.add_argument("--allow-download", action="store_true", help="let a Hub-id teacher.path download")
    parser.add_argument(
        "--allow-other-teacher",
        action="store_true",
        help="use a teacher other than the one the "
        "run recorded (another shape or other weights): its figures then mean little",
    )
    if wandb:
        parser.add_argument(
            "--wandb-mode",
            choices=["offline", "online"],
            default="offline",
            help="how eval adds to the run's wandb run (default offline, whatever the run says)",
        )


def add_teacher_args(parser) -> None:
    """Where the run's teacher lies now (every tool that reads a run: eval, generate, pipeline, export): a run
    moved to another machine, or a teacher moved since. What is found there is held to what the run recorded."""
    parser.add_argument("--teacher-path", help="a local teacher folder in place of the run's teacher.path")
    parser.add_argument(
        "--teacher-lora",
        nargs="+",
        metavar="FILE",
        help="the run's teacher.lora files where they lie now, one per entry in its order (strengths kept)",
    )
