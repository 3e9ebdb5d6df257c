"""`python -m wandistiller.legacy`: an old `state.pt` converted with torch's restricted unpickler."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.state.test_checkpoint import crafted_checkpoint, old_format_checkpoint
from wandistiller import legacy
from wandistiller.core.errors import UserError
from wandistiller.state.checkpoint import (
    load_checkpoint,
    resolve_resume,
)


def test_legacy_refuses_complex_tensors_and_an_unwritable_folder_in_one_line(tmp_path):

    from wandistiller.legacy import convert

    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    torch.save({"step": 1, "rng": rng, "student": {"w": torch.zeros(2, dtype=torch.complex64)}}, folder / "state.pt")
    with pytest.raises(UserError, match=r"holds data a checkpoint cannot: .*complex64") as e:
        convert(folder)
    assert "\n" not in str(e.value) and not (folder / "state.json").exists()
    torch.save({"step": 1, "rng": rng, "student": {"w": torch.zeros(2)}}, folder / "state.pt")
    (folder / "tensors.safetensors").mkdir()  # the file's place is taken: it cannot be written
    with pytest.raises(UserError, match="cannot be written"):
        convert(folder)
    assert not (folder / "state.json").exists()


def test_an_old_pickle_checkpoint_converts_safely_and_then_resumes(tmp_path):
    from wandistiller.legacy import convert

    folder = tmp_path / "checkpoints" / "step_00000007"
    state = old_format_checkpoint(folder)
    with pytest.raises(UserError, match=r"python -m wandistiller.legacy .*step_00000007 converts it"):
        resolve_resume(str(folder), tmp_path)
    convert(folder)
    assert resolve_resume("auto", tmp_path) == folder
    loaded = load_checkpoint(folder)
    assert loaded["step"] == 7 and all(torch.equal(loaded["student"][k], v) for k, v in state["student"].items())


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_the_converter_refuses_a_crafted_pickle_and_runs_nothing(tmp_path):
    from wandistiller.legacy import convert

    marker = tmp_path / "pwned"
    crafted_checkpoint(tmp_path / "evil", marker)
    with pytest.raises(UserError, match="is not a checkpoint this converter accepts") as e:
        convert(tmp_path / "evil")
    assert "\n" not in str(e.value) and not marker.exists()
    assert not (tmp_path / "evil" / "state.json").exists()


def test_legacy_replaces_linked_outputs_and_never_reads_a_linked_state_pt(tmp_path):
    from tests.core.test_files import untouched, victim
    from wandistiller.legacy import convert

    mine = victim(tmp_path)
    folder = tmp_path / "step_00000001"
    old_format_checkpoint(folder)
    (folder / "tensors.safetensors").symlink_to(mine)  # a received checkpoint's link to a file of yours
    (folder / "state.json").hardlink_to(tmp_path / "home" / "victim.txt")
    convert(folder)
    assert untouched(mine) and not (folder / "tensors.safetensors").is_symlink()
    assert load_checkpoint(folder)["step"] == 7
    moved = tmp_path / "home" / "state.pt"
    (folder / "state.pt").rename(moved)
    (folder / "state.pt").symlink_to(moved)
    with pytest.raises(UserError, match="state.pt leads out of the run folder"):
        convert(folder)


def test_help_prints_what_the_converter_does(capsys):
    assert legacy.main(["--help"]) == 0
    assert "python -m wandistiller.legacy" in capsys.readouterr().out
