"""Tests wandistiller/bench/load.py: each of the three loaders it compares (from_pretrained, offload's host stream,
disk's) loads a tiny real Wan expert folder and reports its seconds and memory, in-process; the whole bench (a
fresh process per loader) in the slow lane."""

from __future__ import annotations

import re
import threading
from types import SimpleNamespace

import pytest
import torch

from wandistiller.bench.load import _load_once, load_bench
from wandistiller.bench.models import ARCHS


@pytest.fixture
def expert_folder(tmp_path):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    folder = tmp_path / "bench_tiny" / "transformer"
    WanTransformer3DModel(**ARCHS["tiny"]).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("how", ["from_pretrained", "host", "disk"])
def test_each_loader_loads_the_expert_and_reports_its_time_and_memory(expert_folder, how):
    result = _load_once(how, str(expert_folder), "cpu")
    assert set(result) == {"how", "seconds", "peak_rss_gib", "peak_anon_shmem_gib", "held_anon_shmem_gib"}
    assert result["how"] == how and 0 < result["seconds"] < 30


def test_a_folder_without_an_expert_is_an_error_not_a_row_and_stops_the_memory_sampler(tmp_path):
    threads = threading.active_count()
    with pytest.raises(OSError, match=re.escape(str(tmp_path))):
        _load_once("from_pretrained", str(tmp_path / "transformer"), "cpu")
    assert threading.active_count() == threads  # left sampling, it kept the process from ever exiting


@pytest.mark.slow  # three fresh (spawned) processes, each importing torch and diffusers
def test_the_bench_reuses_the_written_expert_and_prints_one_row_per_loader(expert_folder, capsys):
    stored = sum(f.stat().st_size for f in expert_folder.glob("*.safetensors")) / 2**30
    result = load_bench(SimpleNamespace(arch="tiny", folder=str(expert_folder.parent), device="cpu"))
    assert result["benchmark"] == "load" and result["stored_gib"] == stored  # the folder there is used, not rebuilt
    assert [r["how"] for r in result["rows"]] == ["from_pretrained", "host", "disk"]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("one tiny expert, bf16") and [line.split()[0] for line in lines[2:]] == [
        "from_pretrained", "offload", "disk"]  # fmt: skip
