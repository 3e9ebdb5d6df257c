"""wandistiller/state/checkpoint.py: saved, pruned, resumed as data; damaged or crafted ones refused in one line."""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import shutil

import numpy as np
import pytest
import torch
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel

from tests.conftest import cli, fresh_runs, run_cli
from wandistiller.core.errors import UserError
from wandistiller.state import checkpoint
from wandistiller.state.checkpoint import (
    check_compatible,
    checkpoint_dir,
    list_checkpoints,
    load_checkpoint,
    resolve_resume,
    restore,
    save_checkpoint,
)
from wandistiller.train import run


class Marker:
    """Unpickling this creates a file: proof that code ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def crafted_checkpoint(folder, marker):
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(pickle.dumps({"step": 1, "student": Marker(str(marker))}))


def real_state(bf16: bool = False):
    """A training state made by the real classes the worker uses."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    if bf16:
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    sched = get_scheduler("cosine", opt, num_warmup_steps=2, num_training_steps=10)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    ema = EMAModel(list(model.parameters()), decay=0.9)
    for _ in range(3):
        model(torch.randn(3, 4, dtype=next(model.parameters()).dtype)).float().pow(2).mean().backward()
        opt.step(), sched.step(), ema.step(model.parameters()), opt.zero_grad()
    state = {
        "student": model.state_dict(),
        "optimizer": opt.state_dict(),
        "lr_scheduler": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "ema": ema.state_dict(),
        "tracker_run_id": "abc123",
    }
    return model, state


def test_a_crafted_pickle_never_runs_explicit_resume_is_one_line(tmp_path):
    marker = tmp_path / "pwned"
    crafted_checkpoint(tmp_path / "evil", marker)
    with pytest.raises(UserError, match=r"trainer.resume=.*state.pt, a pickle.*never loads") as e:
        resolve_resume(str(tmp_path / "evil"), tmp_path / "run")
    assert "\n" not in str(e.value) and not marker.exists()


@pytest.mark.slow  # a run, then a CLI resume: ~25 s
def test_cli_a_crafted_pickle_found_by_auto_is_skipped_in_one_line_and_never_runs(make_cfg, tmp_path, cache_dir):
    run_dir, marker = tmp_path / "r", tmp_path / "pwned"
    run(make_cfg("trainer.max_steps=2", run_dir=run_dir))
    crafted_checkpoint(run_dir / "checkpoints" / "step_00000003", marker)  # newer than the real one
    (run_dir / "metrics.json").unlink()
    common = [
        f"paths.cache_dir={cache_dir}",
        "logger=none",
        "hooks.samples.prompts=0",
        "~hooks.evaluate",
        "hooks.monitor.val_every=0",
        "trainer.max_steps=4",
    ]
    result = run_cli(*common, f"hydra.run.dir={run_dir}", "trainer.resume=auto", "precision=fp32")
    assert result.returncode == 0, result.stderr[-3000:]
    skips = [line for line in result.stdout.splitlines() + result.stderr.splitlines() if "skipping" in line]
    assert len(skips) == 1 and "step_00000003: it holds only state.pt, a pickle" in skips[0], skips
    assert "resuming at step 2" in result.stdout + result.stderr
    assert not marker.exists() and json.loads((run_dir / "metrics.json").read_text())["final_step"] == 4


@pytest.fixture(scope="module", autouse=True)  # autouse: it starts with the module, beside its in-process tests
def clis(request, tmp_path_factory, cache_dir):
    """This module's default-lane command-line run (a fresh process) and its folder, started with the module."""
    tmp_path = tmp_path_factory.mktemp("cli")
    crafted_checkpoint(tmp_path / "evil", tmp_path / "pwned")
    args = cli(
        f"paths.cache_dir={cache_dir}", "logger=none", f"hydra.run.dir={tmp_path}/s", f"trainer.resume={tmp_path}/evil"
    )
    return tmp_path, fresh_runs(request, {"evil": ("test_cli_an_explicit_crafted_pickle_is_one_error_line", args)})


@pytest.mark.slow  # a whole CLI process: the default lane keeps its budget
def test_cli_an_explicit_crafted_pickle_is_one_error_line(clis):
    tmp_path, runs = clis
    marker, result = tmp_path / "pwned", runs["evil"].result()
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr
    assert errors[0].startswith("error: trainer.resume=") and not marker.exists()


