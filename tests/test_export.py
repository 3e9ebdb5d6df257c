"""`python -m wandistiller.export`: a run's student as single files (and their workflow, README, card) or a diffusers
folder, read back by diffusers' own loaders; every refusal one line, nothing left in --out."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file

from tests.conftest import ROOT, refused
from wandistiller.core.errors import UserError
from wandistiller.export import export


def student_output(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    c = model.config
    with torch.no_grad():
        return model(
            torch.randn(1, c.in_channels, 1, 8, 8, generator=g),
            torch.tensor([500.0]),
            torch.randn(1, 8, c.text_dim, generator=g),
            return_dict=False,
        )[0]


def test_single_file_export_loads_in_diffusers_as_the_student_and_its_card_lists_every_file(
    finished, tmp_path, tiny_path
):
    from diffusers import WanTransformer3DModel

    out = export(finished, tmp_path / "exports" / "mine", "single-file", "fp32")
    names = sorted(p.name for p in out.iterdir())
    assert names == ["README.md", "config.json", "tiny_tiny_fp32.safetensors", "tiny_tiny_fp32.workflow.json"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["mine"]  # no temporary folder left beside it
    loaded = WanTransformer3DModel.from_single_file(str(out / "tiny_tiny_fp32.safetensors"), config=str(out))
    student = WanTransformer3DModel.from_pretrained(finished / "student")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), student.state_dict().values()))
    # The student's output, exactly (a model diffusers builds from config and state; from_pretrained's own differs
    # from that by rounding, 4e-7 here, whatever the file).
    same = WanTransformer3DModel.from_config(student.config)
    same.load_state_dict(student.state_dict())
    assert torch.equal(student_output(loaded), student_output(same))
    with safe_open(str(out / "tiny_tiny_fp32.safetensors"), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["config"])["num_layers"] == student.config.num_layers
    assert json.loads(meta["sampling"])["guidance_scale"] == 1.0 and json.loads(meta["teacher"])["name"]
    card = (out / "README.md").read_text()
    for name in names[1:]:
        assert f"`{name}`" in card, name
    assert "from_single_file" in card and "models/diffusion_models" in card and "**Note:** ComfyUI" in card
    # First in its ComfyUI section, and why no student of this teacher loads there (a newcomer's student=half did not)
    comfy = card.split("## In ComfyUI", 1)[1].lstrip()
    assert comfy.startswith("**Note:** ComfyUI") and "none of its students loads in ComfyUI" in comfy.split("\n")[0]
    # The card's lines load it (its placeholders filled in) into the teacher's pipeline.
    code = textwrap.dedent(card.split("```python")[-1].split("```")[0]).replace("PATH_TO_THIS_FOLDER", str(out))
    scope = {"torch": torch}
    exec(code.replace("THE_TEACHER_FOLDER", str(tiny_path)), scope)
    assert torch.equal(student_output(scope["pipe"].transformer), student_output(same))
    for file in out.iterdir():
        if file.suffix in (".json", ".md"):
            assert str(tmp_path) not in file.read_text() and str(ROOT) not in file.read_text(), file


def comfyui_reads(path, compute=torch.bfloat16) -> dict[str, torch.Tensor]:
    """The tensors ComfyUI computes with from a Wan fp8 file, following the layout its loader reads (comfy/utils.py
    `detect_layer_quantization` / `convert_old_quants`, comfy/ops.py `_load_quantized_module`, comfy/quant_ops.py
    `TensorCoreFP8Layout.dequantize`, at commit 0411153ac63b): a layer with `<layer>.comfy_quant` (JSON bytes,
    format float8_e4m3fn) is `weight.to(compute) x weight_scale`; every other tensor is cast to the compute dtype
    as it is stored. A legacy file (`scaled_fp8` marker) runs the whole model in fp8 storage: every weight and bias
    of a Linear held in float8_e4m3fn, `scale_weight` where it has one."""
    with safe_open(str(path), "pt") as f:
        raw = {k: f.get_tensor(k) for k in f.keys()}
    legacy = "scaled_fp8" in raw
    out = {}
    for key, tensor in raw.items():
        if key == "scaled_fp8" or key.endswith((".comfy_quant", ".weight_scale", ".scale_weight")):
            continue
        layer = key.rsplit(".", 1)[0]
        if f"{layer}.comfy_quant" in raw and key.endswith(".weight"):
            config = json.loads(raw[f"{layer}.comfy_quant"].numpy().tobytes())
            assert config == {"format": "float8_e4m3fn"} and tensor.dtype == torch.float8_e4m3fn
            out[key] = tensor.to(compute) * raw[f"{layer}.weight_scale"]
        elif legacy and tensor.dim() <= 2 and f"{layer}.weight" in raw and raw[f"{layer}.weight"].dim() == 2:
            scale = raw.get(f"{layer}.scale_weight") if key.endswith(".weight") else None
            stored = tensor.to(torch.float8_e4m3fn).to(compute)  # a Linear's tensors in fp8 storage
            out[key] = stored * scale if scale is not None else stored
        else:
            out[key] = tensor.to(compute)
    return out


def fp8_error_in_comfyui(finished, tmp_path, layout: str) -> float:
    """The fp8 export in `layout`, read as ComfyUI reads it: its output's relative MSE against the student's (bf16
    weights), after the checks of what the file holds and what its README says."""
    from diffusers import WanTransformer3DModel

    from wandistiller.teacher.fp8 import relative_mse

    out = export(finished, tmp_path / layout, "single-file", "fp8", name="s", fp8_layout=layout)
    student = WanTransformer3DModel.from_pretrained(finished / "student")
    read = comfyui_reads(out / "s.safetensors")
    save_file({k: v.contiguous() for k, v in read.items()}, str(tmp_path / "read.safetensors"))
    comfy = WanTransformer3DModel.from_single_file(str(tmp_path / "read.safetensors"), config=str(out))
    reference = WanTransformer3DModel.from_config(student.config)
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in student.state_dict().items()})
    error = relative_mse(student_output(comfy.float()), student_output(reference))
    with safe_open(str(out / "s.safetensors"), "pt") as f:
        keys = set(f.keys())
        bias = f.get_tensor("blocks.0.ffn.0.bias")
    if layout == "comfy_quant":
        assert "scaled_fp8" not in keys and "blocks.0.ffn.0.comfy_quant" in keys and bias.dtype == torch.bfloat16
        assert error <= 0.01
    else:
        assert "scaled_fp8" in keys and "blocks.0.ffn.0.scale_weight" in keys
    card = (out / "README.md").read_text()
    assert "**Not for diffusers**: `WanTransformer3DModel.from_single_file` cannot read it" in card
    assert "from_single_file(f" not in card  # no diffusers lines for the fp8 file
    return error


def test_the_fp8_file_read_as_comfyui_reads_it_gives_the_students_output_within_fp8_rounding(finished, tmp_path):
    """Each fp8 layout, read as ComfyUI's loader reads it, against the student: the per-layer layout within the fp8
    weights' own rounding (its biases and 16-bit layers kept), the legacy one worse (ComfyUI's whole-model fp8);
    each README names diffusers' from_single_file as a loader that cannot read it, and why."""
    per_layer = fp8_error_in_comfyui(finished, tmp_path / "a", "comfy_quant")
    legacy = fp8_error_in_comfyui(finished, tmp_path / "b", "scaled_fp8")
    assert per_layer < legacy


