"""Convert a checkpoint an older WanDistiller wrote (`state.pt`, a pickle) to the current format.

    python -m wandistiller.legacy outputs/…/checkpoints/step_00000050 [more folders]

Training never reads `state.pt`: unpickling can run code. This converter reads it with torch's
restricted unpickler (`weights_only=True`), which builds only tensors and plain containers, plus the
three numpy names an RNG state needs -- so a crafted file is refused here too, and nothing in it runs.
It writes `tensors.safetensors` and `state.json` beside it and leaves `state.pt` for you to delete.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from wandistiller.core.errors import UserError, exit_on_user_error, internal_errors_reported
from wandistiller.core.files import in_run, write_in_run
from wandistiller.state import safestate
from wandistiller.state.checkpoint import LEGACY_FILE, STATE_FILE, TENSORS, problem

# What numpy's RNG state (a uint32 array) needs, and nothing else; numpy 1.x pickles name numpy.core.
_reconstruct = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct  # type: ignore[attr-defined]  # numpy 2's stubs lack 1.x's name
NUMPY_GLOBALS = [
    np.dtype,
    np.ndarray,
    np.dtypes.UInt32DType,
    _reconstruct,
    (_reconstruct, "numpy.core.multiarray._reconstruct"),
]


def convert(folder: Path) -> Path:
    """Write `folder`'s state.pt as tensors.safetensors + state.json; refuse anything but plain data."""
    folder = Path(folder)
    in_run(folder, LEGACY_FILE)  # a link out of the checkpoint folder is not read
    if not (folder / LEGACY_FILE).is_file():
        raise UserError(f"{folder} holds no {LEGACY_FILE} to convert")
    try:
        with torch.serialization.safe_globals(NUMPY_GLOBALS):
            state = torch.load(folder / LEGACY_FILE, map_location="cpu", weights_only=True)
    except Exception as e:  # the restricted unpickler refuses anything else, naming it
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise UserError(f"{folder / LEGACY_FILE} is not a checkpoint this converter accepts: {first}") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or "rng" not in state:
        raise UserError(f"{folder / LEGACY_FILE} is not a WanDistiller checkpoint (no step and rng)")
    tensors: dict[str, torch.Tensor] = {}
    try:  # complex tensors, odd objects: what a checkpoint cannot hold is named, and nothing is written
        data = safestate.encode(state, tensors)
        odd = next((f"a {t.dtype} tensor ({k})" for k, t in tensors.items() if t.dtype not in safestate.DTYPES), None)
        if odd:
            raise TypeError(f"a checkpoint cannot hold {odd}")
    except TypeError as e:
        raise UserError(f"{folder / LEGACY_FILE} holds data a checkpoint cannot: {e}; it cannot be converted") from None
    try:
        # Both written whole, each replacing (never writing through) a link in its place.
        safestate.write_tensors(folder / TENSORS, tensors)
        write_in_run(folder, STATE_FILE, json.dumps(data))
    except OSError as e:
        for written in (folder / TENSORS, folder / STATE_FILE):
            if written.is_file():  # half a conversion is none
                written.unlink()
        raise UserError(
            f"{folder} cannot be written ({e.strerror}); copy the checkpoint to a writable folder and convert it there"
        ) from None
    why = problem(folder)
    if why is not None:
        raise UserError(f"{folder} was converted but cannot be resumed from: {why}")
    return folder


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    with internal_errors_reported(), exit_on_user_error():
        for folder in argv:
            print(f"converted {convert(Path(folder))}; {LEGACY_FILE} can now be deleted")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
