"""wandistiller/teacher/finetune.py: `teacher.lora` files in the Lightning, diffusers/peft and kohya layouts, merged
into the tiny teacher, give what diffusers' own `load_lora_weights` + `fuse_lora(lora_scale=strength)` gives; each
file that is not a LoRA of the teacher is one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import refused
from wandistiller.state.loralayout import lightning_tensors
from wandistiller.teacher.finetune import apply, entries, read_lora, teacher_loras
from wandistiller.teacher.lora import layer_widths
from wandistiller.teacher.model import load_expert
from wandistiller.teacher.spec import inspect_teacher

RANK, ALPHA = 2, 4.0  # scale 2: alpha is read, not assumed


def peft_state(config: dict, seed: int = 0, blocks: int | None = None) -> dict[str, torch.Tensor]:
    """A rank-RANK LoRA on every adapted Linear of `blocks` blocks, under peft's names (no prefix)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(config["num_layers"] if blocks is None else blocks):
        for name, (n_in, n_out) in layer_widths(config).items():
            state[f"blocks.{i}.{name}.lora_A.weight"] = 0.1 * torch.randn(RANK, n_in, generator=g)
            state[f"blocks.{i}.{name}.lora_B.weight"] = 0.1 * torch.randn(n_out, RANK, generator=g)
    return state


def kohya_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """kohya/musubi's names: the Lightning layout's, dots in the module name made underscores, `lora_unet_` first."""
    out = {}
    for key, tensor in lightning_tensors(state, ALPHA, "fp32").items():
        module, _, rest = key.removeprefix("diffusion_model.").partition(".lora_")
        if rest:
            out[f"lora_unet_{module.replace('.', '_')}.lora_{rest}"] = tensor
        else:  # alpha
            out[f"lora_unet_{key.removeprefix('diffusion_model.').removesuffix('.alpha').replace('.', '_')}.alpha"] = (
                tensor
            )
    return out


@pytest.fixture(scope="module")
def spec(tiny_path):
    return inspect_teacher(tiny_path)


@pytest.fixture(scope="module")
def files(spec, tmp_path_factory):
    """One LoRA (the same layers) in each layout, and the peft one without its prefix and metadata."""
    from diffusers import WanPipeline

    folder = tmp_path_factory.mktemp("loras")
    state = peft_state(spec.transformer_config)
    save_file(lightning_tensors(state, ALPHA, "fp32"), folder / "lightning.safetensors")
    save_file(kohya_tensors(state), folder / "kohya.safetensors")
    meta = {"r": RANK, "lora_alpha": ALPHA, "target_modules": sorted(layer_widths(spec.transformer_config))}
    WanPipeline.save_lora_weights(
        folder / "peft",
        transformer_lora_layers=state,
        weight_name="peft.safetensors",
        transformer_lora_adapter_metadata=meta,
    )
    save_file({k: v.clone() for k, v in state.items()}, folder / "bare.safetensors")
    return folder


def outputs(model, spec) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 1, 8, 8, generator=g)
    cond = torch.randn(1, 7, spec.transformer_config["text_dim"], generator=g)
    with torch.no_grad():
        return model(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=cond, return_dict=False)[0]


def diffusers_fused(tiny_path, file, strength: float) -> torch.Tensor:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(tiny_path, torch_dtype=torch.float32)
    pipe.load_lora_weights(str(file.parent), weight_name=file.name, adapter_name="style")
    pipe.fuse_lora(lora_scale=strength, components=["transformer"])
    pipe.unload_lora_weights()  # the adapters gone, the fused weights kept
    return pipe.transformer


@pytest.mark.parametrize("layout", ["lightning", "kohya", "peft/peft"])
def test_each_layout_merged_gives_diffusers_own_fused_output(tiny_path, spec, files, layout):
    file, strength = files / f"{layout}.safetensors", 0.7
    (lora,) = teacher_loras([{"path": str(file), "strength": strength}], spec.experts, spec.transformer_config)
    ours = load_expert(spec, "transformer", torch.float32)
    plain = outputs(ours, spec)
    apply(ours, "transformer", [lora])
    theirs = outputs(diffusers_fused(tiny_path, file, strength), spec)
    assert not torch.allclose(plain, theirs, atol=1e-3)  # the LoRA changes the teacher
    torch.testing.assert_close(outputs(ours, spec), theirs, atol=2e-5, rtol=1e-4)