def test_fp8_and_bf16_single_files_and_a_bf16_diffusers_folder(finished, tmp_path):
    from diffusers import WanPipeline

    fp8 = export(finished, tmp_path / "fp8", "single-file", "fp8", name="s")
    with safe_open(str(fp8 / "s.safetensors"), "pt") as f:
        assert "scaled_fp8" not in f.keys() and f.get_tensor("blocks.0.ffn.0.weight").dtype == torch.float8_e4m3fn
    assert (tmp_path / "fp8" / "s.safetensors").stat().st_size < 0.8 * (
        export(finished, tmp_path / "bf16", "single-file").joinpath("tiny_tiny_bf16.safetensors").stat().st_size
    )
    folder = export(finished, tmp_path / "diffusers", "diffusers", "bf16")
    pipe = WanPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16)
    assert pipe.transformer.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    (weights,) = (folder / "transformer").glob("*.safetensors")
    with safe_open(str(weights), "pt") as f:
        assert f.get_tensor("blocks.0.attn1.to_q.weight").dtype == torch.bfloat16
        assert f.get_tensor("blocks.0.scale_shift_table").dtype == torch.float32  # diffusers keeps it fp32
    assert "## Files" in (folder / "README.md").read_text()


def test_out_is_never_the_teacher_folder_it_reads_nor_in_it_nor_holding_it(finished, tmp_path, tiny_path):
    """--force replaced the folder --out names: given the teacher's own folder, it deleted the teacher (with a real
    Wan model, tens of GB of a download); refused with or without --force, in both export and pipeline."""
    from wandistiller.pipeline import export as export_pipeline

    teacher = tmp_path / "teachers" / "tiny"
    shutil.copytree(tiny_path, teacher)
    before = sorted(p.relative_to(teacher) for p in teacher.rglob("*"))
    for out, where in ((teacher, "is"), (teacher / "transformer", "is inside"), (tmp_path / "teachers", "holds")):
        with refused(f"--out {out} {where} the teacher's folder {teacher}, which the export reads; choose a folder"):
            export(finished, out, "single-file", force=True, teacher_path=str(teacher))
        with refused(f"--out {out} {where} the teacher's folder {teacher}"):
            export_pipeline(finished, out, teacher_path=str(teacher))
    assert sorted(p.relative_to(teacher) for p in teacher.rglob("*")) == before


def test_a_student_folder_whose_config_json_is_gone_is_said_so(finished, tmp_path):
    """It was read as a checkpoint: the line named trainer.resume and a tensors.safetensors it never held."""
    run_dir = tmp_path / "r"
    shutil.copytree(finished, run_dir)
    (run_dir / "student" / "config.json").unlink()
    with refused(f"the student in {run_dir / 'student'} has no config.json (its weights without their shape) and is"):
        export(run_dir, tmp_path / "out", "single-file")
    assert not (tmp_path / "out").exists()


def test_a_name_for_a_diffusers_folder_is_refused_not_dropped(finished, tmp_path):
    with refused("--name is for --format single-file or lora (a diffusers export keeps diffusers' own file names)"):
        export(finished, tmp_path / "out", "diffusers", name="mine")
    assert not (tmp_path / "out").exists()


