"""`logger=csv`: every logged number as one row per step in the run folder's `metrics.csv` (a column per key,
the header widened when a new key appears, e.g. the first `val/loss`; a validation logged at a step already
written joins that step's row), readable without any tracker. A resumed run appends to the same file, after
dropping the rows a killed segment wrote past the checkpoint it resumes from (and a torn last line). Rank 0 only."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

from wandistiller.core.errors import UserError
from wandistiller.core.files import appendable, open_in, read_text_in, write_in_run
from wandistiller.core.registry import Option
from wandistiller.tracking.loggers.base import Logger


@dataclass
class CsvConfig:
    _target_: str = "wandistiller.tracking.loggers.csv.CsvLogger"
    file: str = "metrics.csv"


class CsvLogger(Logger):
    name = "csv"

    def __init__(self, file: str = CsvConfig.file):
        self.file_name, self.path, self.header = file, Path(file), list[str]()  # path: the run's, from start()
        self.last: dict | None = None  # the last row written and where its line starts (a step's merge)
        self.last_at = 0

    @classmethod
    def check(cls, node, key: str) -> None:

        name = Path(str(node.get("file")))
        if name.is_absolute() or len(name.parts) != 1 or name.suffix != ".csv":
            raise UserError(
                f"{key}.file={node.get('file')!r} must be a .csv file name in the run folder; use e.g. "
                f"{key}.file=metrics.csv"
            )

    def start(self, run_dir, config, run_id, group=None, name=None, start_step=None) -> None:

        self.path = appendable(Path(run_dir), self.file_name)  # never a link out of the run folder
        self.header, rows = read_csv(self.path)  # a resumed run's columns: its rows are appended
        kept = [r for r in rows if start_step is None or not _after(r.get("step"), start_step)]
        if len(kept) != len(rows) or _torn(self.path):  # steps to be redone, or a killed write's half line
            write_csv(self.path, self.header, kept)

    def log(self, metrics: dict, step: int | None) -> None:
        row = {"step": "" if step is None else step} | {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        merge = step is not None and self.last is not None and self.last["step"] == step
        if merge and self.last is not None:  # a validation at a step already written: one row for the step
            row = self.last | row
        if self.header and set(row) <= set(self.header):  # the usual case: one appended line, nothing read
            with open_in(self.path.parent, self.path.name, "r+" if merge else "a", newline="") as f:
                if merge:
                    f.seek(self.last_at)
                    f.truncate()
                self.last, self.last_at = row, f.seek(0, 2)
                csv.DictWriter(f, self.header).writerow(row)
            return
        header, rows = read_csv(self.path)  # a new key (the first val/loss): the file rewritten, wider
        self.header = header + [k for k in row if k not in header]
        write_csv(self.path, self.header, [*rows[: -1 if merge else None], row])
        self.last, self.last_at = row, self.path.stat().st_size - len(_line(self.header, row))

    def report(self, sweep_dir, columns, rows, png, group) -> None:
        write_csv(Path(sweep_dir) / "sweep_report.csv", list(columns), [dict(zip(columns, r)) for r in rows])


def read_csv(path: Path | None) -> tuple[list[str], list[dict]]:
    """(header, rows) of a csv logger's file; nothing where there is none yet."""
    if path is None or not path.is_file():
        return [], []
    text = read_text_in(path.parent, path.name)  # through the guard: never a link out of its folder
    if text and not text.endswith("\n"):  # a killed write's torn last line: not a row
        text = text[: text.rfind("\n") + 1]
    reader = csv.DictReader(io.StringIO(text, newline=""))
    return list(reader.fieldnames or []), list(reader)


def _after(step: str | None, start_step: int) -> bool:
    try:
        return step is not None and int(step) > start_step
    except (TypeError, ValueError):
        return False


def _torn(path: Path) -> bool:
    """The file's last line was cut off (a run killed mid-write)."""
    if not path.is_file() or not path.stat().st_size:
        return False
    with open_in(path.parent, path.name) as f:
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def _line(header: list[str], row: dict) -> bytes:
    out = io.StringIO()
    csv.DictWriter(out, header).writerow(row)
    return out.getvalue().encode()


def write_csv(path: Path, header: list[str], rows: list[dict]) -> None:
    out = io.StringIO()
    writer = csv.DictWriter(out, header)
    writer.writeheader()
    writer.writerows(rows)
    write_in_run(path.parent, path.name, out.getvalue())


OPTION = Option("csv", CsvConfig, CsvLogger)
