"""`python -m wandistiller.legacy`: an old `state.pt` converted with torch's restricted unpickler."""

from __future__ import annotations

import pytest
import torch

from wandistiller.core.errors import UserError


def test_legacy_refuses_complex_tensors_and_an_unwritable_folder_in_one_line(tmp_path):
    import random

    import numpy as np

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
