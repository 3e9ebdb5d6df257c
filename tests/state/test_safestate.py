"""wandistiller/state/safestate.py: a training state as JSON + safetensors, round-tripped exactly, damage refused."""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest
import torch
from diffusers.training_utils import EMAModel

from tests.state.test_checkpoint import real_state
from wandistiller.state import safestate
from wandistiller.state.checkpoint import load_checkpoint, save_checkpoint


@pytest.mark.parametrize("bf16", [False, True])
def test_a_saved_state_comes_back_equal_with_the_rngs(tmp_path, bf16):
    model, state = real_state(bf16)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    path = save_checkpoint(tmp_path, 3, state, keep=2)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    loaded = load_checkpoint(path)
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    assert loaded["step"] == 3 and loaded["tracker_run_id"] == "abc123"
    for key, value in state["student"].items():
        assert torch.equal(loaded["student"][key], value) and loaded["student"][key].dtype == value.dtype
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    for i, s in state["optimizer"]["state"].items():
        assert all(torch.equal(loaded["optimizer"]["state"][i][k], v) for k, v in s.items())
    assert loaded["lr_scheduler"] == state["lr_scheduler"] and loaded["scaler"] == state["scaler"]
    assert all(torch.equal(a, b) for a, b in zip(loaded["ema"]["shadow_params"], state["ema"]["shadow_params"]))
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(loaded["optimizer"])  # the real classes take it back
    EMAModel(list(model.parameters())).load_state_dict(loaded["ema"])
    assert sorted(p.name for p in path.iterdir()) == ["state.json", "tensors.safetensors"]


def test_encode_then_json_then_decode_gives_back_tuples_non_string_keys_arrays_and_tensors():
    weights, shadow = torch.arange(6.0).view(2, 3), torch.ones(2, dtype=torch.bfloat16)
    state = {
        "betas": (0.9, 0.99),  # a tuple, as AdamW's param_groups hold it
        "state": {0: {"step": 3}},  # optimizer state: int keys
        "__odd": "a key JSON would read as a marker",
        "numpy": ("MT19937", np.arange(4, dtype=np.uint32), 2, 0, 0.0),  # np.random.get_state()'s shape
        "scalar": np.float64(1.5),
        "weights": weights,
        "nested": [{"shadow": shadow}, None, True, "text"],
    }
    tensors = {}
    data = json.loads(json.dumps(safestate.encode(state, tensors)))  # what state.json holds is plain JSON
    assert sorted(tensors) == ["state.nested.0.shadow", "state.weights"]
    back = safestate.decode(data, tensors)
    assert back["betas"] == (0.9, 0.99) and back["state"] == {0: {"step": 3}} and back["__odd"] == state["__odd"]
    assert back["numpy"][0] == "MT19937" and back["numpy"][1].dtype == np.uint32
    assert back["numpy"][1].tolist() == [0, 1, 2, 3] and back["numpy"][2:] == (2, 0, 0.0)
    assert back["scalar"] == 1.5 and torch.equal(back["weights"], weights)
    assert back["nested"][0]["shadow"] is shadow and back["nested"][1:] == [None, True, "text"]


def test_two_tensors_at_one_path_are_kept_apart():
    first, second = torch.zeros(1), torch.ones(1)
    tensors = {}
    data = safestate.encode({"a.b": first, "a": {"b": second}}, tensors)  # both spell the path state.a.b
    assert len(tensors) == 2
    back = safestate.decode(data, tensors)
    assert back["a.b"] is first and back["a"]["b"] is second


def test_what_is_not_data_is_refused_naming_where_it_is():
    with pytest.raises(TypeError, match=r"cannot hold object \(at state.optimizer.0\)"):
        safestate.encode({"optimizer": [object()]}, {})
    with pytest.raises(ValueError, match="refers to tensor 'state.w', which the tensor file lacks"):
        safestate.decode({"w": {"__tensor__": "state.w"}}, {})
    with pytest.raises(ValueError, match="unexpected dtype 'object'"):
        safestate.decode({"__ndarray__": [1], "dtype": "object"}, {})


def test_a_written_tensor_file_reads_back_bit_for_bit_and_its_size_is_the_sum(tmp_path):
    tensors = {f"t{i}": torch.arange(6).view(2, 3).to(dtype) for i, dtype in enumerate(safestate.DTYPES)}
    tensors["strided"] = torch.arange(6.0).view(2, 3).t()  # not contiguous: written in its logical order
    path = tmp_path / "tensors.safetensors"
    safestate.write_tensors(path, tensors)
    assert safestate.check_tensors(path) == set(tensors)
    back = safestate.read_tensors(path)
    assert all(torch.equal(back[k], t) and back[k].dtype == t.dtype for k, t in tensors.items())
    assert safestate.tensor_bytes({"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}) == 24 + 8
    with pytest.raises(TypeError, match=r"cannot hold a torch.complex64 tensor \(z\)"):
        safestate.write_tensors(tmp_path / "z.safetensors", {"z": torch.zeros(1, dtype=torch.complex64)})


def tensor_file(tmp_path, header: bytes, data: bytes = b"") -> object:
    path = tmp_path / "tensors.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize(
    "damage, message",
    [
        ("short", "is 3 bytes, too short to be a safetensors file"),
        ("truncated", "is 71 bytes but its header describes 72"),
        ("padded", "is 73 bytes but its header describes 72"),
        ("huge_header", "is not a safetensors file"),
        ("not_json", "its header is not JSON"),
        ("a_list", "its header is not a JSON object"),
        ("unknown_dtype", "tensor 'w' has dtype 'C64', which is not one of BF16"),
    ],
)
def test_a_tensor_file_that_is_not_whole_and_ours_is_refused(tmp_path, damage, message):
    path = tmp_path / "tensors.safetensors"
    safestate.write_tensors(path, {"w": torch.zeros(2)})  # 8 + a 56-byte header + 8 bytes of data
    whole = path.read_bytes()
    assert len(whole) == 72 and safestate.check_tensors(path) == {"w"}
    if damage == "short":
        path.write_bytes(b"abc")
    elif damage in ("truncated", "padded"):
        path.write_bytes(whole[:-1] if damage == "truncated" else whole + b"\0")
    elif damage == "huge_header":
        path.write_bytes(struct.pack("<Q", 2**40) + whole[8:])
    elif damage == "not_json":
        tensor_file(tmp_path, b"{not json")
    elif damage == "a_list":
        tensor_file(tmp_path, b"[1, 2]  ")
    else:
        tensor_file(tmp_path, json.dumps({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode())
    with pytest.raises(ValueError, match=message):
        safestate.check_tensors(path)
