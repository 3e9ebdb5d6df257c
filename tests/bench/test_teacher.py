"""Tests wandistiller/bench/teacher.py's arithmetic and table: a row's per-sample times, ratios, copy floor and MFU
from measured seconds, the fp8 columns against bf16, and the fp8 table printed; plain numbers and tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from wandistiller.bench.models import forward_flops
from wandistiller.bench.teacher import _fp8_columns, _print_fp8, _row

CONFIG = {"num_attention_heads": 2, "attention_head_dim": 16, "ffn_dim": 64, "num_layers": 4}


def test_a_row_is_per_sample_times_their_ratios_and_the_mfu_of_each():
    output = torch.arange(6.0)
    row = _row(2, (0.2, 1.5, output), (0.3, 0.5, output.clone()), 0.1, CONFIG, tokens=16)
    assert row["batch"] == 2 and row["bit_identical"] is True
    assert row["resident_ms_per_sample"] == pytest.approx(100) and row["offload_ms_per_sample"] == pytest.approx(150)
    assert row["ratio_vs_resident"] == pytest.approx(1.5) and row["ratio_vs_copy_floor"] == pytest.approx(3.0)
    assert row["copy_floor_ms"] == pytest.approx(100)
    assert row["resident_mfu_vs_989"] == pytest.approx(forward_flops(CONFIG, 2, 16) / 0.2 / 989e12)
    assert row["offload_mfu_vs_989"] == pytest.approx(row["resident_mfu_vs_989"] * 0.2 / 0.3)
    assert (row["resident_peak_gib"], row["offload_peak_gib"]) == (1.5, 0.5)


def test_without_a_measured_bandwidth_the_floor_columns_are_empty_and_a_changed_output_shows():
    row = _row(1, (0.2, None, torch.zeros(3)), (0.2, None, torch.ones(3)), None, CONFIG, tokens=16)
    assert row["copy_floor_ms"] is None and row["ratio_vs_copy_floor"] is None and row["bit_identical"] is False


def test_fp8_columns_compare_speed_and_precision_with_bf16(capsys):
    reference = torch.tensor([1.0, -1.0, 2.0, -2.0])
    bf16, resident = (0.4, None, reference), (0.1, None, reference * 1.1)  # 10% off: relative MSE 0.01
    streamed = (0.3, None, reference)
    columns = _fp8_columns(2, bf16, resident, streamed, bf16_floor=0.6)
    assert columns["bf16_resident_ms_per_sample"] == pytest.approx(200) and columns["fp8_vs_bf16_resident"] == 0.25
    assert columns["rel_mse_vs_bf16"] == pytest.approx(0.01) and columns["streamed_rel_mse_vs_bf16"] == 0
    assert columns["offload_vs_bf16_copy_floor"] == pytest.approx(0.5)
    assert _fp8_columns(2, bf16, resident, streamed, bf16_floor=None)["offload_vs_bf16_copy_floor"] is None
    _print_fp8([{"batch": 2, **columns}, {"batch": 8, **columns, "offload_vs_bf16_copy_floor": None}])
    header, first, second = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["batch", "bf16", "res."] and first.split() == ["2", "200.0", "0.250", "1.00e-02",
                                                                                "0.500"]  # fmt: skip
    assert math.isnan(float(second.split()[-1]))  # no floor measured: nan, not a crash
