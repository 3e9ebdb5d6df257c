"""`logger=tensorboard`: TensorBoard event files in the run folder's `tensorboard/` (`tensorboard --logdir
RUN/tensorboard`); a resumed run adds a new event file beside the first, continuing its steps (the steps a killed
segment logged past its checkpoint are purged, as they are redone). Written out every few seconds and at close,
however the run ends. Rank 0 only."""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from wandistiller.core.errors import UserError
from wandistiller.core.files import open_in, run_folder
from wandistiller.core.registry import Option
from wandistiller.tracking.loggers.base import Logger

log = logging.getLogger(__name__)

# Seconds between writes of the buffered scalars (TensorBoard's default is 120): a killed run loses at most this.
FLUSH_SECS = 5


# The run folder's own folders, each another writer's: event files never go into them.
OTHERS_FOLDERS = ("student", "student_ema", "checkpoints", "pipeline", ".hydra", "samples", "wandb", "cache")


@dataclass
class TensorboardConfig:
    _target_: str = "wandistiller.tracking.loggers.tensorboard.TensorboardLogger"
    # The folder inside the run folder (a sweep's report goes to the sweep folder's own).
    folder: str = "tensorboard"


class TensorboardLogger(Logger):
    name = "tensorboard"

    def __init__(self, folder: str = TensorboardConfig.folder):
        self.folder = folder
        self.writer: Any = None  # the SummaryWriter, from start()
        self.said_no_video = False  # without moviepy, clips are their strips: said once

    @classmethod
    def check(cls, node, key: str) -> None:

        try:
            import tensorboard  # noqa: F401 -- torch.utils.tensorboard needs it
        except ImportError:
            raise UserError(
                f"{key}: the tensorboard package is not installed; `pip install tensorboard` (make "
                "setup installs it), or drop tensorboard from logger"
            ) from None
        folder = Path(str(node.get("folder")))
        # The run root, or a folder the run writes its models or config to (an audit's: event files landed in
        # student/ and pipeline/, the folders that get uploaded)
        theirs = not folder.parts or folder.parts[0] in OTHERS_FOLDERS
        if folder.is_absolute() or ".." in folder.parts or theirs:
            raise UserError(
                f"{key}.folder={node.get('folder')!r} must be a folder of its own inside the run folder (not its root "
                f"nor {', '.join(OTHERS_FOLDERS)}); use e.g. {key}.folder=tensorboard"
            )

    def _writer(self, folder: Path, start_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides the earlier event files' records from that step on (redone after a resume)

        purge = None if start_step is None else start_step + 1
        logdir = run_folder(folder, self.folder)  # inside the run folder: never through a link out of it
        return SummaryWriter(str(logdir), purge_step=purge, flush_secs=FLUSH_SECS)

    def start(self, run_dir, config, run_id, group=None, name=None, start_step=None) -> None:
        self.writer = self._writer(Path(run_dir), start_step)

    def log(self, metrics: dict, step: int | None) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, global_step=step)

    def log_image(self, key: str, path: Path, step: int | None) -> None:

        with open_in(Path(path).parent, Path(path).name) as f, Image.open(f) as image:  # never a link out
            self.writer.add_image(key, np.asarray(image.convert("RGB")), global_step=step, dataformats="HWC")

    def log_video(self, key: str, path: Path, step: int | None) -> None:
        """The GIF as a TensorBoard video (add_video needs moviepy); without moviepy its still strip as an image,
        said once."""
        if importlib.util.find_spec("moviepy") is None:
            if not self.said_no_video:
                log.info(
                    "tensorboard: clips are logged as their still strips (add_video needs moviepy: pip install moviepy)"
                )
                self.said_no_video = True
            self.log_image(key, Path(path).with_suffix(".png"), step)
            return
        with open_in(Path(path).parent, Path(path).name) as f, Image.open(f) as gif:
            frames = []
            for k in range(getattr(gif, "n_frames", 1)):
                gif.seek(k)
                frames.append(np.asarray(gif.convert("RGB")))
        video = np.stack(frames).transpose(0, 3, 1, 2)[None]  # [1, T, 3, H, W] uint8
        self.writer.add_video(key, video, global_step=step, fps=8)

    def finish(self, summary: dict) -> None:
        figures = {k: v for k, v in summary.items() if isinstance(v, (int, float, str))}
        if figures:  # none: an evaluation that is not the run's own adds no summary
            self.writer.add_text("summary", f"```\n{json.dumps(figures, indent=1)}\n```")
        self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()  # flushes what is buffered
            self.writer = None

    def report(self, sweep_dir, columns, rows, png, group) -> None:
        writer = self._writer(Path(sweep_dir))
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        writer.add_text("sweep_report", "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]))

        with open_in(Path(png).parent, Path(png).name) as f, Image.open(f) as image:
            writer.add_image("sweep_report", np.asarray(image.convert("RGB")), dataformats="HWC")
        writer.close()


OPTION = Option("tensorboard", TensorboardConfig, TensorboardLogger)