def test_every_refusal_is_one_line_and_leaves_nothing_in_out(finished, tmp_path):
    from wandistiller.core.errors import UserError

    with refused("is inside the run folder"):
        export(finished, finished / "exports", "single-file")
    assert not (finished / "exports").exists()
    with refused("holds the run folder"):
        export(finished, finished.parent, "single-file", force=True)
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("mine")
    with refused(f"--out {full} is not empty; choose a new folder, or add --force"):
        export(finished, full, "single-file")
    assert (full / "mine.txt").read_text() == "mine"
    here = tmp_path / "here"  # an audit's --out . (or ""): "changed while this export ran", its own staging folder
    here.mkdir()
    with contextlib.chdir(here), refused("--out . is the current folder or holds it (an empty --out is the current"):
        export(finished, Path(""), "diffusers")
    assert not list(here.iterdir())
    with refused("--format lora: the student of"):
        export(finished, tmp_path / "lora", "lora")
    lora = tmp_path / "lora_run"
    shutil.copytree(finished, lora)
    saved = OmegaConf.load(lora / ".hydra" / "config.yaml")
    saved.student.builder = "lora"
    OmegaConf.save(saved, lora / ".hydra" / "config.yaml")
    with refused("--format diffusers: the student of"):
        export(lora, tmp_path / "lora", "diffusers")
    with refused("the LoRA student in"):  # a student/ without adapters
        export(lora, tmp_path / "lora", "lora")
    with refused("--dtype fp8 is for --format single-file"):
        export(finished, tmp_path / "d8", "diffusers", "fp8")
    with refused("--fp8-layout scaled_fp8 is for --dtype fp8 (single-file); drop it, or add --dtype fp8"):
        export(finished, tmp_path / "l8", "single-file", "bf16", fp8_layout="scaled_fp8")
    assert not (tmp_path / "l8").exists()
    unfinished = tmp_path / "unfinished"
    shutil.copytree(finished, unfinished)
    shutil.rmtree(unfinished / "student")
    with refused("has no final student (student/)"):
        export(unfinished, tmp_path / "u", "single-file")
    export(unfinished, tmp_path / "u", "single-file", checkpoint="latest")  # a checkpoint's student, by name
    # A received run whose student/ links out of it: never followed.
    elsewhere = tmp_path / "someone_elses"
    shutil.move(unfinished / "checkpoints", elsewhere)
    (unfinished / "student").symlink_to(elsewhere)
    with pytest.raises(UserError, match="leads out of the run folder"):
        export(unfinished, tmp_path / "linked", "single-file")
    assert not (tmp_path / "linked").exists()
    (unfinished / "student").unlink()
    shutil.copytree(finished / "student", unfinished / "student")
    (unfinished / "metrics.json").unlink()
    (unfinished / "metrics.json").symlink_to(full / "mine.txt")  # a file of yours, never read into a card
    with pytest.raises(UserError, match="leads out of the run folder"):
        export(unfinished, tmp_path / "linked", "single-file")
    # --force replaces only an earlier export: a folder of the user's own (`--out ~`, a data folder) stays whole
    with refused(f"--out {full} holds files no export wrote (mine.txt, …: no WanDistiller model card README.md); "
                 "--force replaces only an earlier export: choose a new folder"):  # fmt: skip
        export(finished, full, "single-file", force=True)
    (full / "README.md").write_text("# my notes\n")
    with refused("holds files no export wrote (README.md, mine.txt, …"):
        export(finished, full, "single-file", force=True)
    assert (full / "mine.txt").read_text() == "mine"
    for file in full.iterdir():  # emptied by its owner: an export goes there, and --force then replaces that
        file.unlink()
    export(finished, full, "diffusers")
    replaced = export(finished, full, "single-file", force=True)  # --force replaces it, once the export is whole
    assert not (replaced / "model_index.json").exists() and (replaced / "README.md").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_force_never_replaces_a_run_and_a_run_without_a_checkpoint_is_told_to_train(finished, tmp_path):
    """Issue 41: `export NEW --out OLD_RUN --force` (arguments swapped) removed another run's checkpoints and student,
    as did an --out holding a run a few folders down; a run stopped before its first checkpoint was told to
    `--checkpoint latest`, which it has not."""
    other = tmp_path / "outputs" / "2026-01-01" / "12-00-00"
    shutil.copytree(finished, other)
    for out in (other, tmp_path / "outputs"):
        with refused(f"--out {out} holds the run folder {other}; --force replaces the folder --out names (its files"):
            export(finished, out, "single-file", force=True)
        assert (other / "student").is_dir() and (other / "checkpoints").is_dir() and (other / ".hydra").is_dir()
    fresh = tmp_path / "fresh"
    shutil.copytree(finished, fresh, ignore=shutil.ignore_patterns("student*", "checkpoints"))
    with refused("has no student yet (no student/, checkpoints: none): it stopped before its first checkpoint"):
        export(fresh, tmp_path / "e", "single-file")
    assert not (tmp_path / "e").exists()


