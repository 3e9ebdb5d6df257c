"""wandistiller/state/export.py: a pipeline folder and its model card, written directly from tiny real folders."""

from __future__ import annotations

import errno
import json
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.state.test_card import no_path_of_this_machine
from tests.state.test_runs import few_step_copy
from wandistiller.core.arch import Layout
from wandistiller.core.errors import UserError
from wandistiller.state import export
from wandistiller.state.runs import open_run
from wandistiller.teacher.fewstep import student_schedule
from wandistiller.teacher.spec import inspect_teacher


def student_folder(tmp_path):
    folder = tmp_path / "student"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text('{"_class_name": "WanTransformer3DModel"}')
    (folder / "sub" / "weights.bin").write_bytes(b"\1\2\3")
    return folder


def test_a_pipeline_is_the_student_beside_the_teachers_parts_all_hard_linked(tiny_moe_path, tmp_path):
    out = export.write_pipeline(tmp_path / "pipeline", tiny_moe_path, student_folder(tmp_path), "# the card\n")
    assert (out / "README.md").read_text() == "# the card\n"
    assert (out / "transformer" / "sub" / "weights.bin").read_bytes() == b"\1\2\3"
    assert not (out / "transformer_2").exists()  # the teacher's second expert is not the student's
    for part in export.TEACHER_PARTS:
        for file in (tiny_moe_path / part).rglob("*"):
            if file.is_file():
                assert (out / part / file.relative_to(tiny_moe_path / part)).samefile(file), file
    index = json.loads((out / "model_index.json").read_text())
    teacher = json.loads((tiny_moe_path / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "WanTransformer3DModel"] and index["transformer_2"] == [None, None]
    assert index["boundary_ratio"] is None and index["vae"] == teacher["vae"] and index["_class_name"] == "WanPipeline"


def test_a_teacher_missing_a_part_is_one_line_naming_it(tmp_path):
    teacher = tmp_path / "teacher"
    for part in ("tokenizer", "text_encoder", "scheduler"):
        (teacher / part).mkdir(parents=True)
    with pytest.raises(UserError, match=r"teacher/vae is missing: the teacher folder has no vae/; a WanPipeline"):
        export.write_pipeline(tmp_path / "out", teacher, student_folder(tmp_path), "")


def test_without_hard_links_small_files_are_copied_and_large_ones_referenced(tmp_path, monkeypatch):
    src = tmp_path / "weights.safetensors"
    src.write_bytes(b"x" * 64)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "weights.safetensors").write_text("an older file in its place")
    assert export.place(src, tmp_path / "a" / "weights.safetensors") == "linked"  # and replaces what was there
    assert (tmp_path / "a" / "weights.safetensors").samefile(src)

    def other_filesystem(*args):  # what os.link raises across filesystems
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "link", other_filesystem)
    assert export.place(src, tmp_path / "b" / "w") == "copied"
    assert not (tmp_path / "b" / "w").is_symlink() and (tmp_path / "b" / "w").read_bytes() == src.read_bytes()
    monkeypatch.setattr(export, "COPY_LIMIT", 63)  # 64 bytes count as large
    assert export.place(src, tmp_path / "c" / "w") == "referenced"
    assert (tmp_path / "c" / "w").is_symlink() and (tmp_path / "c" / "w").resolve() == src.resolve()


