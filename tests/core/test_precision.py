"""`wandistiller.core.precision`: dtype names converted and refused in one line, precision=auto resolved, casts that
keep diffusers' fp32 modules; called directly on tiny modules and config nodes."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from wandistiller.core.errors import UserError
from wandistiller.core.hydra import auto_precision, resolve_precision
from wandistiller.core.precision import Precision, auto_choice, cast_keeping_fp32, to_dtype


def node(name, teacher, student, autocast):
    """A `precision` config node as conf/precision/<name>.yaml holds it."""
    return OmegaConf.create({"name": name, "teacher_dtype": teacher, "student_dtype": student,
                             "autocast_dtype": autocast})  # fmt: skip


def test_precision_auto_is_fp32_without_cuda_and_the_run_records_the_choice(make_cfg):
    cfg = make_cfg("precision=auto")
    assert Precision.from_config(auto_precision(cfg.precision)).name == (
        "bf16" if torch.cuda.is_available() else "fp32"
    )


def test_casting_keeps_wans_fp32_modules_and_says_nothing(tmp_path, capfd):
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                                  text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32)  # fmt: skip
    cast_keeping_fp32(model, torch.bfloat16)
    assert model.blocks[0].norm2.weight.dtype == torch.float32 and model.scale_shift_table.dtype == torch.float32
    assert model.blocks[0].ffn.net[2].weight.dtype == torch.bfloat16
    assert "float32" not in capfd.readouterr().err


def test_a_dtype_name_converts_once_and_an_unknown_one_is_one_line_naming_its_key():
    assert [to_dtype(n, "k") for n in ("fp32", "bf16", "fp16")] == [torch.float32, torch.bfloat16, torch.float16]
    with pytest.raises(UserError) as e:
        to_dtype("fp8", "precision.teacher_dtype")
    assert str(e.value) == "precision.teacher_dtype='fp8' is not a dtype; use one of fp32, bf16, fp16"
    with pytest.raises(UserError, match="^precision.autocast_dtype='half' is not a dtype"):
        Precision.from_config(node("mine", "fp32", "fp32", "half"))


def test_only_fp16_autocast_needs_a_grad_scaler_and_fp16_is_refused_without_cuda():
    fp16, bf16 = (
        Precision.from_config(node("fp16", "fp16", "fp32", "fp16")),
        Precision.from_config(node("bf16", "bf16", "fp32", "bf16")),
    )
    fp32 = Precision.from_config(node("fp32", "fp32", "fp32", None))
    assert fp16.needs_grad_scaler and not bf16.needs_grad_scaler and not fp32.needs_grad_scaler
    assert fp32.autocast_dtype is None and bf16.student_dtype == torch.float32  # master weights stay fp32
    bf16.check(torch.device("cpu"))  # bf16 and fp32 run anywhere
    with pytest.raises(UserError, match=r"^precision=fp16 needs a CUDA GPU and none is visible; use precision=bf16"):
        fp16.check(torch.device("cpu"))
    teacher_only = Precision.from_config(node("mine", "fp16", "fp32", None))  # an fp16 teacher alone is fp16 too
    with pytest.raises(UserError, match="^precision=mine needs a CUDA GPU"):
        teacher_only.check(torch.device("cpu"))


def test_resolving_auto_writes_the_chosen_options_dtypes_into_the_config():
    cfg = OmegaConf.create({"precision": node("auto", "bf16", "fp32", "bf16")})  # auto.yaml's values are CUDA's
    resolve_precision(cfg)
    assert auto_choice() == ("bf16" if torch.cuda.is_available() else "fp32")
    expected = {"bf16": ("bf16", "bf16"), "fp32": ("fp32", None)}[auto_choice()]
    assert cfg.precision.name == auto_choice()
    assert (cfg.precision.teacher_dtype, cfg.precision.autocast_dtype) == expected
    chosen = OmegaConf.create({"precision": node("bf16", "bf16", "fp32", "bf16")})
    resolve_precision(chosen)  # a concrete choice is left as it is
    assert chosen.precision == node("bf16", "bf16", "fp32", "bf16")


class Kept(torch.nn.Module):
    _keep_in_fp32_modules = ["norm"]  # as a diffusers model lists its fp32 modules

    def __init__(self):
        super().__init__()
        self.proj, self.norm = torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)
        self.register_buffer("steps", torch.arange(3))  # not floating point: never cast


def test_casting_leaves_listed_modules_and_integer_buffers_alone_in_a_submodule_too():
    outer = torch.nn.Sequential(Kept())  # the list is found on a submodule
    assert cast_keeping_fp32(outer, torch.float16) is outer
    inner = outer[0]
    assert inner.proj.weight.dtype == torch.float16 and inner.proj.bias.dtype == torch.float16
    assert inner.norm.weight.dtype == torch.float32 and inner.steps.dtype == torch.int64