def test_peft_keys_without_prefix_or_metadata_are_read_at_scale_one(spec, files):
    bare, lightning = read_lora(files / "bare.safetensors"), read_lora(files / "lightning.safetensors")
    assert set(bare) == set(lightning) and len(bare) == 10 * spec.transformer_config["num_layers"]
    module = "blocks.1.attn2.to_k"
    product = lambda layer: layer.scale * layer.up @ layer.down
    # Lightning's alpha 4 at rank 2 is folded into the halves by diffusers' converter; the bare file has none.
    torch.testing.assert_close(product(lightning[module]), (ALPHA / RANK) * product(bare[module]))


def test_a_two_expert_teacher_takes_one_file_for_both_or_one_per_expert(tiny_moe_path, files):
    spec = inspect_teacher(tiny_moe_path)
    both, low = teacher_loras(
        [str(files / "lightning.safetensors"), {"path": str(files / "kohya.safetensors"), "expert": "transformer_2"}],
        spec.experts,
        spec.transformer_config,
    )
    assert both.experts == ("transformer", "transformer_2") and low.experts == ("transformer_2",)
    assert both.record()["sha256"] != low.record()["sha256"]  # the same layers in other bytes: hashed apart
    high = load_expert(spec, "transformer", torch.float32)
    before = outputs(high, spec)
    apply(high, "transformer", [low])  # not this expert's
    torch.testing.assert_close(outputs(high, spec), before, atol=0, rtol=0)


def test_paths_are_made_absolute_as_given_for_the_saved_config(tmp_path, monkeypatch):
    from wandistiller.teacher.finetune import absolute

    monkeypatch.chdir(tmp_path)
    given = ["a.safetensors", {"path": "sub/b.safetensors", "strength": 0.5}]
    assert absolute(given) == [
        str(tmp_path / "a.safetensors"),
        {"path": str(tmp_path / "sub/b.safetensors"), "strength": 0.5},
    ]
    assert absolute(str(tmp_path / "a.safetensors")) == str(tmp_path / "a.safetensors")  # already absolute: as is


def test_entries_read_a_path_a_list_and_mappings():
    assert entries(None) == [] and entries([]) == []
    assert entries("/a.safetensors") == [("/a.safetensors", 1.0, None)]
    assert entries(["/a", {"path": "/b", "strength": 0.5, "expert": "transformer_2"}]) == [
        ("/a", 1.0, None),
        ("/b", 0.5, "transformer_2"),
    ]