def test_a_pocket_runs_card_has_the_pocket_teachers_real_sizes_and_they_draw_its_images(make_cfg, tmp_path):
    from diffusers import WanPipeline

    from wandistiller.core.hydra import shipped_asset
    from wandistiller.pocket.digits import IMAGE_SIZE

    folder, teacher = tmp_path / "run", Path(shipped_asset("pocket/pocket-wan-t2v"))
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(make_cfg("teacher=pocket", "data=pocket_digits", run_dir=folder), folder / ".hydra" / "config.yaml")
    card = export.model_card(folder, teacher)
    assert "student of pocket (shipped)" in card and "| data | images (the images shipped with WanDistiller)" in card
    assert f"| image size | {IMAGE_SIZE}x{IMAGE_SIZE} (latent 8x8) |" in card and "max_sequence_length=16" in card
    no_path_of_this_machine(card, tmp_path, teacher)
    # The snippet as written, on the pocket teacher's own parts, draws images of the size it trained on.
    call = re.search(r"height=(\d+), width=(\d+),\s+max_sequence_length=(\d+)", card)
    # its prompt is one of the pocket teacher's own (it draws coloured digits, not "a fox in the snow"), and its
    # from_pretrained line runs as written with no deprecation warning (diffusers 0.42 deprecates torch_dtype=)
    prompts = Path(shipped_asset("pocket/prompts.txt")).read_text().splitlines()
    assert re.search(r'image = pipe\("([^"]+)", ', card)[1] == prompts[0]
    load = next(line for line in card.splitlines() if "from_pretrained" in line)
    assert load == 'pipe = WanPipeline.from_pretrained("PATH_OR_REPO", dtype=torch.float32)'
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found: dict = {"WanPipeline": WanPipeline, "torch": torch}
        exec(load.replace('"PATH_OR_REPO"', repr(str(teacher))), found)
    pipe = found["pipe"]
    out = pipe(prompts[0], guidance_scale=1.0, num_frames=1, height=int(call[1]), width=int(call[2]),
               max_sequence_length=int(call[3]), num_inference_steps=2, output_type="pt").frames  # fmt: skip
    assert out.shape[-2:] == (IMAGE_SIZE, IMAGE_SIZE)


def test_teacher_files_on_another_filesystem_are_copied_or_for_large_ones_referenced(tmp_path, monkeypatch):
    import os
    import tempfile

    from wandistiller.state import export as pipeline  # where the folder is made (wandistiller.pipeline re-exports)

    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a second filesystem (/dev/shm) to stage a failed hard link")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as other:
        src = Path(other) / "big.safetensors"
        src.write_bytes(b"x" * 64)
        monkeypatch.setattr(pipeline, "COPY_LIMIT", 10)  # 64 bytes count as "large" here
        assert pipeline.place(src, tmp_path / "a" / "big.safetensors") == "referenced"
        assert (tmp_path / "a" / "big.safetensors").resolve() == src.resolve()
        monkeypatch.setattr(pipeline, "COPY_LIMIT", 1000)
        assert pipeline.place(src, tmp_path / "b" / "big.safetensors") == "copied"
        assert not (tmp_path / "b" / "big.safetensors").is_symlink()
    assert pipeline.place(tmp_path / "b" / "big.safetensors", tmp_path / "c" / "x") == "linked"  # same filesystem