def test_auto_skips_a_crafted_pickle_and_refuses_when_no_checkpoint_is_usable(tmp_path, caplog):
    marker = tmp_path / "pwned"
    crafted_checkpoint(tmp_path / "checkpoints" / "step_00000003", marker)
    _, state = real_state()
    save_checkpoint(tmp_path, 2, state, keep=2)
    with caplog.at_level(logging.WARNING):
        assert resolve_resume("auto", tmp_path) == checkpoint_dir(tmp_path, 2)
    assert len(caplog.records) == 1 and "step_00000003: it holds only state.pt, a pickle" in caplog.text
    shutil.rmtree(checkpoint_dir(tmp_path, 2))
    with pytest.raises(UserError, match="trainer.resume=auto: none of the checkpoints in .* can be resumed from"):
        resolve_resume("auto", tmp_path)
    assert not marker.exists()


def damage(path, how):
    tensors = path / "tensors.safetensors"
    if how == "truncated":
        tensors.write_bytes(tensors.read_bytes()[:-7])
    elif how == "garbage":
        tensors.write_bytes(os.urandom(tensors.stat().st_size))
    elif how == "empty":
        tensors.write_bytes(b"")
    elif how == "bad json":
        (path / "state.json").write_text('{"step": 3, "student": ')
    elif how == "dangling":
        state = json.loads((path / "state.json").read_text())
        (path / "state.json").write_text(json.dumps(state | {"student": {"w": {"__tensor__": "nope"}}}))


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty", "bad json"])
def test_auto_skips_a_damaged_latest_checkpoint_in_one_line(tmp_path, caplog, how):
    _, state = real_state()
    save_checkpoint(tmp_path, 2, state, keep=5)
    damage(save_checkpoint(tmp_path, 4, state, keep=5), how)
    with caplog.at_level(logging.WARNING):
        assert resolve_resume("auto", tmp_path) == checkpoint_dir(tmp_path, 2)
    assert len(caplog.records) == 1 and "skipping" in caplog.text and "step_00000004" in caplog.text
    with pytest.raises(UserError, match="cannot be resumed from") as e:
        resolve_resume(str(checkpoint_dir(tmp_path, 4)), tmp_path)
    assert "\n" not in str(e.value)


def test_a_checkpoint_whose_json_names_a_missing_tensor_is_found_before_loading(tmp_path):
    _, state = real_state()
    path = save_checkpoint(tmp_path, 2, state, keep=5)
    damage(path, "dangling")
    with pytest.raises(UserError, match="cannot be resumed from: .*refers to tensor 'nope'"):
        resolve_resume(str(path), tmp_path)
    with pytest.raises(UserError, match="cannot be read .*lacks"):
        load_checkpoint(path)


def test_a_failed_save_removes_its_temp_folder_and_keeps_the_earlier_ones(tmp_path, monkeypatch):
    _, state = real_state()
    earlier = save_checkpoint(tmp_path, 2, state, keep=1)
    real_write = os.write

    def full_disk(fd, data):  # the OS call a full disk fails; half the bytes land first
        if len(data) > 64:
            real_write(fd, bytes(data[:32]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(UserError, match=r"could not write a checkpoint into .*checkpoints \(No space left") as e:
        save_checkpoint(tmp_path, 4, state, keep=1)
    monkeypatch.undo()
    assert "MiB free there" in str(e.value) and "\n" not in str(e.value)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000002"]
    assert load_checkpoint(earlier)["step"] == 2


def test_a_checkpoint_of_another_student_shape_is_one_line(tmp_path):
    model, state = real_state()
    other = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 2))
    with pytest.raises(
        UserError,
        match=r"^trainer.resume: the checkpoint is of another student shape \(0.bias is \[8\] there and \[16\] here",
    ):
        check_compatible(state, other)
    with pytest.raises(UserError, match="another student shape .*lacks 2"):
        check_compatible(state, torch.nn.Sequential(*model, torch.nn.Linear(2, 2)))
    check_compatible(state, model)
    broken = state | {"optimizer": {"state": {}, "param_groups": []}, "path": "ckpt"}
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(UserError, match=r"the checkpoint ckpt does not fit this run \(ValueError"):
        restore(broken, model, opt, None, None, None)


