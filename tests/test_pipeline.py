"""The student as a whole diffusers pipeline: `<run>/pipeline/` and the push_to_hub-style export."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import ROOT
from wandistiller.core.errors import UserError
from wandistiller.pipeline import export
from wandistiller.train import run


@pytest.fixture
def run_dir(make_cfg, tmp_path):
    folder = tmp_path / "run"
    run(
        make_cfg(
            "trainer.max_steps=2", "trainer.checkpoint_every=1", "hooks=[monitor,progress,evaluate]", run_dir=folder
        )
    )
    return folder


def sample(pipe) -> torch.Tensor:
    out = pipe("a fox in the snow", guidance_scale=1.0, num_frames=1, height=64, width=64, num_inference_steps=2,
               output_type="pt", generator=torch.Generator().manual_seed(0))  # fmt: skip
    return out.frames


def test_the_run_leaves_a_pipeline_that_loads_in_one_call_and_generates(run_dir):
    from diffusers import WanPipeline, WanTransformer3DModel

    pipe = WanPipeline.from_pretrained(run_dir / "pipeline")
    assert pipe.transformer_2 is None and pipe.text_encoder is not None and pipe.vae is not None
    student = WanTransformer3DModel.from_pretrained(run_dir / "student")
    assert all(torch.equal(a, b) for a, b in zip(pipe.transformer.state_dict().values(), student.state_dict().values()))
    frames = sample(pipe)
    assert frames.shape[-2:] == (64, 64) and torch.isfinite(frames).all()
    card = (run_dir / "pipeline" / "README.md").read_text()
    assert "library_name: diffusers" in card and "2 steps" in card and "`eval_psnr`" in card


@pytest.mark.slow  # a whole CLI process: the default lane keeps its budget
def test_export_writes_a_self_contained_copy_with_its_card_and_never_overwrites(run_dir, tmp_path):
    from diffusers import WanPipeline

    out = export(run_dir, tmp_path / "hub", checkpoint="step_1")
    assert (out / "README.md").is_file() and (out / "model_index.json").is_file()
    assert all(f.stat().st_nlink == 1 for f in out.rglob("*") if f.is_file())  # copies, not links into the run
    exported = sample(WanPipeline.from_pretrained(out))
    assert not torch.equal(exported, sample(WanPipeline.from_pretrained(run_dir / "pipeline")))  # step 1's student
    again = subprocess.run([sys.executable, "-m", "wandistiller.pipeline", str(run_dir), "--out", str(out)],
                           capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and again.stderr.startswith("error: --out")


def test_an_export_refuses_a_file_for_out_writes_nothing_into_the_run_and_names_no_path_of_this_machine(
    run_dir, tmp_path
):
    from tests.conftest import refused

    (tmp_path / "a_file").write_text("mine")
    with refused(f"--out {tmp_path / 'a_file'} is a file; choose a new folder"):
        export(run_dir, tmp_path / "a_file")
    assert (tmp_path / "a_file").read_text() == "mine"
    with refused(f"--out {tmp_path / 'pipe.png'} names a file, but --out is a folder"):
        export(run_dir, tmp_path / "pipe.png")  # it made a folder of that name
    assert not (tmp_path / "pipe.png").exists()
    before = (sorted(p.name for p in run_dir.iterdir()), run_dir.stat().st_mtime_ns)
    with refused(f"--out {run_dir / 'mine'} is inside the run folder {run_dir}; choose a folder outside it"):
        export(run_dir, run_dir / "mine")  # as `export --out` refuses: a run folder holds what training writes
    other = tmp_path / "other_run"  # another run's too (an audit's: its resume replaced student/, the export in it)
    (other / ".hydra").mkdir(parents=True)
    (other / ".hydra" / "config.yaml").write_text("seed: 0\n")
    with refused(f"--out {other / 'student' / 'p'} is inside the run folder {other}; choose a folder outside it"):
        export(run_dir, other / "student" / "p")
    beside = export(run_dir, other / ".." / "beside")  # `cd RUN && … --out ../x` lies beside it (a review's)
    assert (tmp_path / "beside" / "model_index.json").is_file() and beside == other / ".." / "beside"
    out = export(run_dir, tmp_path / "exports" / "mine")  # its parent is made; its temporary folder is beside it
    assert (sorted(p.name for p in run_dir.iterdir()), run_dir.stat().st_mtime_ns) == before  # a read-only run works
    assert sorted(p.name for p in out.parent.iterdir()) == ["mine"]
    for file in out.rglob("*"):
        if file.is_file() and file.suffix in (".json", ".md", ".txt"):
            text = file.read_text()
            assert str(tmp_path) not in text and str(ROOT) not in text and "_name_or_path" not in text, file


def _export_cli(run_dir, out, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "wandistiller.pipeline", str(run_dir), "--out", str(out)],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, **popen)  # fmt: skip


@pytest.mark.slow  # two exports in fresh processes (~15 s)
def test_a_full_disk_or_a_sigterm_leaves_no_partial_export_and_no_temporary_folder(run_dir, tmp_path):
    import resource
    import signal
    import time

    def small_disk():  # every file over 20 KB fails to grow, as on a full disk (EFBIG instead of ENOSPC)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    parent = tmp_path / "exports"
    parent.mkdir()
    full = _export_cli(run_dir, parent / "full", preexec_fn=small_disk)
    err = full.communicate(timeout=300)[1]
    assert full.returncode == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --out {parent / 'full'}: the export could not be written (File too large")
    assert list(parent.iterdir()) == []
    killed = _export_cli(run_dir, parent / "killed")
    for _ in range(3000):  # until its temporary folder appears, then SIGTERM
        if list(parent.iterdir()) or killed.poll() is not None:
            break
        time.sleep(0.01)
    killed.send_signal(signal.SIGTERM)
    killed.communicate(timeout=300)
    assert killed.returncode == 128 + signal.SIGTERM and list(parent.iterdir()) == []


def test_export_of_a_received_run_never_takes_a_student_linked_from_outside(finished, tmp_path):
    import shutil

    from diffusers import WanPipeline

    from wandistiller.core.errors import UserError

    folder = tmp_path / "received"
    shutil.copytree(finished, folder)  # a legitimate run moved to another machine: it exports
    out = export(folder, tmp_path / "hub")
    assert WanPipeline.from_pretrained(out).transformer is not None
    elsewhere = tmp_path / "someone_elses_student"
    shutil.move(folder / "student", elsewhere)
    (folder / "student").symlink_to(elsewhere)
    (folder / "student_ema").symlink_to(elsewhere)
    for checkpoint in (None, "ema"):
        with pytest.raises(UserError, match="leads out of the run folder"):
            export(folder, tmp_path / f"hub_{checkpoint}", checkpoint)
        assert not (tmp_path / f"hub_{checkpoint}").exists()


def test_an_export_of_a_few_step_student_keeps_its_scheduler_steps_and_card(finished, tmp_path):
    import json

    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    from tests.state.test_runs import few_step_copy

    out = export(few_step_copy(finished, tmp_path, 2), tmp_path / "hub")
    pipe = WanPipeline.from_pretrained(out)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler) and pipe.scheduler.config.shift_terminal
    assert json.loads((out / "transformer" / "sampling.json").read_text())["steps"] == 2
    assert "It is a 2-step student" in (out / "README.md").read_text()


def test_a_student_trained_at_comfyuis_simple_sigmas_states_them_and_its_card_samples_them_exactly(finished, tmp_path):
    """diffusers' scheduler config cannot hold ComfyUI's simple sigmas: sampling.json states the trained ones and
    the ones the saved scheduler walks, and the card's lines make the pipeline walk the trained ones."""
    import json
    import re

    from diffusers import WanPipeline

    from tests.state.test_runs import few_step_copy

    out = export(few_step_copy(finished, tmp_path, 3, schedule="simple", shift=3.0), tmp_path / "hub")
    stated = json.loads((out / "transformer" / "sampling.json").read_text())
    assert stated["schedule"] == "simple" and stated["sigmas"] == pytest.approx(
        [1.0, 0.8573264, 0.6007194, 0.0], abs=1e-6
    )  # ComfyUI's
    assert stated["scheduler_sigmas"] != stated["sigmas"]
    pipe = WanPipeline.from_pretrained(out)
    card = (out / "README.md").read_text()
    (snippet,) = re.findall(r"```python\n(import functools.*?)```", card, re.S)
    exec(snippet, {"pipe": pipe})  # the card's own lines
    pipe.scheduler.set_timesteps(3)  # as WanPipeline(..., num_inference_steps=3) calls it
    assert pipe.scheduler.sigmas.tolist() == pytest.approx(stated["sigmas"], abs=1e-6)
    assert pipe.scheduler.timesteps.tolist() == pytest.approx(stated["timesteps"], abs=1e-3)


