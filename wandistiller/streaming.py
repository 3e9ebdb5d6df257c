"""Stream a frozen Wan transformer's blocks to the compute device, one block ahead of the compute.

The teacher's 40 blocks hold ~99% of its bytes. Everything else (embeddings, output head, rope) stays
resident on the device, as do the first `resident_blocks` blocks when memory allows. Each other block
is copied into one of two device slots right before it runs, the next one on a side stream while the
current one computes (double buffering), so copy time hides behind compute. Frozen weights are never
copied back.

Sources: `HostSource` keeps each block in pinned host memory (placement `offload`); `DiskSource`
reads it from the safetensors files, memory-mapped (placement `disk`), for teachers larger than RAM.
On a CPU device the same code runs with plain copies (what the tests check: outputs equal the
resident model's, bit for bit).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn


class HostSource:
    """Each streamed block's tensors in host memory (pinned when the device is a GPU)."""

    def __init__(self, blocks: nn.ModuleList, indices: list[int], pin: bool):
        self.tensors = {
            i: {n: (t.detach().pin_memory() if pin else t.detach()) for n, t in _block_tensors(blocks[i]).items()}
            for i in indices
        }

    def fetch(self, i: int) -> dict[str, torch.Tensor]:
        return self.tensors[i]


class DiskSource:
    """Each streamed block's tensors read on demand from the expert's safetensors files (memory-mapped)."""

    def __init__(self, folder: Path, dtype: torch.dtype, keep_fp32: set[str], pin: bool):
        from safetensors import safe_open

        index_file = folder / "diffusion_pytorch_model.safetensors.index.json"
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
        else:
            weight_map = {
                k: "diffusion_pytorch_model.safetensors" for k in _keys(folder / "diffusion_pytorch_model.safetensors")
            }
        self.files = {name: safe_open(folder / name, framework="pt") for name in set(weight_map.values())}
        self.weight_map, self.dtype, self.keep_fp32, self.pin = weight_map, dtype, keep_fp32, pin

    def fetch(self, i: int) -> dict[str, torch.Tensor]:
        prefix = f"blocks.{i}."
        out = {}
        for key, file in self.weight_map.items():
            if key.startswith(prefix):
                name = key[len(prefix) :]
                t = self.files[file].get_tensor(key)
                t = t.to(torch.float32 if _is_fp32(name, self.keep_fp32) else self.dtype)
                out[name] = t.pin_memory() if self.pin else t
        return out