def test_the_cli_refuses_an_unknown_format_or_dtype_in_one_line():
    for bad in (["--format", "gguf"], ["--format", "single-file", "--dtype", "int4"]):
        done = subprocess.run(
            [sys.executable, "-m", "wandistiller.export", "run", *bad, "--out", "x"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and "invalid choice" in done.stderr


def test_a_few_step_students_file_and_workflow_carry_its_k_shift_and_sigmas(finished, tmp_path):
    from tests.state.test_runs import few_step_copy

    out = export(few_step_copy(finished, tmp_path, 2), tmp_path / "k2", "single-file", name="k2")
    with safe_open(str(out / "k2.safetensors"), "pt") as f:
        sampling = json.loads(f.metadata()["sampling"])
    assert sampling["steps"] == 2 and sampling["guidance_scale"] == 1.0 and len(sampling["sigmas"]) == 3
    nodes = {n["type"]: n for n in json.loads((out / "k2.workflow.json").read_text())["nodes"]}
    assert nodes["KSamplerSelect"]["widgets_values"] == ["euler"] and "KSampler" not in nodes
    assert f"sigmas: {[round(v, 6) for v in sampling['sigmas']]}" in (out / "README.md").read_text()


@pytest.mark.parametrize(
    "schedule,shift,node",
    [("euler", None, "ManualSigmas"), ("simple", 5.0, "KSampler"), ("beta", None, "KSampler"),
     ([1.0, 0.8, 0.4], None, "ManualSigmas")],
)  # fmt: skip
def test_the_workflow_samples_at_the_sigmas_the_student_was_trained_at(finished, tmp_path, schedule, shift, node):
    """sampling.json (the file's metadata and the pipeline's), the in-process scheduler and the workflow carry the
    same K sigmas: the workflow sets them (ManualSigmas) or names the ComfyUI scheduler whose function gives them
    at its ModelSamplingSD3 shift (our port, pinned to ComfyUI's values in tests/teacher/test_fewstep.py)."""
    from tests.conftest import workflow_sigmas
    from tests.state.test_runs import few_step_copy
    from wandistiller.state.export import sampling
    from wandistiller.state.runs import open_run, student_scheduler
    from wandistiller.teacher.fewstep import comfy_beta_sigmas, comfy_simple_sigmas

    folder = few_step_copy(finished, tmp_path, 3, schedule=schedule, shift=shift)
    out = export(folder, tmp_path / "k3", "single-file", name="k3")
    with safe_open(str(out / "k3.safetensors"), "pt") as f:
        trained = json.loads(f.metadata()["sampling"])
    assert trained["schedule"] == schedule and len(trained["sigmas"]) == 4 and trained["sigmas"][-1] == 0
    flow = json.loads((out / "k3.workflow.json").read_text())
    nodes = {n["type"]: n for n in flow["nodes"]}
    assert node in nodes
    if node == "KSampler":
        steps, _, sampler, name = nodes["KSampler"]["widgets_values"][2:6]
        at = nodes["ModelSamplingSD3"]["widgets_values"][0]
        given = {"simple": comfy_simple_sigmas, "beta": comfy_beta_sigmas}[name](at, steps)
        assert (sampler, name, steps) == ("euler", schedule, 3)
    else:
        given = workflow_sigmas(flow)
        assert "SamplerCustomAdvanced" in nodes and "KSampler" not in nodes
    assert given == pytest.approx(trained["sigmas"], abs=1e-6)
    run = open_run(folder)
    assert sampling(run.spec.path, 3, run.trained_schedule)["sigmas"] == pytest.approx(trained["sigmas"], abs=1e-6)
    scheduler = student_scheduler(run.spec, 3, 3, run.trained_schedule)
    scheduler.set_timesteps(3)  # as WanPipeline calls it
    assert scheduler.sigmas.tolist() == pytest.approx(trained["sigmas"], abs=1e-6)
    assert "Its trained sigmas: " in (out / "README.md").read_text()


def test_a_bad_saved_schedule_is_one_line_and_nothing_is_written(finished, tmp_path):
    from tests.state.test_runs import few_step_copy

    folder = few_step_copy(finished, tmp_path, 3, schedule=[1.0, 0.5])
    with pytest.raises(UserError, match=r"^method.schedule=\[1,0.5\] has 2 sigmas and method.steps=3; give one"):
        export(folder, tmp_path / "bad", "single-file")
    assert not (tmp_path / "bad").exists()


# -- a LoRA student's files (--format lora) ------------------------------------------------------------------------
def test_a_lora_pair_in_the_lightning_layout_loads_through_wan_pipeline_as_the_students_experts(
    make_cfg, tmp_path, tiny_moe_path
):
    from diffusers import WanPipeline

    from tests.student.test_lora import inputs, lora_run
    from wandistiller.student.lora import WEIGHTS

    run = tmp_path / "run"
    student = lora_run(make_cfg, run, "tiny_moe", "student.alpha=4")
    out = export(run, tmp_path / "lora", "lora", "fp32")
    high, low = "tiny_moe_lora_fp32_high_noise.safetensors", "tiny_moe_lora_fp32_low_noise.safetensors"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["README.md", "diffusers", "tiny_moe_lora_fp32.workflow.json", high, low]
    )
    with safe_open(str(out / high), "pt") as f:
        keys, meta = set(f.keys()), f.metadata()
        assert f.get_tensor("diffusion_model.blocks.0.self_attn.q.alpha").item() == 4.0
    assert {
        "diffusion_model.blocks.1.cross_attn.o.lora_up.weight",
        "diffusion_model.blocks.0.ffn.2.lora_down.weight",
    } <= keys
    assert all(k.startswith("diffusion_model.blocks.") for k in keys) and len(keys) == 3 * 10 * 4  # 10 layers, 4 blocks
    assert meta["rank"] == "2" and meta["alpha"] == "4" and json.loads(meta["sampling"])["guidance_scale"] == 1.0
    assert json.loads(meta["teacher"])["digest"] and json.loads(meta["expert"])["expert"] == "high_noise"
    x, t, cond = inputs()
    with torch.no_grad():
        mine, _ = student(x, t, cond)
    lightning, copied = WanPipeline.from_pretrained(tiny_moe_path), WanPipeline.from_pretrained(tiny_moe_path)
    lightning.load_lora_weights(str(out), weight_name=high)  # diffusers converts the Lightning keys itself
    lightning.load_lora_weights(str(out), weight_name=low, load_into_transformer_2=True)
    copied.load_lora_weights(str(out / "diffusers"))
    copied.load_lora_weights(str(out / "diffusers"), weight_name=WEIGHTS[1], load_into_transformer_2=True)
    with torch.no_grad():
        for pipe in (lightning, copied):
            for rows, theirs in (([0, 2], pipe.transformer), ([1, 3], pipe.transformer_2)):
                loaded = theirs(x[rows], t[rows], cond[rows], return_dict=False)[0]
                assert torch.allclose(loaded, mine[rows], atol=1e-5), (loaded - mine[rows]).abs().max()
    for name in WEIGHTS:  # fp32 as saved: the student's own files, byte for byte
        assert (out / "diffusers" / name).read_bytes() == (run / "student" / name).read_bytes()
    flow = json.loads((out / "tiny_moe_lora_fp32.workflow.json").read_text())
    loras = [n for n in flow["nodes"] if n["type"] == "LoraLoaderModelOnly"]
    assert [n["widgets_values"] for n in loras] == [[high, 1.0], [low, 1.0]]
    assert [n["type"] for n in flow["nodes"]].count("KSamplerAdvanced") == 2
    card = (out / "README.md").read_text()
    for listed in (high, low, f"diffusers/{WEIGHTS[0]}", f"diffusers/{WEIGHTS[1]}", "models/loras"):
        assert f"`{listed}" in card, listed
    assert "load_into_transformer_2=True" in card and "LoraLoaderModelOnly" in card
    for file in out.rglob("*"):
        if file.suffix in (".json", ".md"):
            assert str(tmp_path) not in file.read_text(), file


def test_a_few_step_lora_in_bf16_and_its_cards_lines_load_it_with_its_scheduler(make_cfg, tmp_path, tiny_path):
    from tests.conftest import workflow_sigmas
    from tests.student.test_lora import inputs, lora_run

    run = tmp_path / "run"
    student = lora_run(make_cfg, run, "tiny", "method=trajectory", "method.steps=2")
    out = export(run, tmp_path / "lora", "lora", name="k2")  # bf16 by default
    names = ["README.md", "diffusers", "k2.safetensors", "k2.workflow.json", "scheduler"]
    assert sorted(p.name for p in out.iterdir()) == names
    with safe_open(str(out / "k2.safetensors"), "pt") as f:
        assert f.get_tensor("diffusion_model.blocks.0.self_attn.k.lora_up.weight").dtype == torch.bfloat16
        trained = json.loads(f.metadata()["sampling"])
        assert trained["steps"] == 2
    with safe_open(str(out / "diffusers" / "pytorch_lora_weights.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert "lora_adapter_metadata" in f.metadata()
    flow = json.loads((out / "k2.workflow.json").read_text())
    nodes = {n["type"]: n for n in flow["nodes"]}
    assert nodes["KSamplerSelect"]["widgets_values"] == ["euler"] and "LoraLoaderModelOnly" in nodes
    assert workflow_sigmas(flow) == pytest.approx(trained["sigmas"], abs=1e-6)
    # The card's lines for the Lightning file, its placeholders filled in: the teacher, the adapters, K's scheduler.
    card = (out / "README.md").read_text()
    code = card.split("**`k2.safetensors`**")[1].split("```python")[1].split("```")[0]
    scope: dict = {}
    code = textwrap.dedent(code).replace("PATH_TO_THIS_FOLDER", str(out))
    exec(code.replace("THE_TEACHER_FOLDER", str(tiny_path)), scope)
    pipe = scope["pipe"]
    assert pipe.scheduler.config.shift_terminal is not None and pipe.transformer.dtype == torch.bfloat16
    x, t, cond = inputs(1)
    with torch.no_grad():
        mine = student(x, t, cond)[0]
        theirs = pipe.transformer(x.bfloat16(), t, cond.bfloat16(), return_dict=False)[0].float()
    assert (theirs - mine).norm() / mine.norm() < 2e-2
    assert "cfg 1" in card and "2 steps" in card


def test_an_i2v_lora_pair_is_high_and_low_noise_lightning_files_with_the_teachers_image_to_video_workflow(
    make_cfg, tmp_path, tiny_i2v_moe_path
):
    """Issue 42: a Wan 2.2 I2V A14B-shaped LoRA student exports as the pair of Lightning files that load into the
    teacher's WanImageToVideoPipeline as the student's experts, and a workflow that gives the first frame through
    WanImageToVideo; a text-to-video workflow for it is one line, nothing written."""
    from diffusers import WanImageToVideoPipeline

    from tests.state.test_comfy import sources_of
    from tests.student.test_lora import lora_run
    from wandistiller.core.arch import Layout
    from wandistiller.state.comfy import WAN_I2V
    from wandistiller.teacher.image import ImageCondition, expert_inputs

    run = tmp_path / "run"
    small = ("data.latent_frames=2", "data.latent_height=4", "data.latent_width=4")
    student = lora_run(make_cfg, run, "tiny_i2v_moe", "method=dmd", "method.steps=2", *small)
    with refused(f"--workflow text-to-video: the student of {run} was trained on teacher=tiny_i2v_moe (i2v): its "):
        export(run, tmp_path / "t2v", "lora", "fp32", workflow="text-to-video")
    assert not (tmp_path / "t2v").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    out = export(run, tmp_path / "lora", "lora", "fp32")
    stem = "tiny_i2v_moe_lora_fp32"
    high, low = f"{stem}_high_noise.safetensors", f"{stem}_low_noise.safetensors"
    names = ["README.md", "diffusers", high, low, "scheduler", f"{stem}.workflow.json"]
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    with safe_open(str(out / low), "pt") as f:
        assert json.loads(f.metadata()["expert"]) == {"expert": "low_noise", "boundary_ratio": 0.9}
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_i2v_moe_path)
    pipe.load_lora_weights(str(out), weight_name=high)  # diffusers converts the Lightning keys itself
    pipe.load_lora_weights(str(out), weight_name=low, load_into_transformer_2=True)
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(1, 16, 2, 4, 4, generator=g), torch.randn(1, 512, 32, generator=g)
    given = ImageCondition(torch.randn(1, 20, 2, 4, 4, generator=g), None)
    with torch.no_grad():
        for t, expert in ((torch.tensor([950.0]), pipe.transformer), (torch.tensor([100.0]), pipe.transformer_2)):
            inputs = expert_inputs(Layout.i2v, (1, 2, 2), x, t, given, torch.float32)
            theirs = expert(**inputs, encoder_hidden_states=cond, return_dict=False)[0]
            assert torch.allclose(theirs, student(x, t, cond, image=given)[0], atol=1e-5)
    flow = json.loads((out / f"{stem}.workflow.json").read_text())
    nodes: dict = {}
    for node in flow["nodes"]:
        nodes.setdefault(node["type"], []).append(node)
    assert [n["widgets_values"] for n in nodes["LoraLoaderModelOnly"]] == [[high, 1.0], [low, 1.0]]
    assert nodes[WAN_I2V][0]["widgets_values"] == [32, 32, 5, 1] and "LoadImage" in nodes  # the run's 5 frames
    assert "CLIPVisionEncode" not in nodes and "EmptyHunyuanLatentVideo" not in nodes  # A14B: no image encoder
    assert [sources_of(flow, n)["conditioning"] for n in nodes["BasicGuider"]] == [(WAN_I2V, 0)] * 2
    card = (out / "README.md").read_text()
    assert "pipeline_tag: image-to-video" in card and "WanImageToVideoPipeline.from_pretrained" in card
    assert "pick it in the workflow's Load Image node" in card and "5 frames" in card
    args = [str(run), "--format", "lora", "--workflow", "text-to-video", "--out", str(tmp_path / "cli")]
    cli = subprocess.run([sys.executable, "-m", "wandistiller.export", *args], capture_output=True, text=True, cwd=ROOT)
    assert cli.returncode == 2 and cli.stderr.count("\n") == 1 and cli.stderr.startswith("error: --workflow text-to")
    assert not (tmp_path / "cli").exists()


def test_lora_refusals_are_one_line_and_leave_nothing(make_cfg, tmp_path):
    from tests.student.test_lora import lora_run
    from wandistiller.core.errors import UserError

    run = tmp_path / "run"
    lora_run(make_cfg, run, "tiny")
    with refused("--dtype fp8 is for --format single-file (ComfyUI's fp8); LoRA files take --dtype bf16"):
        export(run, tmp_path / "a", "lora", "fp8")
    with refused("--name '../up' is not a plain file name"):
        export(run, tmp_path / "a", "lora", name="../up")
    with refused(f"--out {tmp_path / 'a.safetensors'} names a file, but --out is a folder (the export's files"):
        export(run, tmp_path / "a.safetensors", "lora")  # it made a folder of that name
    with refused("--checkpoint latest with a LoRA student: its files are written from the run's final student/"):
        export(run, tmp_path / "a", "lora", checkpoint="latest")
    with refused("--format diffusers: the student of"):
        export(run, tmp_path / "a", "diffusers")
    weights = run / "student" / "pytorch_lora_weights.safetensors"
    shutil.move(weights, tmp_path / "elsewhere.safetensors")  # a received run's adapters linked out of it
    weights.symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(UserError, match="leads out of the run folder"):
        export(run, tmp_path / "a", "lora")
    weights.unlink()
    weights.symlink_to(tmp_path / "gone.safetensors")  # dangling: named as the link it is, never "finish the run"
    with pytest.raises(UserError, match=r"leads out of the run folder \(.* is a symbolic link to .*gone"):
        export(run, tmp_path / "a", "lora")
    weights.unlink()
    weights.write_bytes(b"not safetensors")
    with refused("the LoRA student in"):
        export(run, tmp_path / "a", "lora")
    shutil.rmtree(run / "student")
    with refused("its files are written from the run's final student/; finish the run (trainer.resume=auto), or take"):
        export(run, tmp_path / "a", "lora", checkpoint="latest")  # not "drop --checkpoint": there is no student/
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)  # stopped after a checkpoint: listed, not read
    (run / "checkpoints" / "step_00000001" / "state.json").write_text("{}")
    told = f"finish it (trainer.resume=auto), or python -m wandistiller.pipeline {run} --out DIR writes its latest"
    with refused(f"has no final student (student/): the run did not finish; {told} checkpoint's adapters"):
        export(run, tmp_path / "a", "lora")
    assert not (tmp_path / "a").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_lora_students_link_to_a_file_inside_its_run_is_read_by_every_command(make_cfg, tmp_path):
    """A link inside the run folder leads nowhere out of it: export, the pipeline and the sampler all follow it
    (they once called it a link out of the run, and export alone read it)."""
    from tests.student.test_lora import lora_run
    from wandistiller.pipeline import export as export_pipeline
    from wandistiller.state.runs import open_run, student_sampler

    run = tmp_path / "run"
    lora_run(make_cfg, run, "tiny")
    weights = run / "student" / "pytorch_lora_weights.safetensors"
    (run / "kept").mkdir()
    shutil.move(weights, run / "kept" / weights.name)
    weights.symlink_to(Path("..") / "kept" / weights.name)
    export(run, tmp_path / "lora", "lora")
    export_pipeline(run, tmp_path / "pipeline")
    assert (tmp_path / "pipeline" / weights.name).read_bytes() == (run / "kept" / weights.name).read_bytes()
    student_sampler(open_run(run), run / "student", torch.device("cpu"))


def test_a_count_a_received_config_json_sets_is_bounded_before_memory_is_taken(finished, tmp_path):
    """The student is built from its config.json with its weights on the meta device, every count held to its
    weights (and to a bound) first, its files read from the descriptors the guard opened: nothing by path."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    config = json.loads((run / "student" / "config.json").read_text())
    for change, words in [
        ({"num_layers": 10**9}, "num_layers=1000000000 is out of bounds"),
        ({"num_layers": 7}, "num_layers=7 does not match its weights (2 blocks)"),
        ({"rope_max_seq_len": 2**40}, "rope_max_seq_len=1099511627776 is out of bounds"),
        ({"ffn_dim": 48}, "its weights do not fit its config.json (shape differs"),
    ]:
        (run / "student" / "config.json").write_text(json.dumps(config | change))
        with refused(words):
            export(run, tmp_path / "out", "single-file")
        assert not (tmp_path / "out").exists()


def test_out_is_claimed_once_and_checked_again_before_the_final_rename(finished, tmp_path, monkeypatch):
    """Another export into the same --out is refused at once; a file another process put into --out while this one
    ran is never deleted (the rename looks again), and a refused export leaves no folder it made."""
    from wandistiller import export as export_module

    out = tmp_path / "out"
    out.mkdir()
    hold = "import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
    holder = subprocess.Popen([sys.executable, "-c", hold + "print('held', flush=True)\ntime.sleep(120)", str(out)],
                              stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with refused(f"--out {out} is being written by another export; wait for it to finish"):
            export(finished, out, "single-file")
    finally:
        holder.kill()
        holder.wait()
    record = export_module.FORMATS["single-file"]

    def meanwhile(run, tmp, request):  # another process writes into --out while this export builds
        built = record.write(run, tmp, request)
        (out / "theirs.txt").write_text("theirs")
        return built

    monkeypatch.setitem(export_module.FORMATS, "single-file", dataclasses.replace(record, write=meanwhile))
    with refused(f"--out {out} changed while this export ran (another process wrote there: theirs.txt); nothing"):
        export(finished, out, "single-file")
    assert [p.name for p in out.iterdir()] == ["theirs.txt"]
    monkeypatch.setitem(export_module.FORMATS, "single-file", record)
    run = tmp_path / "unfinished"
    shutil.copytree(finished, run)
    shutil.rmtree(run / "student")
    with refused("has no final student"):  # refused before the claim: no folder made
        export(run, tmp_path / "new", "single-file")
    assert not (tmp_path / "new").exists()


def test_an_export_onto_a_file_system_without_locks_is_written_unguarded_and_says_so(
    finished, tmp_path, monkeypatch, caplog
):
    from tests.core.test_atomic import no_locks

    no_locks(monkeypatch)
    export(finished, tmp_path / "out", "single-file")
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "out").iterdir())
    assert f"--out {tmp_path / 'out'} cannot be locked" in caplog.text
    no_locks(monkeypatch, errno.EIO)
    with refused(f"--out {tmp_path / 'new'} cannot be locked (Input/output error)"):
        export(finished, tmp_path / "new", "single-file")
    assert not (tmp_path / "new").exists()  # the folder it made, gone again


@pytest.mark.parametrize("teacher", ["tiny", pytest.param("tiny_moe", marks=pytest.mark.slow)])
def test_a_lora_students_single_file_is_its_teacher_with_the_adapters_merged_as_pipeline_merge_lora_writes(
    make_cfg, tmp_path, teacher
):
    """--format single-file on a LoRA student: the teacher with its adapters merged, one file per expert, equal to
    `pipeline --merge-lora`'s transformers: fp32 exactly, bf16 within its rounding, fp8 in ComfyUI's layout."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from tests.student.test_lora import lora_run
    from wandistiller.pipeline import export as pipeline_export
    from wandistiller.teacher.fp8 import relative_mse

    run = tmp_path / "run"
    lora_run(make_cfg, run, teacher)
    merged = WanPipeline.from_pretrained(pipeline_export(run, tmp_path / "merged", merge_lora=True))
    parts = [merged.transformer] + ([merged.transformer_2] if teacher == "tiny_moe" else [])
    out = export(run, tmp_path / "fp32", "single-file", "fp32", name="m")
    files = ["m.safetensors"] if len(parts) == 1 else ["m_high_noise.safetensors", "m_low_noise.safetensors"]
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(files)
    for file, part in zip(files, parts):
        loaded = WanTransformer3DModel.from_single_file(str(out / file), config=str(out))
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), part.state_dict().values()))
        # fp32: the same weights bit for bit; the outputs then differ only by how each model was built (diffusers'
        # from_pretrained model and a from_config one differ by float rounding whatever the weights)
        assert torch.allclose(student_output(loaded), student_output(part), atol=1e-5)
    bf16 = export(run, tmp_path / "bf16", "single-file", "bf16", name="m")
    loaded = WanTransformer3DModel.from_single_file(str(bf16 / files[0]), config=str(bf16), dtype=torch.bfloat16)
    rounded = WanTransformer3DModel.from_config(parts[0].config)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in parts[0].state_dict().items()})
    assert all(
        torch.equal(a.float(), b) for a, b in zip(loaded.state_dict().values(), rounded.state_dict().values())
    )  # bf16: the merged fp32 weights rounded once
    assert relative_mse(student_output(loaded.float()), student_output(parts[0])) < 1e-3
    fp8 = export(run, tmp_path / "fp8", "single-file", "fp8", name="m")
    with safe_open(str(fp8 / files[0]), "pt") as f:
        assert f.get_tensor("blocks.0.self_attn.q.weight").dtype == torch.float8_e4m3fn
    assert "scaled_fp8" not in safe_open(str(fp8 / files[0]), "pt").keys()