def test_resume_with_another_student_shape_is_refused_in_one_line(make_cfg, tmp_path):
    run(make_cfg("trainer.max_steps=2", run_dir=tmp_path / "r"))
    # Another run (its own folder and config) started from that checkpoint: the shapes decide.
    checkpoint = tmp_path / "r" / "checkpoints" / "step_00000002"
    cfg = make_cfg("trainer.max_steps=4", f"trainer.resume={checkpoint}", "trainer.loss.hidden_kd_weight=0.1",
                   run_dir=tmp_path / "other")  # fmt: skip
    with pytest.raises(UserError, match="trainer.resume: the checkpoint .* is of another student shape") as e:
        run(cfg)
    assert "\n" not in str(e.value)


def test_prune_keeps_later_checkpoints_it_skipped_and_deletes_by_rename(tmp_path):
    _, state = real_state()
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, state, keep=5)
    damage(checkpoint_dir(tmp_path, 6), "empty")
    assert resolve_resume("auto", tmp_path) == checkpoint_dir(tmp_path, 4)
    save_checkpoint(tmp_path, 5, state, keep=1)  # the resumed run goes on from 4
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000005", "step_00000006"]
    damage(checkpoint_dir(tmp_path, 5), "truncated")
    save_checkpoint(tmp_path, 6, state, keep=1)  # replaces the damaged 6; the damaged 5 is left to look at
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000005", "step_00000006"]
    assert resolve_resume("auto", tmp_path) == checkpoint_dir(tmp_path, 6)
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_every_torch_load_in_the_package_is_weights_only():
    import ast
    import pathlib

    import wandistiller

    calls = 0
    for source in pathlib.Path(wandistiller.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                calls += 1
                flags = {k.arg: k.value for k in node.keywords}
                assert isinstance(flags.get("weights_only"), ast.Constant), source
                assert flags["weights_only"].value is True, source
    assert calls >= 4  # the embeddings cache and its parts, the teacher-latent chunks, the legacy converter


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_every_file_the_package_unpickles_refuses_a_crafted_pickle_and_runs_nothing(tmp_path):
    """What the weights_only flags above are for, by behaviour: each reader of a torch.load file (an
    embeddings cache, one of its parts, a teacher-latent chunk) treats a crafted one as damaged, and the
    code it names never runs; without weights_only the same file does run it."""
    from wandistiller.data.latents import _load_chunk
    from wandistiller.data.prompts import _cached_embeddings, _load_part

    marker, evil = tmp_path / "pwned", tmp_path / "evil.pt"
    crafted = {"prompts": ["a"], "embeds": [Marker(str(marker))], "negative": torch.zeros(1, 4)}
    torch.save(crafted | {"max_sequence_length": 8}, evil)
    assert _load_part(evil, ["a"], 8) is None and _load_chunk(evil, 1, None) is None
    assert _cached_embeddings(evil, ["a"], 8) is None and not evil.exists()  # a damaged cache is removed
    assert not marker.exists()
    torch.save(crafted | {"max_sequence_length": 8}, evil)
    torch.load(evil, weights_only=False)  # the control: unpickled freely, the crafted file runs `open`
    assert marker.exists()


def test_a_checkpoint_saves_and_loads_with_every_unpickler_forbidden(tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a checkpoint went through pickle")

    for owner, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(owner, name, forbidden)
    model, state = real_state()
    path = save_checkpoint(tmp_path, 4, state, keep=2)
    loaded = load_checkpoint(path)
    assert loaded["step"] == 4 and all(torch.equal(loaded["student"][k], v) for k, v in state["student"].items())
    json.loads((path / "state.json").read_text())  # data, not code: plain JSON beside the safetensors
    assert "pickle" not in checkpoint.__dict__


def old_format_checkpoint(folder):
    """What the previous checkpoint.py wrote: torch.save of the state, the step and the RNGs."""
    _, state = real_state()
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    folder.mkdir(parents=True)
    torch.save(state | {"step": 7, "rng": rng}, folder / "state.pt")
    return state


# -- a received run folder: checkpoints read and pruned only inside it, and their teacher recorded ------------
def test_prune_never_touches_another_runs_checkpoints_through_a_link(tmp_path):
    from tests.core.test_files import untouched, victim

    _, state = real_state()
    other = tmp_path / "other_run"
    for step in (1, 2, 3):
        save_checkpoint(other, step, state, keep=5)
    mine = victim(tmp_path)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in other.rglob("*") if p.is_file()}
    received = tmp_path / "received"
    received.mkdir()
    (received / "checkpoints").symlink_to(other / "checkpoints")
    with pytest.raises(UserError, match="checkpoints leads out of the run folder"):
        save_checkpoint(received, 4, state, keep=1)  # would have pruned the other run's 1-3 and written 4 there
    with pytest.raises(UserError, match="checkpoints leads out of the run folder"):
        resolve_resume("auto", received)
    (received / "checkpoints").unlink()
    save_checkpoint(received, 1, state, keep=5)
    (received / "checkpoints" / "step_00000002").symlink_to(other / "checkpoints" / "step_00000002")
    (received / "checkpoints" / "step_00000009").symlink_to(mine.parent)  # a newest "checkpoint" elsewhere
    assert [p.name for p in list_checkpoints(received)] == ["step_00000001"]  # the linked ones are never read
    # Resuming from 1 would train again the steps linked in, and replace the link at step 9: refused, one line.
    nine = received / "checkpoints" / "step_00000009"
    with pytest.raises(
        UserError,
        match=rf"step_00000009 leads out of the run folder \(to {mine.parent}\), .*copy it "
        r"in \(rm .*\) to resume from it, or remove .* to resume from step_00000001$",
    ):
        resolve_resume("auto", received)
    assert resolve_resume(str(received / "checkpoints" / "step_00000001"), tmp_path / "new") is not None
    assert resolve_resume(str(received), tmp_path / "new") == checkpoint_dir(received, 1)  # another run's: its own
    nine.unlink()
    nine.symlink_to(tmp_path / "gone")  # dangling: nothing to copy in
    with pytest.raises(UserError, match=rf"{nine} is a link to {tmp_path / 'gone'}, which is not there: remove "):
        resolve_resume("auto", received)
    nine.unlink()
    nine.mkdir()  # a copy made of links (cp -rs): a folder of its own whose files lead out
    for name in ("state.json", "tensors.safetensors"):
        (nine / name).symlink_to(other / "checkpoints" / "step_00000003" / name)
    with pytest.raises(UserError, match=rf"{nine / 'state.json'} leads out of the run folder"):
        resolve_resume("auto", received)
    shutil.rmtree(nine)
    with pytest.raises(UserError, match="step_00000002 leads out of the run folder"):
        resolve_resume(str(received), received)
    save_checkpoint(received, 3, state, keep=5)
    assert resolve_resume("auto", received) == checkpoint_dir(received, 3)  # a link older than the newest is no loss
    save_checkpoint(received, 4, state, keep=1)  # prunes 1 and 3: never the link, never what it points to
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in other.rglob("*") if p.is_file()} == before
    assert untouched(mine) and sorted(p.name for p in mine.parent.iterdir()) == ["victim.txt"]


