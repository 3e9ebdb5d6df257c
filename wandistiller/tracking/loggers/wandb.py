"""`logger=wandb`: one wandb run per training run (offline unless `logger.wandb.mode=online`), in the run
folder's `wandb/`; a resumed run continues the same run id. Rank 0 only."""

from __future__ import annotations

import configparser
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from wandistiller.config import Choice
from wandistiller.core.errors import UserError
from wandistiller.core.files import in_run
from wandistiller.core.registry import Option
from wandistiller.tracking.loggers.base import Logger

log = logging.getLogger(__name__)


class LoggerMode(Choice):
    offline = "offline"
    online = "online"
    disabled = "disabled"


# What wandb.Settings takes as WANDB_MODE (wandb 0.2x): another value failed wandb.init after the teacher loaded.
ENV_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")


@dataclass
class WandbConfig:
    _target_: str = "wandistiller.tracking.loggers.wandb.WandbTracker"
    project: str = "wandistiller"
    entity: str | None = None
    # "offline" (default: no network), "online", or "disabled".
    mode: LoggerMode = LoggerMode.offline
    group: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)


class WandbTracker(Logger):
    """One wandb run per training run; a resumed run continues the same run id."""

    name = "wandb"

    def __init__(
        self,
        project: str,
        entity: str | None = WandbConfig.entity,
        mode: str = WandbConfig.mode,
        group: str | None = WandbConfig.group,
        name: str | None = WandbConfig.name,
        tags: list[str] | None = None,  # None: the schema's empty list
    ):
        self.kwargs: dict[str, Any] = dict(
            project=project, entity=entity, mode=mode, group=group, name=name, tags=list(tags or [])
        )
        self.run: Any = None  # the wandb Run, from start()

    @classmethod
    def check(cls, node, key: str) -> None:
        """A project name wandb would refuse, or `mode=online` without a login: refused before the teacher loads."""

        if problem := cls.project_problem(node.get("project")):
            raise UserError(
                f"{key}.project={node.get('project')!r}: a wandb project name {problem}; use e.g. "
                f"{key}.project=wandistiller"
            )
        mode = os.environ.get("WANDB_MODE")
        if mode is not None and mode not in ENV_MODES:  # wandb.init refused it once the teacher had loaded
            raise UserError(
                f"{key}: the environment's WANDB_MODE={mode!r} is not a wandb mode ({', '.join(ENV_MODES)}); unset "
                "it (the run's own mode is logger.wandb.mode), or set it to one of those"
            )
        if problem := cls.login_problem(node.get("mode")):
            raise UserError(
                f"{key}.mode=online: {problem}; run `wandb login` (or set WANDB_API_KEY), or use {key}.mode=offline"
            )

    @staticmethod
    def project_problem(project: object) -> str | None:
        """Why wandb would refuse this project name (at wandb.init, after the teacher loaded); None if it takes it."""
        import wandb

        try:
            wandb.Settings(project=None if project is None else str(project))
        except wandb.errors.UsageError:  # wandb's own rule: at most 128 characters, none of / \ # ? % :
            return "may not contain / \\ # ? % : and is at most 128 characters"
        return None

    @staticmethod
    def login_problem(mode: str) -> str | None:
        """Why `mode=online` could not log in, checked before the run folder is claimed; None if it can.

        Looks where wandb itself looks (WANDB_API_KEY, an identity token file, a settings file's api_key,
        the .netrc entry for WANDB_BASE_URL's host) and never calls the network: without a key, wandb
        would otherwise prompt, or fail, only after the teacher has loaded.
        """
        if str(mode) != "online" or os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
            return None
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
        try:
            from wandb.sdk.lib.wbauth.wbnetrc import read_netrc_auth

            if read_netrc_auth(host=host):
                return None
        except Exception as e:  # a malformed .netrc: wandb would fail on it too
            return f"wandb cannot read its .netrc ({type(e).__name__}: {e})"
        if _settings_api_key():
            return None
        return f"no wandb login for {host} (no WANDB_API_KEY, no .netrc entry)"

    def start(
        self,
        run_dir: Path,
        config: dict,
        run_id: str | None,
        group: str | None = None,
        name: str | None = None,
        start_step: int | None = None,
    ) -> None:
        """`group`/`name` (a sweep and its point) fill in what the logger config leaves null. wandb itself ignores
        steps at or below the run's last (`start_step` is not needed)."""
        # Offline wandb still sends crash reports unless told not to.
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        in_run(Path(run_dir), "wandb")  # wandb writes into run_dir/wandb: never through a link out of the folder
        kwargs = self.kwargs | {"group": self.kwargs["group"] or group, "name": self.kwargs["name"] or name}
        self.run = wandb.init(dir=str(run_dir), config=config, id=run_id, resume="allow" if run_id else None, **kwargs)
        self.run_id = self.run.id

    @classmethod
    def reopened(cls, node, run_id: str | None, mode: str | None = None):
        """The run's own wandb run (its id is in the run's checkpoints), in `mode` (an evaluation's is offline unless
        it says online, whatever the saved config says); None without an id: a new run for one evaluation would be
        a stray."""

        if not run_id:
            return None
        return OmegaConf.merge(node, {"mode": mode}) if mode else node

    def log(self, metrics: dict, step: int | None) -> None:
        self.run.log(*self._at(metrics, step))

    def log_image(self, key: str, path: Path, step: int | None) -> None:
        import wandb

        self.run.log(*self._at({key: wandb.Image(str(path))}, step))

    def log_video(self, key: str, path: Path, step: int | None) -> None:
        import wandb

        self.run.log(*self._at({key: wandb.Video(str(path), format="gif")}, step))

    def _at(self, metrics: dict, step: int | None) -> tuple[dict, int | None]:
        """wandb keeps only steps at or after its run's current one and drops an earlier step's numbers with a
        warning (a resumed online run continues after the run's last step; an evaluation of an earlier
        checkpoint): those go at wandb's next step instead, with `<prefix>step` naming the step they belong to
        (`eval/step` for `eval/...` numbers: a chart's x-axis in wandb)."""
        if step is None or step >= self.run.step:
            return metrics, step
        prefixes = {k.split("/", 1)[0] for k in metrics if "/" in k}
        prefix = f"{prefixes.pop()}/" if len(prefixes) == 1 and all("/" in k for k in metrics) else ""
        return metrics | {f"{prefix}step": step}, None

    def finish(self, summary: dict) -> None:
        self.run.summary.update(summary)
        offline_dir = Path(self.run.dir).parent
        self.run.finish()
        if self.kwargs["mode"] == "offline":
            segments = " ".join(str(p) for p in offline_segments(offline_dir.parent, str(self.run_id))) or offline_dir
            log.info("wandb: offline run saved; upload it with: wandb sync %s", segments)

    def report(self, sweep_dir: Path, columns: list[str], rows: list[list[str]], png: Path, group: str) -> None:
        """The sweep's table as a wandb Table and its plot, in a run of the sweep's group named sweep-report."""
        if self.kwargs["mode"] == "disabled":
            return
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        kwargs = {k: self.kwargs[k] for k in ("project", "entity", "mode")}
        run = wandb.init(**kwargs, group=group, name="sweep-report", dir=str(sweep_dir), job_type="report")
        header: list[str | int] = list(columns)
        run.log({"comparison": wandb.Table(columns=header, data=rows), "sweep_report": wandb.Image(str(png))})
        run.finish()
        if self.kwargs["mode"] == "offline":
            print(
                f"wandb: offline runs of this sweep; upload with: wandb sync {sweep_dir}/*/wandb/offline-run-* "
                f"{sweep_dir}/wandb/offline-run-*",
                flush=True,
            )


OPTION = Option("wandb", WandbConfig, WandbTracker)


def offline_segments(wandb_dir: Path, run_id: str) -> list[Path]:
    """Every offline folder of one wandb run, oldest first: offline wandb writes a folder per process that
    resumed the run (each training segment, a later eval), and `wandb sync` merges them into the one run
    only when it is given all of them. wandb adds "-1", "-2" to a folder started in the same second as another."""
    found = [*wandb_dir.glob(f"offline-run-*-{run_id}"), *wandb_dir.glob(f"offline-run-*-{run_id}-*")]
    return sorted(found)


def _settings_api_key() -> bool:
    """An api_key in wandb's global settings file (WANDB_CONFIG_DIR/settings or ~/.config/wandb/settings)."""

    folder = Path(os.environ.get("WANDB_CONFIG_DIR", Path.home() / ".config" / "wandb")).expanduser()
    parser = configparser.ConfigParser()
    try:
        parser.read(folder / "settings")
    except (configparser.Error, OSError, UnicodeDecodeError):
        return False
    return any(parser.get(section, "api_key", fallback=None) for section in parser.sections())