def test_a_merged_export_whose_teacher_is_not_at_hand_is_one_line_and_writes_nothing(make_cfg, tmp_path, tiny_path):
    from tests.student.test_lora import lora_run
    from wandistiller.state.checkpoint import teacher_digest
    from wandistiller.teacher.spec import inspect_teacher

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_path, teacher)
    run = tmp_path / "run"
    lora_run(make_cfg, run, "tiny", f"teacher.path={teacher}")
    digest = teacher_digest(inspect_teacher(teacher))
    (run / "metrics.json").write_text(json.dumps({"teacher": "tiny", "teacher_digest": digest}))  # as a run records it
    for weights in (teacher / "transformer").glob("*.safetensors"):
        weights.unlink()  # the teacher's config still there: the run opens, the weights to merge into are gone
    with refused(f"teacher.path='{teacher}': {teacher}/transformer holds no weights (*.safetensors)"):
        export(run, tmp_path / "out", "single-file")
    assert not (tmp_path / "out").exists()
    done = run_cli_export(run, tmp_path / "out2")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith("error: teacher.path=") and not (tmp_path / "out2").exists()
    # Another teacher in its place (other weights): the adapters were not trained on it
    shutil.rmtree(teacher)
    shutil.copytree(tiny_path, teacher)
    weights = next((teacher / "transformer").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)  # a fine-tune, as far as its digest can tell
    weights.write_bytes(bytes(data))
    # Refused for every format (state/runs.py open_relocated: the saved teacher.path held to the student's record).
    with refused("does not fit this teacher: it was trained against tiny, and the weights of the teacher at"):
        export(run, tmp_path / "out", "single-file")
    assert not (tmp_path / "out").exists()