def test_a_step_linked_elsewhere_is_replaced_not_written_through_when_saved_again(tmp_path):
    _, state = real_state()
    other = tmp_path / "other_run"
    save_checkpoint(other, 2, state, keep=5)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in checkpoint_dir(other, 2).iterdir())
    save_checkpoint(tmp_path / "r", 1, state, keep=5)
    mine = checkpoint_dir(tmp_path / "r", 2)
    mine.symlink_to(checkpoint_dir(other, 2))
    checkpoint.write_checkpoint(mine, 2, state)
    assert not mine.is_symlink() and checkpoint.problem(mine) is None
    assert sorted((p.name, p.stat().st_mtime_ns) for p in checkpoint_dir(other, 2).iterdir()) == before


@pytest.mark.parametrize("hostile", ["overlap", "dtype"])
def test_auto_falls_back_past_a_newest_checkpoint_with_a_hostile_header(tmp_path, caplog, hostile):
    _, state = real_state()
    save_checkpoint(tmp_path, 2, state, keep=5)
    newest = save_checkpoint(tmp_path, 4, state, keep=5)
    tensors = newest / "tensors.safetensors"
    raw = tensors.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name, entry = next((k, v) for k, v in header.items() if k != "__metadata__")
    if hostile == "overlap":  # a second name for the same bytes: every size still consistent
        header[name + "_x"] = dict(entry)
    else:
        entry["dtype"] = "Q7"
    text = json.dumps(header).encode()
    tensors.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
    with caplog.at_level(logging.WARNING):
        assert resolve_resume("auto", tmp_path) == checkpoint_dir(tmp_path, 2)
    assert "skipping" in caplog.text and "step_00000004" in caplog.text
    with pytest.raises(UserError, match="cannot be resumed from") as e:
        resolve_resume(str(newest), tmp_path)
    assert "\n" not in str(e.value)


