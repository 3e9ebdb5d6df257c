"""Rebuild a sweep's report, or put two sweeps side by side.

python scripts/compare_sweeps.py multirun/2026-11-25/10-00-00            # report.md + report.png again
python scripts/compare_sweeps.py BEFORE_SWEEP AFTER_SWEEP                # before -> after, per point
"""

from __future__ import annotations

import sys
from pathlib import Path

from wandistiller.tracking.sweep import compare, write_report


def main(argv: list[str]) -> int:
    folders = [Path(a) for a in argv]
    if len(folders) not in (1, 2) or not all(f.is_dir() for f in folders):
        print("usage: compare_sweeps.py SWEEP_DIR [OTHER_SWEEP_DIR]  (folders that exist)", file=sys.stderr)
        return 2
    for folder in folders:
        md, png, table = write_report(folder)
        print(f"{md}\n{table}\n")
    if len(folders) == 2:
        print(f"{folders[0]} -> {folders[1]}\n{compare(*folders)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
