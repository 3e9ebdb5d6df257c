"""The other CLIs (eval, generate, legacy, bench) answer bad input in one line, as train does."""

from __future__ import annotations

import shutil

import pytest
import torch

from wandistiller import eval as eval_cli
from wandistiller.bench.__main__ import check_args, parser
from wandistiller.core.errors import UserError
from wandistiller.train import run


@pytest.mark.parametrize(
    "argv, message",
    [
        (["job", "--steps", "0"], "--steps=0 must be 1 or more"),
        (["teacher", "--batch", "1,-8"], "--batch=1,-8 must be sizes"),
        (["overhead", "--reps", "-1"], "--reps=-1 must be 1 or more"),
        (["job", "--warmup", "-1"], "--warmup=-1 must be 0 or more"),
        (["load", "--device", "nonsense"], "--device='nonsense' is not a device"),
        (["overhead", "--out", "/"], "--out /: it is a folder"),
    ],
)
def test_bench_flags_are_one_line_before_any_setup(argv, message):
    with pytest.raises(UserError, match=message):
        check_args(parser().parse_args(argv))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("bench", ["job", "teacher", "plan"])
def test_a_cuda_bench_on_a_cpu_machine_is_one_line(bench):
    with pytest.raises(UserError, match="--device=cuda: this machine has no CUDA GPU"):
        check_args(parser().parse_args([bench, "--device", "cuda"]))


def test_a_checkpoint_of_another_student_shape_is_one_line_for_eval(make_cfg, tmp_path, capsys):
    other, mine = tmp_path / "other", tmp_path / "mine"
    run(make_cfg("trainer.max_steps=1", "student.hidden_kd_weight=0.5", run_dir=other))  # + a projection
    run(make_cfg("trainer.max_steps=1", run_dir=mine))
    shutil.copytree(other / "checkpoints" / "step_00000001", mine / "checkpoints" / "step_00000009")
    with pytest.raises(SystemExit) as e:
        eval_cli.main([str(mine), "--checkpoint", "step_9", "--steps", "1", "--limit", "1"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and "--checkpoint: the checkpoint" in err, err
    assert "is of another student shape" in err and "pick one this run trained" in err


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