def test_a_checkpoint_records_its_teacher_and_another_one_is_refused_unless_asked(finished, tiny_path, tmp_path):
    from wandistiller.teacher.spec import inspect_teacher

    spec = inspect_teacher(tiny_path)
    step = list_checkpoints(finished)[-1]
    recorded = json.loads((step / "state.json").read_text())["teacher"]
    assert recorded == checkpoint.teacher_record(spec, recorded["name"]) and len(recorded["digest"]) == 32
    assert checkpoint.teacher_problem(recorded, spec) is None
    checkpoint.check_teacher(step, spec, allow=False)  # the same teacher: fine
    wider = recorded | {"shape": recorded["shape"] | {"num_layers": 40}}
    assert "with num_layers=40, this teacher at" in checkpoint.teacher_problem(wider, spec)
    other = recorded | {"tensors_digest": "0" * 32}  # the same shape, other weights (a fine-tune, another dtype)
    older = {k: v for k, v in recorded.items() if k != "tensors_digest"} | {"digest": "0" * 32}  # an older record
    assert "the weights of the teacher at" in checkpoint.teacher_problem(older, spec)
    assert "the weights of the teacher at" in checkpoint.teacher_problem(other, spec)
    copy = tmp_path / "step"
    shutil.copytree(step, copy)
    data = json.loads((copy / "state.json").read_text())
    (copy / "state.json").write_text(json.dumps(data | {"teacher": other}))
    with pytest.raises(UserError, match=r"does not fit this teacher: .* differ .*add trainer.allow_other_teacher=true"):
        checkpoint.check_teacher(copy, spec, allow=False)
    checkpoint.check_teacher(copy, spec, allow=True)  # asked for on the command line
    (copy / "state.json").write_text(json.dumps({k: v for k, v in data.items() if k != "teacher"}))
    checkpoint.check_teacher(copy, spec, allow=False)  # an older checkpoint without a record: nothing to compare


def test_a_fine_tuned_teacher_is_another_teacher_to_a_resume(finished, tiny_path, tmp_path):
    """teacher.lora's files and strengths are part of the teacher: a checkpoint of the plain teacher refuses a
    fine-tuned one and the other way round, and another strength is refused naming both."""
    from safetensors.torch import save_file

    from tests.teacher.test_finetune import peft_state
    from wandistiller.teacher.finetune import with_loras
    from wandistiller.teacher.spec import inspect_teacher

    plain = inspect_teacher(tiny_path)
    save_file(peft_state(plain.transformer_config), tmp_path / "style.safetensors")
    tuned = with_loras(plain, [{"path": str(tmp_path / "style.safetensors"), "strength": 0.8}])
    weaker = with_loras(plain, [{"path": str(tmp_path / "style.safetensors"), "strength": 0.5}])
    recorded = checkpoint.teacher_record(tuned, "tiny")
    assert recorded["loras"][0]["file"] == "style.safetensors"
    assert recorded["digest"] != checkpoint.teacher_digest(plain)
    assert checkpoint.teacher_problem(recorded, tuned) is None
    assert "with teacher.lora=[style.safetensors@0.8 (sha256 " in checkpoint.teacher_problem(recorded, weaker)
    assert ", and this run's is teacher.lora=null" in checkpoint.teacher_problem(recorded, plain)
    step = list_checkpoints(finished)[-1]  # the plain teacher's checkpoint
    with pytest.raises(UserError, match=r"and this run's is teacher.lora=\[style.safetensors@0.8") as e:
        checkpoint.check_teacher(step, tuned, allow=False)
    assert "\n" not in str(e.value)