def _keys(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        return list(f.keys())


def _is_fp32(name: str, keep_fp32: set[str]) -> bool:
    return any(part in keep_fp32 for part in name.split("."))


def _block_tensors(block: nn.Module) -> dict[str, torch.Tensor]:
    return dict(block.named_parameters()) | dict(block.named_buffers())


def replace_tensor(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` in place of a parameter or buffer, also across devices (meta -> real), which `.data=` can't."""
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[leaf] = tensor


class BlockStreamer:
    """Hooks on a model's blocks that stream their weights into two reusable device slots.

    `stream(model)` installs it; the model's non-block modules must already be on `device`.
    """

    def __init__(self, blocks: nn.ModuleList, device: torch.device, source, streamed: list[int]):
        self.blocks, self.device, self.source, self.streamed = blocks, device, source, streamed
        self.next_of = {a: b for a, b in zip(streamed, streamed[1:] + streamed[:1])}
        template = _block_tensors(blocks[streamed[0]])
        # Two device slots shaped like one block: the one computing and the one being filled.
        self.slots = [{n: torch.empty_like(t, device=device) for n, t in template.items()} for _ in range(2)]
        self.holds: list[int | None] = [None, None]  # which block each slot holds (or is receiving)
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.copied = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        self.computed = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        self.reader = ThreadPoolExecutor(1) if isinstance(source, DiskSource) else None
        self.pending: dict[int, Future] = {}
        self.copy_events: list[tuple] = []  # (start, end) CUDA events of copies not yet counted
        self.copy_seconds = 0.0  # copy time already counted (CPU copies, and drained CUDA events)
        for i in streamed:
            blocks[i].register_forward_pre_hook(lambda m, args, i=i: self._before(i))
            blocks[i].register_forward_hook(lambda m, args, out, i=i: self._after(i))
            for n, t in _block_tensors(blocks[i]).items():  # the host/disk copy is the only one now
                replace_tensor(blocks[i], n, torch.empty(0, dtype=t.dtype, device=device))

    def _read_ahead(self, i: int) -> None:
        if self.reader is not None and i not in self.pending:
            self.pending[i] = self.reader.submit(self.source.fetch, i)

    def _host(self, i: int) -> dict[str, torch.Tensor]:
        if self.reader is not None:
            self._read_ahead(i)
            return self.pending.pop(i).result()
        return self.source.fetch(i)

    def _load(self, i: int, slot: int) -> None:
        """Copy block i into `slot`: on the side stream, after the slot's previous block finished computing."""
        host = self._host(i)
        self.holds[slot] = i
        if not self.cuda:
            start = time.perf_counter()
            for n, t in self.slots[slot].items():
                t.copy_(host[n])
            self.copy_seconds += time.perf_counter() - start
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.computed[slot])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.copy_stream)
            for n, t in self.slots[slot].items():
                t.copy_(host[n], non_blocking=True)
            end.record(self.copy_stream)
            self.copied[slot].record(self.copy_stream)
            self.copy_events.append((start, end))

    def drain_copy_ms(self) -> float:
        """Milliseconds spent copying blocks since the last call (on the copy stream: overlapped, not added)."""
        in_flight = []
        for start, end in self.copy_events:  # copies still running are counted next time
            if end.query():
                self.copy_seconds += start.elapsed_time(end) / 1e3
            else:
                in_flight.append((start, end))
        self.copy_events = in_flight
        ms, self.copy_seconds = self.copy_seconds * 1e3, 0.0
        return ms

    def _before(self, i: int) -> None:
        if i not in self.holds:  # the first block of the first forward: nobody prefetched it
            self._load(i, 0 if self.holds[0] is None else 1)
        slot = self.holds.index(i)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[slot])
        for n, t in _block_tensors(self.blocks[i]).items():
            t.data = self.slots[slot][n]
        nxt = self.next_of[i]
        if nxt != i:
            self._load(nxt, 1 - slot)  # prefetch while block i computes
            self._read_ahead(self.next_of[nxt])

    def _after(self, i: int) -> None:
        if self.cuda:
            self.computed[self.holds.index(i)].record(torch.cuda.current_stream(self.device))


def stream_blocks(
    model: nn.Module, device: torch.device, source_kind: str, resident_blocks: int, folder: Path | None = None
) -> BlockStreamer | None:
    """Keep the first `resident_blocks` blocks and everything outside the blocks on `device`; stream the rest.

    The model comes loaded on the CPU (`offload`) or with its blocks still on the meta device (`disk`).
    """
    blocks = model.blocks
    streamed = list(range(min(resident_blocks, len(blocks)), len(blocks)))
    pin = device.type == "cuda"
    if source_kind == "host":
        source = HostSource(blocks, streamed, pin)
    else:
        keep = set(getattr(model, "_keep_in_fp32_modules", None) or [])
        source = DiskSource(folder, model.dtype, keep, pin)
    for i, block in enumerate(blocks):
        if i in streamed:
            continue
        if source_kind == "host":
            block.to(device)
        else:  # resident blocks of a disk teacher: read once, kept on the device
            for n, t in source.fetch(i).items():
                replace_tensor(block, n, t.to(device))
    for name, child in model.named_children():
        if name != "blocks":
            child.to(device)
    for name, p in list(model.named_parameters(recurse=False)) + list(model.named_buffers(recurse=False)):
        replace_tensor(model, name, p.data.to(device))
    if not streamed:
        return None
    return BlockStreamer(blocks, device, source, streamed)


def load_streamed_expert(
    path: Path, dtype: torch.dtype, device: torch.device, source_kind: str, resident_blocks: int
) -> tuple[nn.Module, BlockStreamer | None]:
    """One expert whose blocks stream to `device`: `host` loads it into (pinned) RAM first; `disk` never
    reads a block into RAM until it is needed, so the teacher may be larger than RAM."""
    from wandistiller.teacher import freeze

    if source_kind == "host":
        from diffusers import WanTransformer3DModel

        model = WanTransformer3DModel.from_pretrained(
            path.parent, subfolder=path.name, dtype=dtype, use_safetensors=True
        )
    else:
        model = _skeleton_with_resident_weights(path, dtype)
    streamer = stream_blocks(model, device, source_kind, resident_blocks, folder=path)
    return freeze(model), streamer


def _skeleton_with_resident_weights(folder: Path, dtype: torch.dtype) -> nn.Module:
    """The model with every weight on the meta device, then the non-block weights read from its files."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights():
        model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(folder))
    keep = set(model._keep_in_fp32_modules or [])
    source = DiskSource(folder, dtype, keep, pin=False)
    wanted = {k for k in source.weight_map if not k.startswith("blocks.")}
    for name, p in list(model.named_parameters()):
        dt = torch.float32 if _is_fp32(name, keep) else dtype
        if name in wanted:
            replace_tensor(model, name, source.files[source.weight_map[name]].get_tensor(name).to(dt))
        else:
            replace_tensor(model, name, torch.empty_like(p, dtype=dt, device="meta"))
    return model
