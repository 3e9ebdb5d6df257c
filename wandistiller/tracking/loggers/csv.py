"""`logger=csv`: every logged number as one row per step in the run folder's `metrics.csv` (a column per key,
the header widened when a new key appears, e.g. the first `val/loss`), readable without any tracker.
A resumed run appends to the same file. Rank 0 only."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

from wandistiller.tracking.loggers.base import Logger


@dataclass
class CsvConfig:
    _target_: str = "wandistiller.tracking.loggers.csv.CsvLogger"
    file: str = "metrics.csv"


class CsvLogger(Logger):
    name = "csv"

    def __init__(self, file: str = "metrics.csv"):
        self.file_name, self.path, self.header = file, None, []

    @classmethod
    def check(cls, node, key: str) -> None:
        from wandistiller.core.errors import UserError

        name = Path(str(node.get("file")))
        if name.is_absolute() or len(name.parts) != 1 or name.suffix != ".csv":
            raise UserError(f"{key}.file={node.get('file')!r} must be a .csv file name in the run folder; use e.g. "
                            f"{key}.file=metrics.csv")  # fmt: skip

    def start(self, run_dir, config, run_id, group=None, name=None) -> None:
        self.path = Path(run_dir) / self.file_name
        self.header = read_csv(self.path)[0]  # a resumed run's columns: its rows are appended

    def log(self, metrics: dict, step: int | None) -> None:
        row = {"step": "" if step is None else step} | {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.header and set(row) <= set(self.header):  # the usual case: one appended line, nothing read
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, self.header).writerow(row)
            return
        header, rows = read_csv(self.path)  # a new key (the first val/loss): the file rewritten, wider
        self.header = header + [k for k in row if k not in header]
        write_csv(self.path, self.header, [*rows, row])

    def report(self, sweep_dir, columns, rows, png, group) -> None:
        write_csv(Path(sweep_dir) / "sweep_report.csv", list(columns), [dict(zip(columns, r)) for r in rows])


def read_csv(path: Path | None) -> tuple[list[str], list[dict]]:
    """(header, rows) of a csv logger's file; nothing where there is none yet."""
    if path is None or not path.is_file():
        return [], []
    reader = csv.DictReader(path.read_text().splitlines())
    return list(reader.fieldnames or []), list(reader)


def write_csv(path: Path, header: list[str], rows: list[dict]) -> None:
    from wandistiller.core.files import atomic_write

    out = io.StringIO()
    writer = csv.DictWriter(out, header)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(path, out.getvalue())


OPTION = (CsvConfig, CsvLogger)