@pytest.mark.parametrize("out", ["/sys/wd-export", "/proc/wd-export"])
def test_an_export_to_a_folder_that_cannot_be_written_is_refused_before_the_work(finished, out, monkeypatch):
    """Tried (a file made there and removed), not guessed from permission bits: root's os.access says yes to /sys."""
    from wandistiller import pipeline
    from wandistiller.core.errors import UserError

    monkeypatch.setattr(pipeline, "pipeline_student", lambda *a: pytest.fail("work began before the check"))
    with pytest.raises(UserError, match=f"--out {out}: .* cannot be written") as e:
        export(finished, Path(out))
    assert "\n" not in str(e.value)


def test_a_lora_students_export_keeps_its_adapters_or_merges_them_into_the_teachers_transformers(
    make_cfg, tmp_path, tiny_moe_path
):
    from diffusers import WanPipeline

    from tests.student.test_lora import lora_run

    folder = tmp_path / "run"
    student = lora_run(make_cfg, folder, "tiny_moe")
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(2, 16, 1, 8, 8, generator=g), torch.randn(2, 512, 32, generator=g)
    t = torch.tensor([950.0, 100.0])  # one sample per expert
    with torch.no_grad():
        mine = student(x, t, cond)[0]
    merged = WanPipeline.from_pretrained(export(folder, tmp_path / "merged", merge_lora=True))
    assert not (tmp_path / "merged" / "pytorch_lora_weights.safetensors").exists()
    kept = WanPipeline.from_pretrained(export(folder, tmp_path / "kept"))
    kept.load_lora_weights(str(tmp_path / "kept"))
    kept.load_lora_weights(
        str(tmp_path / "kept"),
        weight_name="pytorch_lora_weights_transformer_2.safetensors",
        load_into_transformer_2=True,
    )
    with torch.no_grad():
        for pipe in (merged, kept):
            first = pipe.transformer(x[:1], t[:1], cond[:1], return_dict=False)[0]
            second = pipe.transformer_2(x[1:], t[1:], cond[1:], return_dict=False)[0]
            assert torch.allclose(torch.cat([first, second]), mine, atol=1e-5)
    assert "merged into the transformer weights" in (tmp_path / "merged" / "README.md").read_text()
    other = tmp_path / "kd"
    (other / ".hydra").mkdir(parents=True)
    OmegaConf.save(make_cfg(run_dir=other), other / ".hydra" / "config.yaml")
    with pytest.raises(UserError, match=r"^--merge-lora: .* trained student=tiny, a transformer of its own"):
        export(other, tmp_path / "x", merge_lora=True)
    assert not (tmp_path / "x").exists()


