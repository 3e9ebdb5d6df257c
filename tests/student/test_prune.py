"""`wandistiller.student.prune`: students cut from a teacher (or a folder) at any depth and width, on the real
tiny and pocket teachers and diffusers' WanTransformer3DModel; the refusals; quarter and tenth's sizes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import refused
from wandistiller.core.arch import POCKET_TRANSFORMER, WAN_14B, estimate_params
from wandistiller.pocket import TEACHER_DIR
from wandistiller.student.model import build_student, check_student
from wandistiller.student.prune import calibrate, read_folder_config
from wandistiller.teacher.spec import inspect_teacher

INPUTS = (torch.randn(2, 16, 1, 8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([500.0, 20.0]),
          torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(2)))  # fmt: skip


def scfg(**kw):
    return OmegaConf.create({"builder": None, "config_path": None, "init": "auto", "keep_blocks": "auto"} | kw)


def teacher_of(spec):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(spec.path / "transformer").eval()


def predict(transformer, inputs=INPUTS):
    x, t, cond = inputs
    with torch.no_grad():
        return transformer(hidden_states=x, timestep=t, encoder_hidden_states=cond, return_dict=False)[0]


def student_json(tmp_path, **shape):
    path = tmp_path / "student.json"
    path.write_text(json.dumps(shape))
    return str(path)


def test_a_keep_all_pruning_gives_the_teachers_output_exactly(tmp_path):
    spec = inspect_teacher(TEACHER_DIR)
    shape = {k: spec.transformer_config[k] for k in ("num_attention_heads", "attention_head_dim", "ffn_dim")}
    student = build_student(spec, **scfg(config_path=student_json(tmp_path, **shape, num_layers=4), init="teacher"))
    assert torch.equal(predict(student.transformer), predict(teacher_of(spec)))
    assert student.pruning["kept_blocks"] == [0, 1, 2, 3] and student.pruning["block_scores"] is None


def test_a_pruned_student_saves_and_loads_through_from_pretrained(tmp_path):
    from diffusers import WanTransformer3DModel

    spec = inspect_teacher(TEACHER_DIR)
    student = build_student(spec, **scfg(builder="quarter"))
    record = student.pruning
    # Depth first: every block, in each 3 of 6 heads and the FFN that fills the rest of the 25%.
    assert len(record["block_scores"]) == 4 and record["kept_blocks"] == [0, 1, 2, 3]
    assert record["block_score"] == "output error when skipped (relative MSE)"
    assert all(len(h["attn1"]) == 3 and len(h["attn2"]) == 3 for h in record["heads"])
    assert len(record["residual_channels"]) == 48 and all(len(f) == 171 for f in record["ffn_channels"])
    student.transformer.save_pretrained(tmp_path / "student")
    loaded = WanTransformer3DModel.from_pretrained(tmp_path / "student").eval()
    assert loaded.config.num_attention_heads == 3 and loaded.config.ffn_dim == 171
    assert torch.equal(predict(loaded), predict(student.transformer.eval()))


def test_a_block_that_does_nothing_ranks_last(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "transformer"
    shutil.copytree(TEACHER_DIR / "transformer", folder)
    (file,) = folder.glob("*.safetensors")
    state = load_file(file)
    for key in state:  # block 2's output projections: the block is the identity on the residual stream
        if key.startswith("blocks.2.") and any(p in key for p in ("to_out.0.", "ffn.net.2.")):
            state[key] = torch.zeros_like(state[key])
    save_file(state, file)
    found = calibrate(folder, read_folder_config(folder))
    for scores in (found["scores"], found["cosine"]):  # skipping it changes nothing; nor does the block
        assert scores[2] == min(scores) < 1e-6 < min(s for j, s in enumerate(scores) if j != 2)
    teacher = inspect_teacher(TEACHER_DIR).transformer_config
    config = json.loads((folder / "config.json").read_text())
    student = build_student(inspect_teacher(TEACHER_DIR), **scfg(builder="half", init=str(folder)))
    assert 2 not in student.pruning["kept_blocks"] and config["num_layers"] == teacher["num_layers"]


def test_a_keep_list_picks_those_blocks(tmp_path):
    spec = inspect_teacher(TEACHER_DIR)
    student = build_student(spec, **scfg(builder="half", keep_blocks=[1, 3]))
    teacher = teacher_of(spec)
    kept = student.transformer.blocks
    assert torch.equal(kept[0].attn1.to_q.weight, teacher.blocks[1].attn1.to_q.weight)
    assert torch.equal(kept[1].ffn.net[2].weight, teacher.blocks[3].ffn.net[2].weight)


def test_an_earlier_students_folder_starts_a_student(tmp_path):
    spec = inspect_teacher(TEACHER_DIR)
    first = build_student(spec, **scfg(builder="quarter"))
    first.transformer.save_pretrained(tmp_path / "student")
    second = build_student(spec, **scfg(builder="quarter", init=str(tmp_path / "student")))
    assert torch.equal(predict(second.transformer), predict(first.transformer))


@pytest.mark.parametrize(
    "keys,message",
    [
        (dict(builder="half", keep_blocks=[0, 4]), "student.keep_blocks=[0, 4] names block 4, but the source has "
         "blocks 0..3; give 2 distinct block indices from 0 to 3"),
        (dict(builder="half", keep_blocks=[1, 1]), "student.keep_blocks=[1, 1] names block 1 twice"),
        (dict(builder="half", keep_blocks=[1]), "keeps 1 blocks, but the student has num_layers=2"),
        (dict(builder="half", keep_blocks="best"), "student.keep_blocks=best is neither auto, even nor a list"),
        (dict(builder="half", keep_blocks=3), "student.keep_blocks=3 is neither auto, even nor a list"),
        (dict(builder="half", keep_blocks=[0, 1], init="random"), "starts from random weights; use student.init"),
        (dict(builder="small", init="teacher"), "student.init=teacher cuts the student from the teacher, but the "
         "student's attention_head_dim=128 is not the source's 16"),
        (dict(init="/nowhere/at/all", builder="quarter"), "student.init=/nowhere/at/all does not exist; give a "
         "WanTransformer3DModel folder"),
    ],
)  # fmt: skip
def test_bad_pruning_input_is_one_line_naming_the_key(keys, message):
    with refused(message) as e:
        check_student(scfg(**keys), inspect_teacher(TEACHER_DIR).transformer_config)
    assert "\n" not in str(e.value)


def test_a_keep_list_from_the_command_line_is_checked_against_the_teacher(make_cfg, tiny_path):
    teacher = inspect_teacher(tiny_path).transformer_config
    assert check_student(make_cfg("student.keep_blocks=[0,3]").student, teacher)["num_layers"] == 2
    with refused("student.keep_blocks=[0, 9] names block 9, but the source has blocks 0..3"):
        check_student(make_cfg("student.keep_blocks=[0,9]").student, teacher)


def test_a_width_that_does_not_divide_into_the_teachers_heads_is_refused(tmp_path):
    path = student_json(tmp_path, num_attention_heads=3, attention_head_dim=20, ffn_dim=64, num_layers=2)
    with refused("the student's width 60 does not divide into the source's heads of 16 channels"):
        check_student(scfg(config_path=path, init="teacher"), inspect_teacher(TEACHER_DIR).transformer_config)


def test_an_init_folder_of_another_family_or_width_is_refused(tmp_path):
    teacher = inspect_teacher(TEACHER_DIR).transformer_config
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan"}))
    with refused(f"student.init={tmp_path / 'vae'} holds a AutoencoderKLWan model, not a WanTransformer3DModel"):
        check_student(scfg(builder="quarter", init=str(tmp_path / "vae")), teacher)
    with refused("holds no config.json; it is not a diffusers model folder"):
        check_student(scfg(builder="quarter", init=str(tmp_path)), teacher)
    small = tmp_path / "small"
    shutil.copytree(TEACHER_DIR / "transformer", small)
    (small / "config.json").write_text(json.dumps(read_folder_config(small) | {"_class_name": "WanTransformer3DModel",
                                                                                "num_attention_heads": 2}))  # fmt: skip
    with refused(f"student.init={small} cannot start this student: the student's num_attention_heads=6 is more "
                 "than the source's 2"):  # fmt: skip
        check_student(scfg(builder="half", init=str(small)), teacher)


def test_tenth_of_a_teacher_too_narrow_to_cut_is_refused(tiny_path):
    with refused("student=tenth: no shape of the teacher at its head size holds 10% or less of its parameters"):
        check_student(scfg(builder="tenth"), inspect_teacher(tiny_path).transformer_config)


@pytest.mark.parametrize("teacher", [POCKET_TRANSFORMER, WAN_14B], ids=["pocket", "14b"])
@pytest.mark.parametrize("builder,share", [("quarter", 0.25), ("tenth", 0.10)])
def test_quarter_and_tenth_hold_at_most_their_share_of_the_teacher(teacher, builder, share):
    from diffusers import WanTransformer3DModel

    from wandistiller.student.model import student_config

    config = student_config(scfg(builder=builder), teacher)
    assert config["attention_head_dim"] == teacher["attention_head_dim"]
    with torch.device("meta"):
        built = sum(p.numel() for p in WanTransformer3DModel.from_config(config).parameters())
    assert built == estimate_params(config)
    assert 0.6 * share < built / estimate_params(teacher) <= share


def test_a_student_cut_from_a_fine_tuned_teacher_is_cut_from_its_merged_weights(tiny_path, tmp_path):
    """teacher.lora: the block scores and the cut weights are the fine-tuned teacher's (its LoRA merged into the
    tensors as they are read), the same as from a folder holding that teacher merged."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    from tests.teacher.test_finetune import peft_state
    from wandistiller.student.prune import prune_into
    from wandistiller.teacher.finetune import patch_of, with_loras
    from wandistiller.teacher.model import save_finetuned_expert

    spec = inspect_teacher(tiny_path)
    save_file(peft_state(spec.transformer_config), tmp_path / "style.safetensors")
    tuned = with_loras(spec, [{"path": str(tmp_path / "style.safetensors"), "strength": 0.6}])
    save_finetuned_expert(tuned, "transformer", tmp_path / "merged")
    config = spec.transformer_config | {"num_layers": 2}
    cut, reference = (WanTransformer3DModel.from_config(config) for _ in range(2))
    patch = patch_of(tuned.loras, "transformer")
    record = prune_into(cut, spec.path / "transformer", spec.transformer_config, "auto", patch)
    expected = prune_into(reference, tmp_path / "merged", spec.transformer_config, "auto")
    assert record["kept_blocks"] == expected["kept_blocks"]
    assert record["block_scores"] == pytest.approx(expected["block_scores"], abs=1e-6)
    plain = prune_into(WanTransformer3DModel.from_config(config), spec.path / "transformer", spec.transformer_config)
    assert plain["block_scores"] != pytest.approx(record["block_scores"], abs=1e-6)  # the LoRA changed the teacher
    for (name, ours), theirs in zip(cut.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0, msg=name)