def test_each_bad_file_or_strength_is_one_line(spec, files, tmp_path, tiny_path):
    config, experts = spec.transformer_config, spec.experts
    cases = []
    cases.append(([str(tmp_path / "gone.safetensors")], "no such file"))
    cases.append(([str(tmp_path)], "is a folder; give a LoRA .safetensors file"))
    (tmp_path / "notes.safetensors").write_text("not a tensor file")
    cases.append(([str(tmp_path / "notes.safetensors")], "is not a safetensors LoRA file"))
    save_file({"model.weight": torch.zeros(3, 3)}, tmp_path / "model.safetensors")
    cases.append(([str(tmp_path / "model.safetensors")], "is not a Wan LoRA in a layout this reads"))
    wide = peft_state(config | {"num_attention_heads": 4}, blocks=1)  # another model's widths
    save_file(wide, tmp_path / "wide.safetensors")
    wrong = "is not a LoRA of this teacher: blocks.0.attn1.to_k is 32x32 here, and its lora_A is [2, 64]"
    cases.append(([str(tmp_path / "wide.safetensors")], wrong))
    deep = peft_state(config | {"num_layers": 6})  # a deeper model's blocks
    save_file(deep, tmp_path / "deep.safetensors")
    cases.append(([str(tmp_path / "deep.safetensors")], "it adapts blocks.4.attn1.to_k, which the teacher has no"))
    mixed = peft_state(config, blocks=1)
    mixed["blocks.0.attn1.to_q.lora_B.weight"] = torch.zeros(32, RANK + 1)  # a rank mismatch between halves
    save_file(mixed, tmp_path / "mixed.safetensors")
    cases.append(([str(tmp_path / "mixed.safetensors")], "32x32 here, and its lora_A is [2, 32], lora_B [32, 3]"))
    half = peft_state(config, blocks=1)
    del half["blocks.0.ffn.net.2.lora_B.weight"]
    save_file(half, tmp_path / "half.safetensors")
    cases.append(([str(tmp_path / "half.safetensors")], "blocks.0.ffn.net.2 has one half of an adapter"))
    nan = peft_state(config, blocks=1)
    nan["blocks.0.attn1.to_v.lora_A.weight"][0, 0] = float("nan")
    save_file(nan, tmp_path / "nan.safetensors")
    cases.append(([str(tmp_path / "nan.safetensors")], "holds NaN or infinite values in blocks.0.attn1.to_v"))
    good = str(files / "lightning.safetensors")
    cases.append(([{"path": good, "strength": "strong"}], "teacher.lora[0].strength='strong' is not a finite number"))
    cases.append(([{"path": good, "strength": float("inf")}], "teacher.lora[0].strength=inf is not a finite number"))
    cases.append(([{"path": good, "expert": "transformer_2"}], "expert='transformer_2' is not an expert of this"))
    cases.append(([{"path": good, "weight": 1}], "has 'weight', which a LoRA entry does not take"))
    cases.append(([3], "teacher.lora[0]=3 is not a LoRA file"))
    for value, message in cases:
        with refused(message) as e:
            teacher_loras(value, experts, config)
        assert "\n" not in str(e.value), str(e.value)
    assert json.dumps(teacher_loras(good, experts, config)[0].record())  # a plain path: one entry


def test_the_cli_refuses_another_models_lora_in_one_line_exit_2_writing_nothing(tmp_path, cache_dir, files, spec):
    """`python -m wandistiller.train teacher.lora=...` with a LoRA of another model's widths: one line, exit 2, and no
    run folder (checked before it is claimed)."""
    from tests.conftest import run_cli

    wide = peft_state(spec.transformer_config | {"num_attention_heads": 4}, blocks=1)
    save_file(wide, tmp_path / "wan14b.safetensors")
    folder = tmp_path / "run"
    lora = f"teacher.lora=[{tmp_path}/wan14b.safetensors]"
    result = run_cli(f"hydra.run.dir={folder}", f"paths.cache_dir={cache_dir}", "logger=none", lora)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"error: teacher.lora[0]={tmp_path}/wan14b.safetensors is not a LoRA of this teacher: blocks.0.attn1.to_k is "
        "32x32 here, and its lora_A is [2, 64], lora_B [64, 2] (another model's LoRA, or a damaged one); give a LoRA "
        "trained on this teacher"
    ]
    assert not folder.exists()


def test_a_lora_file_changed_after_it_was_checked_is_refused_where_it_is_merged(spec, files, tmp_path):
    """The caches and checkpoints are keyed on the content checked before the run: a file rewritten since is one
    line where an expert loads, never merged silently."""
    import shutil

    copy = tmp_path / "style.safetensors"
    shutil.copy(files / "lightning.safetensors", copy)
    (lora,) = teacher_loras(str(copy), spec.experts, spec.transformer_config)
    shutil.copy(files / "kohya.safetensors", copy)  # the same layers, other bytes
    with refused(f"teacher.lora: {copy} changed since this run checked it (sha256 {lora.sha256[:12]} then)"):
        apply(load_expert(spec, "transformer", torch.float32), "transformer", [lora])