# Issue 42: an image-to-video run leaves its teacher's own image-to-video pipeline, which takes the first frame: Wan 2.1
# I2V's (mask and image latents concatenated, CLIP image tokens) and TI2V 5B's (the image's latent as the first frame,
# its folder WanPipeline's with expand_timesteps, which WanImageToVideoPipeline loads to take an image).
@pytest.mark.parametrize("teacher,side", [("tiny_i2v", 32), ("tiny_ti2v", 64)])
def test_an_image_to_video_run_leaves_the_teachers_image_pipeline_whose_calls_are_the_students_own(
    make_cfg, tmp_path, teacher, side, request
):
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from PIL import Image

    from tests.conftest import encode_condition
    from tests.data.sources.test_images import given_images
    from wandistiller.core.arch import Layout
    from wandistiller.teacher.image import expert_inputs, load_image_encoder
    from wandistiller.teacher.spec import inspect_teacher
    from wandistiller.teacher.vae import load_vae

    root, folder = given_images(tmp_path / "images", size=(side + 8, side)), tmp_path / "run"
    small = ["data.latent_frames=2", "data.latent_height=4", "data.latent_width=4", "trainer.max_steps=2"]
    run(make_cfg(f"teacher={teacher}", "data=image_folder", f"data.root={root}", *small, run_dir=folder))
    spec, cpu = inspect_teacher(request.getfixturevalue(f"{teacher}_path")), torch.device("cpu")
    pipe = WanImageToVideoPipeline.from_pretrained(folder / "pipeline")
    assert (pipe.image_encoder is not None) == spec.image_encoder  # Wan 2.1 I2V's CLIP tower, linked beside it
    student = WanTransformer3DModel.from_pretrained(folder / "student").eval()
    assert all(torch.equal(a, b) for a, b in zip(pipe.transformer.state_dict().values(), student.state_dict().values()))
    calls = []
    pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append((kw, out[0])), with_kwargs=True)
    image = Image.open(root / "img0.png").convert("RGB")
    pipe(image=image, prompt="a red fox in snow", num_frames=5, height=side, width=side, num_inference_steps=2,
         guidance_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0))  # fmt: skip
    # Each call's conditioning is the one the run trained on (teacher/image.py, the teacher's own arithmetic), and
    # its output is the student's own forward on the inputs the run builds from the same noise: no CFG, 2 calls.
    encoder = load_image_encoder(spec, cpu)
    condition = encode_condition(spec, load_vae(spec, cpu), [image], 2, side, side, *encoder)
    assert len(calls) == 2
    with torch.no_grad():
        for kw, out in calls:
            hidden, t = kw["hidden_states"], kw["timestep"].float()
            if spec.layout == Layout.i2v:
                assert torch.equal(hidden[:, 16:], condition.latents)
                assert torch.equal(kw["encoder_hidden_states_image"], condition.embeds)
                hidden = hidden[:, :16]
            else:  # the given frame's tokens at timestep 0, the others at the step's
                assert torch.equal(hidden[:, :, :1], condition.latents) and t.shape == (1, 2 * 2 * 2)
                t = t[:, -1]
            inputs = expert_inputs(spec.layout, (1, 2, 2), hidden, t, condition, torch.float32)
            assert torch.equal(inputs["hidden_states"], kw["hidden_states"])
            mine = student(**inputs, encoder_hidden_states=kw["encoder_hidden_states"], return_dict=False)[0]
            assert torch.equal(mine, out)
    card = (folder / "pipeline" / "README.md").read_text()
    assert "pipeline_tag: image-to-video" in card and "WanImageToVideoPipeline.from_pretrained" in card