def run_cli_export(run, out):
    return subprocess.run(
        [sys.executable, "-m", "wandistiller.export", str(run), "--format", "single-file", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


@pytest.mark.parametrize("hub_id", ["Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Wan-AI/Wan2.2-T2V-A14B-Diffusers"])
def test_every_student_preset_of_a_real_wan_teacher_keeps_the_shape_comfyui_detects(hub_id):
    """The `student=` presets of a real teacher keep 128-wide heads, one FFN width and Wan's embeddings: ComfyUI's
    shape detection (num_heads = dim // 128, the FFN width of block 0) builds each of them right."""
    from hydra import compose, initialize_config_dir

    from wandistiller.compose import register_configs
    from wandistiller.config import CONF_DIR
    from wandistiller.core.arch import KNOWN_TEACHERS
    from wandistiller.state.singlefile import loader_assumptions_broken
    from wandistiller.student.model import student_config

    register_configs()
    teacher = dict(KNOWN_TEACHERS[hub_id][0])
    for preset in ("small", "base", "half", "quarter", "tenth", "lora"):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose("train", overrides=[f"student={preset}"])
        config = student_config(cfg.student, teacher)
        assert config["attention_head_dim"] == 128 and loader_assumptions_broken(config, {}) == [], preset


@pytest.mark.slow  # a 1-step training run, an export and two pipelines: about a minute on a loaded 2-core VM
def test_a_lora_student_of_a_fine_tuned_teacher_stacks_on_its_lora_in_diffusers_and_in_the_workflow(
    make_cfg, tmp_path, tiny_path
):
    """Issue 44's stack: a few-step LoRA distilled from a teacher fine-tuned with a style LoRA loads in diffusers on
    the plain teacher as two named adapters (`set_adapters`: the style at its strength, then the student), giving
    the fine-tuned teacher's pipeline with the student's adapters; the exported workflow chains two
    LoraLoaderModelOnly, the style's then the student's, into the sampler."""
    from diffusers import WanPipeline

    from tests.student.test_lora import inputs
    from tests.teacher.test_finetune import ALPHA, peft_state
    from wandistiller.state.loralayout import lightning_tensors
    from wandistiller.teacher.spec import inspect_teacher
    from wandistiller.train import run

    style = tmp_path / "style.safetensors"
    save_file(lightning_tensors(peft_state(inspect_teacher(tiny_path).transformer_config), ALPHA, "fp32"), style)
    lora = f"teacher.lora=[{{path:{style},strength:0.8}}]"
    run_dir = tmp_path / "r"
    run(make_cfg("trainer.max_steps=1", "student=lora", "method=trajectory", "method.steps=2", lora, run_dir=run_dir))
    out = export(run_dir, tmp_path / "lora", "lora", "fp32", name="k2")
    flow = json.loads((out / "k2.workflow.json").read_text())
    nodes = {n["id"]: n for n in flow["nodes"]}
    loaders = [n for n in flow["nodes"] if n["type"] == "LoraLoaderModelOnly"]
    assert [n["widgets_values"] for n in loaders] == [["style.safetensors", 0.8], ["k2.safetensors", 1.0]]
    links = {link[0]: link for link in flow["links"]}
    source = lambda node: nodes[links[node["inputs"][0]["link"]][1]]
    assert source(loaders[1]) is loaders[0] and source(loaders[0])["type"] == "UNETLoader"
    assert "`style.safetensors` at strength 0.8" in (out / "README.md").read_text()

    pipe = WanPipeline.from_pretrained(tiny_path)
    pipe.load_lora_weights(str(style), adapter_name="style")
    pipe.load_lora_weights(str(out / "diffusers"), adapter_name="fewstep")
    pipe.set_adapters(["style", "fewstep"], [0.8, 1.0])
    tuned = WanPipeline.from_pretrained(run_dir / "pipeline")  # the fine-tuned teacher, shipped by the run
    tuned.load_lora_weights(str(out / "diffusers"))
    x, t, cond = inputs(1)
    with torch.no_grad():
        stacked = pipe.transformer(x, t, cond, return_dict=False)[0]
        theirs = tuned.transformer(x, t, cond, return_dict=False)[0]
    assert (stacked - theirs).norm() / theirs.norm() < 1e-4


def test_a_full_disk_while_safetensors_writes_is_one_line_and_leaves_no_folder(finished, tmp_path, monkeypatch):
    """safetensors reports a failed write as its own SafetensorError ("I/O error: …"), not an OSError."""
    from safetensors import SafetensorError

    from wandistiller import export as export_module

    def full(run, tmp, request):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    record = export_module.FORMATS["diffusers"]
    monkeypatch.setitem(export_module.FORMATS, "diffusers", dataclasses.replace(record, write=full))
    with refused("the export could not be written (No space left on device (os error 28)); free some space"):
        export(finished, tmp_path / "out", "diffusers")
    assert not (tmp_path / "out").exists()
