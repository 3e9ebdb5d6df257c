"""`wandistiller.core.tensor_files`: safetensors headers told whole or damaged (hostile ones included, in one line),
and the files' stamps a cache key takes; on tiny real files in a temporary folder."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from tests.teacher.test_spec import WEIGHTS
from wandistiller.core.tensor_files import file_stamps, safetensors_problem


@pytest.fixture
def weights(tmp_path):
    """A whole safetensors file of two tiny tensors, with metadata."""
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}, path, metadata={"format": "pt"})
    return path


def test_a_whole_safetensors_file_has_no_problem_and_a_truncated_one_says_so(weights):
    assert safetensors_problem(weights) is None
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-1])  # one byte of data short
    assert "truncated or damaged" in safetensors_problem(weights)
    weights.write_bytes(whole[:100])  # cut inside the header
    assert "its header claims" in safetensors_problem(weights)
    weights.write_bytes(b"")
    assert safetensors_problem(weights) == f"{weights} is 0 bytes, too short to be a safetensors file (truncated or " \
        "empty)"  # fmt: skip


def test_a_header_that_is_not_safetensors_is_named_for_what_is_wrong(tmp_path):
    def file_with_header(text: str, data: bytes = b"") -> str | None:
        path = tmp_path / "x.safetensors"
        path.write_bytes(len(text).to_bytes(8, "little") + text.encode() + data)
        return safetensors_problem(path)

    assert "its header is not JSON" in file_with_header("{not json")
    assert "not a JSON object" in file_with_header("[1, 2]")
    assert "tensor 'w' has no dtype/shape/data_offsets" in file_with_header('{"w": {"dtype": "F32"}}')
    span = '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}'  # 2 floats need 8 bytes
    assert "tensor 'w' spans 4 bytes, its shape needs 8" in file_with_header(span, b"\0" * 4)
    assert safetensors_problem(tmp_path / "missing.safetensors").endswith("cannot be read (No such file or directory)")


def test_file_stamps_name_size_and_change_when_a_file_is_rewritten(tmp_path):
    (tmp_path / "b.safetensors").write_bytes(b"12")
    (tmp_path / "a.safetensors").write_bytes(b"1")
    (tmp_path / "notes.txt").write_text("not matched")
    before = file_stamps(tmp_path, "*.safetensors")
    assert [(name, size) for name, size, _ in before] == [("a.safetensors", 1), ("b.safetensors", 2)]
    os.utime(tmp_path / "a.safetensors", ns=(before[0][2] + 10**9,) * 2)  # a rebuild at a later time
    assert file_stamps(tmp_path, "*.safetensors") != before


def test_a_good_safetensors_file_passes_the_header_check(tiny_path):
    assert safetensors_problem(tiny_path / WEIGHTS) is None


def header_file(tmp_path, header: dict, data_len: int) -> object:
    import json as json_

    text = json_.dumps(header).encode()
    path = tmp_path / "h.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"\0" * data_len)
    return path


@pytest.mark.parametrize(
    "header, data_len, message",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12, "overlaps the one before it"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 8, "leaves a gap of 4 bytes"),
        ({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, 4, "has dtype 'Q7', which is not one of"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, 4, "has shape [-1], not a list of sizes"),
        ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, 4, "not a list of sizes"),
        ({"a": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, 8, "not a list of sizes"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, 4, "not [start, end]"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}}, 4, "not [start, end]"),
        ({"__metadata__": {"format": 1}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 4,
         "__metadata__ must map names to strings"),
        ({"__metadata__": [1], "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 4, "__metadata__"),
        ({"a": [1, 2]}, 0, "tensor 'a' has no dtype/shape/data_offsets"),
    ],
)  # fmt: skip
def test_a_hostile_header_that_keeps_the_sizes_consistent_is_one_line(tmp_path, header, data_len, message):
    problem = safetensors_problem(header_file(tmp_path, header, data_len))
    assert problem is not None and message in problem and "\n" not in problem


def test_a_field_safetensors_ignores_is_ignored_here_too(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}  # safetensors loads it
    assert safetensors_problem(header_file(tmp_path, header, 4)) is None


def test_a_header_naming_a_tensor_twice_or_nested_too_deep_is_one_line(tmp_path):
    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    text = f'{{"a": {entry}, "a": {entry}}}'.encode()
    path = tmp_path / "d.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"\0" * 4)
    assert "its header names 'a' twice" in safetensors_problem(path)
    deep = b"[" * 100_000 + b"]" * 100_000
    path.write_bytes(len(deep).to_bytes(8, "little") + deep)
    assert "nested too deeply" in safetensors_problem(path) or "not a JSON object" in safetensors_problem(path)