def test_the_teacher_digest_follows_the_weights_not_the_folder(tiny_path, tmp_path):
    from wandistiller.teacher.spec import inspect_teacher

    moved = tmp_path / "moved"
    shutil.copytree(tiny_path, moved)  # the same teacher on another machine
    assert checkpoint.teacher_digest(inspect_teacher(moved)) == checkpoint.teacher_digest(inspect_teacher(tiny_path))
    weights = next((moved / "transformer").glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF  # one byte of the last weights changed
    weights.write_bytes(bytes(raw))
    assert checkpoint.teacher_digest(inspect_teacher(moved)) != checkpoint.teacher_digest(inspect_teacher(tiny_path))


def test_the_tensors_digest_sees_a_fine_tune_of_one_layer_that_the_sampled_digest_misses(tmp_path):
    """A teacher folder filled with a fine-tune of a few layers: `teacher_digest` samples 8 chunks a file and can
    miss it; `tensors_digest` samples every tensor. A record holding it is compared by it, an older one by the
    coarse digest."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    folder = tmp_path / "teacher"
    (folder / "transformer").mkdir(parents=True)
    layers = {f"blocks.{i:02d}.weight": torch.full((64, 64), float(i)) for i in range(64)}  # 16 KB each
    save_file(layers, folder / "transformer" / "model.safetensors")
    spec = SimpleNamespace(path=folder, experts=("transformer",), loras=(), transformer_config={})
    coarse, fine = checkpoint.teacher_digest(spec), checkpoint.tensors_digest(spec)
    recorded = {"name": "mine", "digest": coarse, "tensors_digest": fine}
    assert checkpoint.teacher_problem(recorded, spec) is None
    save_file(
        layers | {"blocks.37.weight": layers["blocks.37.weight"] * 1.01}, folder / "transformer" / "model.safetensors"
    )
    assert checkpoint.teacher_digest(spec) == coarse  # missed: none of its 8 samples falls in block 37
    assert checkpoint.tensors_digest(spec) != fine
    assert "the weights of the teacher at" in str(checkpoint.teacher_problem(recorded, spec))
    older = {"name": "mine", "digest": coarse}  # a record of an earlier version: the coarse digest, as before
    assert checkpoint.teacher_problem(older, spec) is None


def test_a_checkpoint_records_its_method_and_another_name_or_setting_is_said_in_words(finished, tmp_path):
    step = list_checkpoints(finished)[-1]
    assert checkpoint.recorded_method(step) == {"name": "kd", "steps": None}  # what training_state writes
    dmd = {"name": "dmd", "steps": 2, "fake_score": "student"}
    assert checkpoint.method_problem(dmd, dict(dmd)) is None
    assert checkpoint.method_problem(None, dmd) is None  # a checkpoint of before the record: nothing to compare
    assert checkpoint.method_problem(dmd, {"name": "kd", "steps": None}) == (
        "was trained with method=dmd (method.steps=2, method.fake_score=student), and this run's is method=kd"
    )
    lora = {"name": "dmd", "steps": 2, "fake_score": "lora", "lora_rank": 16}
    assert checkpoint.method_problem(dmd, lora).endswith("this run sets method.fake_score=lora, method.lora_rank=16")
    # kd's unset K is not shown
    assert checkpoint.method_problem({"name": "kd", "steps": None}, dmd) == (
        "was trained with method=kd, and this run's is method=dmd"
    )
    # The line names the checkpoint where trainer.resume did not, and a start from its student.
    with pytest.raises(UserError, match=r"^trainer.resume=auto: the checkpoint \S+step_00000002 was trained with "
                       r"method=kd, and this run's is method=dmd; resume with those, or start a new run folder from "
                       r"its student \(student.init=\S+/student\)$"):  # fmt: skip
        checkpoint.check_method(step, dmd, "auto")
    checkpoint.check_method(step, {"name": "kd", "steps": None}, "auto")  # the same method: fine
    copy = tmp_path / "run" / "checkpoints" / "step_00000002"
    shutil.copytree(step, copy)
    (tmp_path / "run" / ".hydra").mkdir()
    (tmp_path / "run" / ".hydra" / "config.yaml").write_text("{}\n")
    with pytest.raises(UserError, match=rf"^trainer.resume={copy}: the checkpoint was trained with method=kd, .* "
                       rf"wandistiller.pipeline {tmp_path / 'run'} --checkpoint step_00000002 --out DIR"):  # fmt: skip
        checkpoint.check_method(copy, dmd, str(copy))
    data = json.loads((copy / "state.json").read_text())
    (copy / "state.json").write_text(json.dumps({k: v for k, v in data.items() if k != "method_identity"}))
    assert checkpoint.recorded_method(copy) is None
    checkpoint.check_method(copy, dmd, str(copy))  # an older checkpoint: resumed as before (the networks' own check)
