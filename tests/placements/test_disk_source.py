"""Tests of wandistiller/placements/disk_source.py, an expert read from its safetensors files: DiskSource's tensors
and dtypes against the loaded model, and converted_copy's copy (written once, refused where it cannot be written)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import BF16
from tests.placements.test_streaming import TEACHER
from wandistiller.core.distributed import Topology
from wandistiller.core.errors import UserError
from wandistiller.core.precision import DTYPES
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.placements.disk import DiskPlacement
from wandistiller.placements.disk_source import DiskSource, converted_copy
from wandistiller.teacher.spec import inspect_teacher


def test_a_disk_teacher_stored_in_fp32_streams_from_a_bf16_copy_written_once(tiny_moe_path, tmp_path):
    from wandistiller.placements.disk_source import DiskSource

    spec = inspect_teacher(tiny_moe_path)
    # The tiny teacher is saved in fp32.
    assert not DiskSource(tiny_moe_path / "transformer", DTYPES["bf16"]).stored_as_computed()
    resident = CpuPlacement().load(spec, TEACHER, BF16, Topology())
    placement = DiskPlacement(resident_blocks=0, offload_dir=str(tmp_path / "offload"))
    teacher = placement.load(spec, TEACHER, BF16, Topology())
    copies = sorted((tmp_path / "offload").iterdir())
    assert [c.name.split("-")[:2] for c in copies] == [["transformer", "bfloat16"], ["transformer_2", "bfloat16"]]
    assert all(DiskSource(c, DTYPES["bf16"]).stored_as_computed() for c in copies)
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(2, 16, 1, 8, 8, generator=g), torch.randn(2, 512, 32, generator=g)
    t, uncond = torch.tensor([950.0, 100.0]), torch.zeros(2, 512, 32)
    assert torch.equal(teacher.targets(x, t, cond, uncond)[0], resident.targets(x, t, cond, uncond)[0])
    written = {f: f.stat().st_mtime_ns for c in copies for f in c.iterdir()}
    placement.load(spec, TEACHER, BF16, Topology())  # a later run reuses the copy
    assert {f: f.stat().st_mtime_ns for c in copies for f in c.iterdir()} == written


def test_an_offload_dir_that_cannot_be_written_is_refused_naming_the_key(tiny_path, tmp_path):
    (tmp_path / "a_file").write_text("")
    placement = DiskPlacement(offload_dir=str(tmp_path / "a_file" / "offload"))
    with pytest.raises(UserError, match=r"teacher_placement.offload_dir=.* cannot be written .* writable folder"):
        placement.load(inspect_teacher(tiny_path), TEACHER, BF16, Topology())


@pytest.fixture(scope="module")
def tiny_transformer(tiny_path):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(tiny_path, subfolder="transformer", use_safetensors=True)


def test_a_block_is_read_by_its_names_inside_the_block_in_the_dtype_it_computes_in(tiny_path, tiny_transformer):
    source = DiskSource(tiny_path / "transformer", torch.bfloat16)
    assert sorted(source.block_keys) == list(range(len(tiny_transformer.blocks)))
    block = source.fetch(1)
    want = tiny_transformer.blocks[1].state_dict()
    assert block.keys() == want.keys()
    for name, tensor in block.items():
        kept_in_fp32 = name == "scale_shift_table" or name.startswith(("norm1.", "norm2.", "norm3."))
        assert tensor.dtype == (torch.float32 if kept_in_fp32 else torch.bfloat16), name
        assert torch.equal(tensor, want[name].to(tensor.dtype)), name
    assert source.dtype_of("condition_embedder.time_embedder.linear_1.weight") == torch.float32
    assert source.read("proj_out.bias").dtype == torch.bfloat16


def test_files_stored_in_the_compute_dtype_are_streamed_as_they_are_and_not_copied(tiny_path, tmp_path):
    folder = tiny_path / "transformer"  # the tiny teacher is saved in fp32
    assert DiskSource(folder, torch.float32).stored_as_computed()
    assert converted_copy(folder, torch.float32, str(tmp_path / "offload"), Topology()) == folder
    assert not (tmp_path / "offload").exists()
    assert converted_copy(folder, torch.bfloat16, None, Topology()) == folder  # no offload_dir: no copy either