# A few-step student's pipeline (issue 28): its own scheduler, sampling.json and card, on a finished run's real path.
def test_a_few_step_runs_pipeline_samples_in_its_k_steps_through_wan_pipeline(finished, tmp_path, tiny_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    k, spec = 2, inspect_teacher(tiny_path)
    folder = few_step_copy(finished, tmp_path, k)
    assert open_run(folder).trained_steps == k  # the saved config passes the received-config checks
    export.run_pipeline(folder, tiny_path)  # what a finished run's last step calls
    timesteps, sigmas = student_schedule(spec, k)
    stated = json.loads((folder / "student" / "sampling.json").read_text())
    assert stated["steps"] == k and stated["guidance_scale"] == 1.0 and len(stated["sigmas"]) == k + 1
    assert stated["timesteps"] == pytest.approx(timesteps.tolist(), abs=1e-3)
    assert json.loads((folder / "pipeline" / "transformer" / "sampling.json").read_text()) == stated
    pipe = WanPipeline.from_pretrained(folder / "pipeline")
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    pipe.scheduler.set_timesteps(k)
    assert torch.equal(pipe.scheduler.timesteps.float(), timesteps)
    assert torch.allclose(pipe.scheduler.sigmas.float(), sigmas)
    calls = []
    pipe.transformer.register_forward_hook(lambda *_: calls.append(1))
    out = pipe("a fox in the snow", num_inference_steps=k, guidance_scale=1.0, num_frames=1, height=64, width=64,
               output_type="pt", generator=torch.Generator().manual_seed(0)).frames  # fmt: skip
    assert len(calls) == k and torch.isfinite(out).all()  # one network call per step: no CFG
    card = (folder / "pipeline" / "README.md").read_text()
    stated_ts = ", ".join(f"{t:.0f}" for t in timesteps.tolist())
    assert f"It is a {k}-step student" in card and f"| sampling | {k} steps (timesteps {stated_ts})" in card
    assert f"num_inference_steps={k}, guidance_scale=1.0" in card and "VAE and scheduler are" not in card
    assert 'image = pipe("A red fox trotting through fresh snow at dawn", ' in card  # the shipped prompts' first


def test_a_few_step_pipeline_samples_another_count_with_the_scheduler_its_card_rebuilds(finished, tmp_path, tiny_path):
    from diffusers import WanPipeline

    k, spec = 4, inspect_teacher(tiny_path)
    folder = few_step_copy(finished, tmp_path, k)
    export.run_pipeline(folder, tiny_path)
    pipe = WanPipeline.from_pretrained(folder / "pipeline")
    saved = pipe.scheduler
    with np.errstate(invalid="ignore"):  # the card's warning: diffusers stretches one sigma to K's last point, 0 / 0
        saved.set_timesteps(1)
    assert torch.isnan(saved.sigmas).any()  # fails once diffusers fixes it: then drop the warning from the card
    card = (folder / "pipeline" / "README.md").read_text()
    assert f"Sample it at `num_inference_steps={k}`" in card
    snippet = card.split("```python\n")[-1].split("```")[0]  # the card's last code block: another count's scheduler
    assert "n, shift = 1, pipe.scheduler.config.shift" in snippet
    for n in (k, 2, 1):  # the card's rebuild gives what eval/generate --student-steps n sample with
        pipe.scheduler = saved
        exec(snippet.replace("n, shift = 1,", f"n, shift = {n},"), {"pipe": pipe})
        pipe.scheduler.set_timesteps(n)
        timesteps, sigmas = student_schedule(spec, n)
        assert torch.equal(pipe.scheduler.timesteps.float(), timesteps), n
        assert torch.allclose(pipe.scheduler.sigmas.float(), sigmas), n
    calls = []
    pipe.transformer.register_forward_hook(lambda *_: calls.append(1))
    out = pipe("a fox in the snow", num_inference_steps=1, guidance_scale=1.0, num_frames=1, height=64, width=64,
               output_type="pt", generator=torch.Generator().manual_seed(0)).frames  # fmt: skip
    assert len(calls) == 1 and torch.isfinite(out).all()


def test_a_kd_runs_pipeline_is_as_before(finished, tmp_path, tiny_path):
    folder = few_step_copy(finished, tmp_path, None)
    export.run_pipeline(folder, tiny_path)
    assert not (folder / "student" / "sampling.json").exists()
    assert not (folder / "pipeline" / "transformer" / "sampling.json").exists()
    scheduler = folder / "pipeline" / "scheduler" / "scheduler_config.json"
    assert scheduler.samefile(tiny_path / "scheduler" / "scheduler_config.json")  # the teacher's, linked
    index = json.loads((folder / "pipeline" / "model_index.json").read_text())
    assert index["scheduler"] == json.loads((tiny_path / "model_index.json").read_text())["scheduler"]
    card = (folder / "pipeline" / "README.md").read_text()
    assert "step student" not in card and "num_inference_steps" not in card
    assert "VAE and scheduler are the teacher's.\n\n| | |" in card


# The card says what trained the student (method.name of the saved config) and, for a 1-step student, nothing false.


def test_a_one_step_students_card_states_one_step_and_no_other_counts_stretch(finished, tmp_path, tiny_path):
    from wandistiller.teacher.fewstep import few_step_scheduler

    spec = inspect_teacher(tiny_path)
    assert few_step_scheduler(spec, 1).config.shift_terminal is None  # why no other count ends at its last point
    folder = few_step_copy(finished, tmp_path, 1, method="dmd")
    card = export.model_card(folder, tiny_path)
    stated = ", ".join(f"{t:.0f}" for t in student_schedule(spec, 1)[0].tolist())
    assert f"It is a 1-step student: it samples in 1 network call on its own timesteps (timesteps {stated})" in card
    assert f"| sampling | 1 step (timesteps {stated}), guidance 1 (no CFG) |" in card
    assert "Sample it at `num_inference_steps=1`, the count it was trained for." in card
    assert "NaN" not in card and "shift_terminal" not in card
    assert "1 steps" not in card and "1 network calls" not in card
    two = export.model_card(few_step_copy(finished, tmp_path, 2, "two"), tiny_path)
    assert "at 1 step that gives NaN" in two and "2 network calls" in two  # K > 1: the paragraph as before


@pytest.mark.parametrize("link", ["symbolic", "folder"])
def test_place_from_a_received_folder_never_links_out_of_it(tmp_path, link):
    """`place` of a run's student file: a link out of the run is refused in one line; the pipeline never gets a link
    (hard or symbolic) to the user's file."""
    from tests.core.test_files import descriptors_of, untouched, victim
    from wandistiller.core.files import OutsideRunFolder
    from wandistiller.state.export import place

    run, mine = tmp_path / "run", victim(tmp_path)
    (run / "student").mkdir(parents=True)
    if link == "symbolic":
        (run / "student" / "config.json").symlink_to(mine)
    else:
        (run / "student" / "sub").symlink_to(mine.parent)
    src = run / "student" / ("config.json" if link == "symbolic" else "sub/victim.txt")
    with pytest.raises(OutsideRunFolder):
        place(src, tmp_path / "pipeline" / "transformer" / "config.json", run)
    assert untouched(mine) and os.stat(mine).st_nlink == 1 and not descriptors_of(mine)
    assert not (tmp_path / "pipeline" / "transformer" / "config.json").exists()


def test_place_from_a_received_folder_links_the_file_it_opened(tmp_path):
    from wandistiller.state.export import place

    run = tmp_path / "run"
    (run / "student").mkdir(parents=True)
    (run / "student" / "config.json").write_text("{}")
    dst = tmp_path / "pipeline" / "transformer" / "config.json"
    assert place(run / "student" / "config.json", dst, run) == "linked"
    assert os.path.samefile(dst, run / "student" / "config.json") and not dst.is_symlink()


def test_a_lora_students_pipeline_is_the_teachers_with_the_adapters_and_its_card_snippet_samples_it(
    make_cfg, tmp_path, tiny_moe_path
):
    from tests.student.test_lora import lora_run
    from wandistiller.state.checkpoint import teacher_digest

    folder = tmp_path / "run"
    student = lora_run(make_cfg, folder, "tiny_moe", "method=dmd", "method.steps=2")
    out = export.run_pipeline(folder, tiny_moe_path)
    for part in ("transformer", "transformer_2", "vae"):  # the teacher's own, linked
        file = next((tiny_moe_path / part).glob("*.safetensors"))
        assert (out / part / file.name).samefile(file)
    assert json.loads((folder / "student" / "sampling.json").read_text())["steps"] == 2
    card = (out / "README.md").read_text()
    assert "LoRA rank 2" in card and "load_into_transformer_2=True" in card and str(tmp_path) not in card
    assert f"weights digest `{teacher_digest(inspect_teacher(tiny_moe_path))}`" in card  # the teacher they belong to
    # The card's snippet as written, on this folder, at K steps without CFG: the adapters on both experts.
    snippet = card.split("```python\n")[1].split("```")[0].replace("PATH_OR_REPO", str(out))
    snippet = snippet.replace('output_type="pil").frames[0][0]', 'output_type="pt").frames')
    scope: dict = {}
    exec(snippet, scope)
    pipe = scope["pipe"]
    assert scope["image"].shape[-2:] == (64, 64) and torch.isfinite(scope["image"]).all()
    assert pipe.scheduler.timesteps.numel() == 2 and "num_inference_steps=2" in snippet
    assert [c.r for c in pipe.transformer.peft_config.values()] == [
        c.r for c in pipe.transformer_2.peft_config.values()
    ]
    assert [c.r for c in pipe.transformer.peft_config.values()] == [2]
    g = torch.Generator().manual_seed(0)
    x, t, cond = torch.randn(1, 16, 1, 8, 8, generator=g), torch.tensor([950.0]), torch.randn(1, 512, 32, generator=g)
    with torch.no_grad():
        assert torch.allclose(pipe.transformer(x, t, cond, return_dict=False)[0], student(x, t, cond)[0], atol=1e-5)


# Issue 42: an image-to-video LoRA student's pipeline is its teacher's WanImageToVideoPipeline, and its card's snippet
# passes the clip's first frame.
def test_an_image_to_video_lora_students_pipeline_is_its_teachers_and_its_card_snippet_samples_a_given_image(
    make_cfg, tmp_path, tiny_i2v_moe_path
):
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    from tests.student.test_lora import lora_run
    from wandistiller.teacher.image import ImageCondition, expert_inputs

    folder = tmp_path / "run"
    small = ("data.latent_frames=2", "data.latent_height=4", "data.latent_width=4")
    student = lora_run(make_cfg, folder, "tiny_i2v_moe", "method=dmd", "method.steps=2", *small)
    out = export.run_pipeline(folder, tiny_i2v_moe_path)
    index, teacher = (json.loads((p / "model_index.json").read_text()) for p in (out, tiny_i2v_moe_path))
    assert index["_class_name"] == "WanImageToVideoPipeline" and index["boundary_ratio"] == teacher["boundary_ratio"]
    card = (out / "README.md").read_text()
    assert "pipeline_tag: image-to-video" in card and "WanImageToVideoPipeline.load_lora_weights" in card
    assert 'image = load_image("FIRST_FRAME.png")' in card and "clip = pipe(image=image, prompt=" in card
    # The card's snippet as written, on this folder and a first frame of another size (the pipeline resizes it).
    frame = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(frame)
    snippet = card.split("```python\n")[1].split("```")[0].replace("PATH_OR_REPO", str(out))
    snippet = snippet.replace("FIRST_FRAME.png", str(frame)).replace('"clip.gif"', repr(str(tmp_path / "clip.gif")))
    scope: dict = {}
    exec(snippet, scope)
    pipe = scope["pipe"]
    assert isinstance(pipe, WanImageToVideoPipeline) and len(scope["clip"]) == 5 and (tmp_path / "clip.gif").is_file()
    assert scope["clip"][0].size == (32, 32) and pipe.scheduler.timesteps.numel() == 2
    assert [c.r for c in pipe.transformer_2.peft_config.values()] == [2]  # both experts adapted
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(1, 16, 2, 4, 4, generator=g), torch.randn(1, 512, 32, generator=g)
    given = ImageCondition(torch.randn(1, 20, 2, 4, 4, generator=g), None)
    with torch.no_grad():
        for t, expert in ((torch.tensor([950.0]), pipe.transformer), (torch.tensor([100.0]), pipe.transformer_2)):
            inputs = expert_inputs(Layout.i2v, (1, 2, 2), x, t, given, torch.float32)
            mine = student(x, t, cond, image=given)[0]
            assert torch.allclose(expert(**inputs, encoder_hidden_states=cond, return_dict=False)[0], mine, atol=1e-5)
