"""wandistiller/bench/gradcheck.py: `python -m wandistiller.bench grad-check` on the tiny teacher (the streamed
teachers' LoRA gradients are the resident one's, bit for bit, bf16 and fp8 bases), its verdicts (a corrupted
gradient is a FAIL, exit 1), and its bad input (one line, exit 2, nothing written)."""

from __future__ import annotations

import pytest
import torch

from wandistiller.bench import gradcheck
from wandistiller.bench.__main__ import main, parser
from wandistiller.core.errors import UserError


def _args(cache_dir, tmp_path, *extra: str):
    return parser().parse_args(
        ["grad-check", f"paths.cache_dir={cache_dir}", *extra, "--out", str(tmp_path / "g.json")]
    )


@pytest.mark.parametrize("base", [["precision=fp32"], ["precision=bf16", "teacher.quantize=fp8"]], ids=["fp32", "fp8"])
def test_the_streamed_teachers_give_the_resident_teachers_lora_gradients_bit_for_bit(cache_dir, tmp_path, capsys, base):
    result = gradcheck.run(_args(cache_dir, tmp_path, "teacher=tiny_moe", *base, "--steps", "2"))
    line = capsys.readouterr().out.strip()
    assert result["ok"] and line == result["verdict"] and line.startswith("grad-check: PASS: 2 LoRA steps, ")
    assert line.endswith(
        "offload and disk (1 block(s) resident, the rest streamed) vs the resident teacher (cpu): bit for bit"
    )
    assert set(result["placements"]) == {"offload", "disk"}
    assert all(r["identical"] and r["max_abs_diff"] == 0 for r in result["placements"].values())
    assert not list(cache_dir.glob("grad-check-*"))  # disk's scratch copy is gone


def test_a_corrupted_gradient_is_a_fail_and_a_reordered_sum_is_close():
    g = torch.Generator().manual_seed(0)
    reference = [{"0.down.blocks_0_attn1_to_q": torch.randn(4, 32, generator=g)} for _ in range(2)]
    same = [{k: v.clone() for k, v in step.items()} for step in reference]
    close = [{k: v * (1 + 1e-6) for k, v in step.items()} for step in reference]
    corrupt = [same[0], {k: torch.roll(v, 1, 0) for k, v in reference[1].items()}]  # a block's rows swapped
    found = {"offload": gradcheck.compare(reference, same), "disk": gradcheck.compare(reference, corrupt)}
    ok, line = gradcheck.verdict(found, "cpu", 1, 2, 0)
    assert not ok and line.startswith("grad-check: FAIL: the adapters' gradients through the streamed teacher (disk)")
    assert "at step 1, 0.down.blocks_0_attn1_to_q" in line
    ok, line = gradcheck.verdict({"disk": gradcheck.compare(reference, close)}, "cpu", 1, 2, 0)
    assert ok and line.startswith("grad-check: CLOSE: ") and "not bit for bit" in line


@pytest.mark.parametrize(
    "fault",
    [lambda v: v * 2, lambda v: v * (1 + 2e-3), lambda v: v.index_fill(0, torch.tensor([0]), float("nan"))],
    ids=["accumulated twice", "scaled 0.2%", "nan"],
)
def test_a_scaled_or_non_finite_gradient_is_a_fail_though_its_cosine_reads_1(fault):
    g = torch.Generator().manual_seed(0)
    reference = [{"0.down.blocks_0_attn1_to_q": torch.randn(4, 32, generator=g)}]
    streamed = [{k: fault(v) for k, v in reference[0].items()}]
    ok, line = gradcheck.verdict({"offload": gradcheck.compare(reference, streamed)}, "cpu", 1, 1, 0)
    assert not ok and line.startswith("grad-check: FAIL: ") and "cosine -1.0000 at step 0" in line


def test_an_image_to_video_teacher_is_refused_in_one_line(tiny_i2v_path, cache_dir, tmp_path):
    args = _args(cache_dir, tmp_path, f"teacher.path={tiny_i2v_path}")
    with pytest.raises(UserError, match="is an image-to-video model, and grad-check feeds text-to-video inputs"):
        gradcheck.run(args)
    assert not (tmp_path / "g.json").exists()


@pytest.mark.parametrize("kept", ["4", "999"])
def test_every_block_resident_is_refused_since_nothing_would_be_streamed(cache_dir, tmp_path, kept):
    """The tiny teacher has 4 blocks: keeping them all resident streams nothing, and its PASS checked nothing."""
    args = _args(cache_dir, tmp_path, "--resident-blocks", kept)
    with pytest.raises(UserError, match=f"--resident-blocks={kept} keeps all 4 blocks of teacher tiny resident, so"):
        gradcheck.run(args)
    assert not (tmp_path / "g.json").exists()


def test_a_fail_exits_1_after_writing_its_numbers(monkeypatch, tmp_path):
    out = tmp_path / "g.json"
    monkeypatch.setattr(gradcheck, "run", lambda args: {"ok": False, "verdict": "grad-check: FAIL: ..."})
    monkeypatch.setattr("sys.argv", ["bench", "grad-check", "--out", str(out)])
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 1 and out.is_file()


@pytest.mark.parametrize(
    "extra,said",
    [
        (["--resident-blocks", "-1"], "--resident-blocks=-1 must be 0 or more"),
        (["--rank", "0"], "--rank=0 must be 1 or more"),
        (["--steps", "0"], "--steps=0 must be 1 or more"),
        (["teacher.quantize=int3"], "teacher.quantize=int3 is unknown"),
        (["trainer..max_steps=3"], "trainer..max_steps=3"),
        # A run's overrides it does not read: dropped without a word, the verdict was of another check.
        (["student=lora", "student.rank=16"], "grad-check: student=lora is not read: it takes the teacher's overrides"),
        (["teacher_placement=offload"], "and its placements are fixed (the resident teacher vs offload and disk"),
        (["+data.latent_height=4"], "its latents' size is --latent-height / --latent-width"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(monkeypatch, tmp_path, capsys, extra, said):
    out = tmp_path / "g.json"
    monkeypatch.setattr("sys.argv", ["bench", "grad-check", f"paths.cache_dir={tmp_path / 'cache'}", *extra,
                                     "--out", str(out)])  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and said in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_check_refuses_before_anything_loads():
    args = parser().parse_args(["grad-check", "--resident-blocks", "-2"])
    with pytest.raises(UserError, match="0: every block streamed"):
        gradcheck.check(args)
