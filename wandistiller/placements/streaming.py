"""Stream a frozen Wan transformer's blocks to the compute device, one block ahead of the compute.

The teacher's 40 blocks hold ~99% of its bytes. Everything else (embeddings, output head, rope) stays
resident on the device, as do the first `resident_blocks` blocks when memory allows. Each other block
is copied into one of two device slots right before it runs, the next one on a side stream while the
current one computes (double buffering), so copy time hides behind compute. Frozen weights are never
copied back.

Sources: `HostSource` packs the streamed blocks into one host buffer, page-locked exactly where it
lies and shared by a node's ranks (placement `offload`); `DiskSource` reads each block from the
safetensors files, memory-mapped (placement `disk`), for teachers larger than RAM -- from a copy in
the compute dtype when the files are stored wider. Neither ever holds the whole teacher in RAM twice:
blocks are read from the files one at a time. On a CPU device the same code runs with plain copies
(what the tests check: outputs equal the resident model's, bit for bit).

Backward through a streamed block (LoRA adapters on the frozen teacher: dmd's `method.fake_score=lora`) is
block-level checkpointing (`Recomputed`): the forward keeps only the block's inputs, never a tensor of its slot,
which the next block but one overwrites; in backward the block streams in again (in reverse order, the one before
it prefetched as in the forward), its forward is recomputed with the adapters on or off as they were, and its
gradients go back before the block leaves. Under torch.no_grad() (targets, samples) blocks run as before.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import mmap
import shutil
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from wandistiller.core.errors import UserError
from wandistiller.placements.disk_source import DiskSource
from wandistiller.teacher.finetune import Patch
from wandistiller.teacher.fp8 import block_fp8_layers, quantize_model
from wandistiller.teacher.lora import LayerAdapters, Switch, held_adapters
from wandistiller.teacher.model import blocks_of, freeze

if TYPE_CHECKING:
    from diffusers import ModelMixin

ALIGN = 512  # bytes; every tensor of a packed block starts at such an offset (any dtype may view it)
SHM = Path("/dev/shm")


@dataclass(frozen=True)
class BlockLayout:
    """Where each of a block's tensors sits in one flat byte buffer. Wan's blocks all share one layout,
    so a block moves host -> device as one contiguous copy, into a slot whose views never change."""

    entries: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]  # name, dtype, shape, byte offset
    nbytes: int

    @classmethod
    def of(cls, block: nn.Module) -> BlockLayout:
        entries, offset = [], 0
        for name, t in _block_tensors(block).items():
            entries.append((name, t.dtype, tuple(t.shape), offset))
            offset += -(-t.numel() * t.dtype.itemsize // ALIGN) * ALIGN
        return cls(tuple(entries), offset)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            name: flat[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for name, dtype, shape, offset in self.entries
        }


class HostSource:
    """The streamed blocks packed back to back in one host buffer: one copy per block (not one per tensor)."""

    def __init__(self, buffer: torch.Tensor, layout: BlockLayout, indices: list[int]):
        self.buffer, self.layout = buffer, layout
        self.position = {i: k for k, i in enumerate(indices)}

    def fetch(self, i: int) -> torch.Tensor:
        k, n = self.position[i], self.layout.nbytes
        return self.buffer[k * n : (k + 1) * n]


def pack_blocks(buffer: torch.Tensor, layout: BlockLayout, indices: list[int], read_block) -> None:
    """Fill `buffer` with blocks `indices`, each read by `read_block(i)` (name -> tensor) one at a time."""
    packed = HostSource(buffer, layout, indices)
    for i in indices:
        views = layout.views(packed.fetch(i))
        for name, t in read_block(i).items():
            views[name].copy_(t)


def pin_exactly(buffer: torch.Tensor) -> None:
    """Page-lock `buffer` where it lies (cudaHostRegister). Tensor.pin_memory() would copy it into torch's
    caching host allocator, which rounds each request up to a power of two: up to ~2x the RAM."""
    err = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 1))
    if err != 0:
        raise UserError(
            f"could not pin {buffer.numel() / 2**30:.1f} GiB of host RAM for teacher_placement=offload "
            f"(cudaError {err}); free RAM, or set teacher_placement.resident_blocks to keep more blocks on the GPU"
        )
    weakref.finalize(buffer, torch.cuda.cudart().cudaHostUnregister, buffer.data_ptr())


def node_shared_buffer(name: str, nbytes: int, topology, fill) -> torch.Tensor:
    """One host buffer per node, shared by the node's ranks through a file in /dev/shm (RAM, not disk).

    The node's first rank creates and fills it while the others wait, then they map it; the file is
    unlinked once every rank holds it, so from then on the RAM goes back when the last rank exits, even
    after a crash. (Only a rank killed while filling it leaves `/dev/shm/wandistiller-*` behind.)
    """

    free = shutil.disk_usage(SHM).free
    if free < nbytes:  # every rank sees the same numbers, so every rank refuses alike
        raise UserError(
            f"teacher_placement.share_host_copy=true keeps one copy of the teacher per node in {SHM}, which has "
            f"{free / 2**30:.1f} GiB free of the {nbytes / 2**30:.1f} GiB needed: enlarge it (docker run "
            "--shm-size), or set teacher_placement.share_host_copy=false (one copy per rank)"
        )
    path = SHM / name
    owner = topology.local_rank == 0
    dist.barrier()  # everyone has checked the free space before the first byte is written
    if owner:
        path.unlink(missing_ok=True)  # a leftover of a killed run with the same name
        atexit.register(path.unlink, missing_ok=True)
        buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        fill(buffer)
    dist.barrier()
    if not owner:
        if not path.is_file() or path.stat().st_size != nbytes:  # from_file would create an empty one
            raise RuntimeError(f"{path} is missing or not {nbytes} bytes: the node's ranks disagree on the teacher")
        buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    dist.barrier()
    if owner:
        path.unlink(missing_ok=True)
    return buffer


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

    def __init__(
        self, blocks: nn.ModuleList, device: torch.device, source, streamed: list[int], layout: BlockLayout | None
    ):
        self.blocks, self.device, self.source, self.streamed = blocks, device, source, streamed
        self.next_of = {a: b for a, b in zip(streamed, streamed[1:] + streamed[:1])}
        # In backward blocks come last to first; the first streamed block prefetches none (a forward follows).
        self.prev_of = {b: a for a, b in zip(streamed, streamed[1:])}
        # Two device slots, each one flat buffer viewed as a block: the one computing and the one being filled
        # (none where every block stays resident: the streamer then only checkpoints a backward).
        nbytes = layout.nbytes if layout is not None else 0
        self.flat_slots = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2 if streamed else 0)]
        self.slots = [layout.views(flat) for flat in self.flat_slots] if layout is not None else []
        self.holds: list[int | None] = [None, None]  # which block each slot holds (or is receiving)
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        # Per slot, on a GPU: its copy done, its block's compute done (none on the CPU, which copies in line).
        self.copied = [torch.cuda.Event() for _ in range(2)] if self.cuda else []
        self.computed = [torch.cuda.Event() for _ in range(2)] if self.cuda else []
        self.reader = ThreadPoolExecutor(1) if isinstance(source, DiskSource) else None
        self.pending: dict[int, Future] = {}
        self.copy_events: list[tuple] = []  # (start, end) CUDA events of copies not yet counted
        self.copy_seconds = 0.0  # copy time already counted (CPU copies, and drained CUDA events)
        self.loads = 0  # blocks copied in so far
        for i in streamed:
            if BlockLayout.of(blocks[i]) != layout:
                raise ValueError(f"block {i} is shaped unlike block {streamed[0]}; blocks of one shape can stream")
            blocks[i].register_forward_pre_hook(lambda m, args, i=i: self._before(i))
            blocks[i].register_forward_hook(lambda m, args, out, i=i: self._after(i))
            for n, t in _block_tensors(blocks[i]).items():  # the host/disk copy is the only one now
                replace_tensor(blocks[i], n, torch.empty(0, dtype=t.dtype, device=device))
        # Each streamed block's parameters and buffers, looked up once: every forward re-points them at a slot.
        self.tensors = {i: list(_block_tensors(blocks[i]).items()) for i in streamed}
        self.index = {block: i for i, block in enumerate(blocks)}

    def _read_ahead(self, i: int) -> None:
        if self.reader is not None and i not in self.pending:
            self.pending[i] = self.reader.submit(self.source.fetch, i)

    def _host(self, i: int) -> torch.Tensor | dict[str, torch.Tensor]:
        if self.reader is not None:
            self._read_ahead(i)
            return self.pending.pop(i).result()
        return self.source.fetch(i)

    def _copy(self, host: torch.Tensor | dict[str, torch.Tensor], slot: int) -> None:
        if isinstance(host, torch.Tensor):  # a packed block: one copy
            self.flat_slots[slot].copy_(host, non_blocking=self.cuda)
        else:
            for n, t in self.slots[slot].items():
                t.copy_(host[n], non_blocking=self.cuda)

    def _load(self, i: int, slot: int) -> None:
        """Copy block i into `slot`: on the side stream, after the slot's previous block finished computing."""
        host = self._host(i)
        self.holds[slot] = i
        self.loads += 1
        if self.copy_stream is None:  # the CPU: copied in line
            began = time.perf_counter()
            self._copy(host, slot)
            self.copy_seconds += time.perf_counter() - began
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.computed[slot])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.copy_stream)
            self._copy(host, slot)
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
        self._bring(i, self.next_of[i])
        if self.next_of[i] != i:
            self._read_ahead(self.next_of[self.next_of[i]])

    def _bring(self, i: int, ahead: int | None) -> None:
        """Point block i's tensors at the slot that holds it (copying it in if none does), and start copying
        block `ahead` into the other slot while block i computes (unless it holds that one already)."""
        if i not in self.holds:  # the first block of the first forward: nobody prefetched it
            self._load(i, 0 if self.holds[0] is None else 1)
        slot = self.holds.index(i)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[slot])
        for n, t in self.tensors[i]:
            t.data = self.slots[slot][n]
        if ahead is not None and ahead != i and self.holds[1 - slot] != ahead:
            self._load(ahead, 1 - slot)  # prefetch while block i computes

    def _after(self, i: int) -> None:
        if self.cuda:
            self.computed[self.holds.index(i)].record(torch.cuda.current_stream(self.device))

    def checkpointed(self, block: nn.Module, *args, **kwargs):
        """A block's call where grad is on (the model's gradient-checkpointing function: without grad the model
        calls its blocks as before). Checkpointed (`Recomputed`) where a gradient passes through it: a streamed
        block because autograd would keep views of a slot that a later block overwrites; a resident one (the
        first `resident_blocks`) alike, so that a backward keeps one block's activations whatever stays resident."""
        i = self.index[block]
        held = held_adapters(block)
        trainable = [p for p in active_adapters(held) if p.requires_grad]
        flat, tree = tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        if not trainable and not any(t.requires_grad for t in tensors):
            return block(*args, **kwargs)  # nothing to backpropagate: autograd keeps nothing
        switch = held[0].switch if held else None
        call = BlockCall(self, i, block, tree, [TENSOR if isinstance(x, torch.Tensor) else x for x in flat], switch)
        return Recomputed.apply(call, len(tensors), *tensors, *trainable)

    def backward_block(self, i: int) -> None:
        """Stream block i in for its backward (a streamed one), the block before it prefetched."""
        if i not in self.tensors:
            return  # resident
        self._bring(i, self.prev_of.get(i))
        before = self.prev_of.get(i)
        if before is not None and before in self.prev_of:
            self._read_ahead(self.prev_of[before])


def active_adapters(held: list[LayerAdapters]) -> list[torch.Tensor]:
    """The A and B of the active adapter set (teacher/lora.py) in these layers, in their order; none when off."""
    found: list[torch.Tensor] = []
    for layer in held:
        k = layer.switch.active
        adapter = layer.sets[k] if k is not None and k < len(layer.sets) else None
        if adapter is not None:
            found += [adapter[0], adapter[1]]
    return found


TENSOR = object()  # a BlockCall's constant where the call had a tensor


@dataclass
class BlockCall:
    """What a checkpointed block call needs to run again: the streamer, the block and its index, the call's
    arguments apart from the tensors (`tree`, and `constants` at the non-tensor leaves), and its expert's adapter
    switch (None: no adapters on this block)."""

    streamer: BlockStreamer
    index: int
    block: nn.Module
    tree: TreeSpec
    constants: list
    switch: Switch | None

    def arguments(self, tensors) -> tuple[tuple, dict]:
        tensors, flat = iter(tensors), []
        for constant in self.constants:
            flat.append(next(tensors) if constant is TENSOR else constant)
        return tree_unflatten(flat, self.tree)


class Recomputed(torch.autograd.Function):
    """A streamed block under grad: the forward keeps its inputs alone (no tensor of a slot); the backward streams
    the block in again, recomputes it with the adapter set that was on in the forward (or none), under the
    forward's autocast (a frozen teacher in eval mode draws no random numbers), and returns the gradients of its
    inputs and of the adapters it used (inputs of this node, so DDP and torch.autograd.grad see them)."""

    @staticmethod
    def forward(ctx, call: BlockCall, count: int, *tensors):
        ctx.call, ctx.count, ctx.trainable = call, count, tensors[count:]
        ctx.active = call.switch.active if call.switch is not None else None
        ctx.autocast = [
            (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")
        ]
        ctx.autocast_cache = torch.is_autocast_cache_enabled()
        ctx.save_for_backward(*tensors[:count])
        args, kwargs = call.arguments(tensors[:count])
        return call.block(*args, **kwargs)  # its hooks stream it in (and out); no grad inside a Function

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        call.streamer.backward_block(call.index)
        switch = call.switch if call.switch is not None else Switch()
        now = switch.active
        try:
            switch.active = ctx.active
            with torch.enable_grad(), contextlib.ExitStack() as stack:
                for kind, enabled, dtype in ctx.autocast:
                    stack.enter_context(torch.amp.autocast(kind, dtype, enabled, ctx.autocast_cache))
                args, kwargs = call.arguments(inputs)
                out = call.block.forward(*args, **kwargs)  # not its hooks: streamed in above, nothing captured
        finally:
            switch.active = now
        outs = out if isinstance(out, tuple) else (out,)
        wanted = [t for t in inputs if t.requires_grad] + list(ctx.trainable)
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
        if call.index in call.streamer.tensors:
            call.streamer._after(call.index)  # its slot may be refilled once this backward has run
        return (None, None, *[next(got) if t.requires_grad else None for t in inputs], *got)


def stream_blocks(
    model: nn.Module,
    device: torch.device,
    source_kind: str,
    resident_blocks: int,
    disk: DiskSource | None = None,
    share: tuple[str, object] | None = None,
) -> BlockStreamer | None:
    """Keep the first `resident_blocks` blocks and everything outside the blocks on `device`; stream the rest.

    The model's blocks are either real (in RAM: the benchmark's random teacher) or on the meta device,
    to be read from the expert's files through `disk` (the placements, so RAM never holds the teacher
    twice). `host` packs the streamed blocks into one host buffer, pinned when `device` is a GPU and,
    with `share=(name, topology)`, one per node; `disk` reads them from the files as they are needed.
    """
    blocks = blocks_of(model)
    kept = min(resident_blocks, len(blocks))
    streamed = list(range(kept, len(blocks)))
    pin = device.type == "cuda"
    read_block = disk.fetch if disk is not None else (lambda i: _block_tensors(blocks[i]))
    for i in range(kept):
        for n, t in read_block(i).items():  # a copy: a tensor read from safetensors may map its file
            replace_tensor(blocks[i], n, t.to(device, copy=True))
    for name, child in model.named_children():
        if name != "blocks":
            child.to(device)
    for name, p in list(model.named_parameters(recurse=False)) + list(model.named_buffers(recurse=False)):
        replace_tensor(model, name, p.data.to(device))
    layout = BlockLayout.of(blocks[streamed[0]]) if streamed else None
    source: DiskSource | HostSource | None
    if layout is None:
        source = None  # every block resident: nothing streams, but a backward is still checkpointed per block
    elif source_kind == "disk":
        source = disk
    else:
        nbytes = layout.nbytes * len(streamed)
        fill = lambda buffer: pack_blocks(buffer, layout, streamed, read_block)
        if share is not None:  # the name says what it holds, so ranks that disagree fail instead of misreading
            buffer = node_shared_buffer(f"{share[0]}-{streamed[0]}-{nbytes}", nbytes, share[1], fill)
        else:  # page-aligned (an anonymous mapping), as page-locking wants it; torch.empty is 64-byte aligned
            buffer = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
            fill(buffer)
        if pin:
            pin_exactly(buffer)
        source = HostSource(buffer, layout, streamed)
    streamer = BlockStreamer(blocks, device, source, streamed, layout)
    # diffusers' hook for a checkpointing function, called for every block where grad is on (and only there).
    # Installed whatever stays resident, so a backward through an offload/disk teacher keeps one block's
    # activations, as the planner counts it (it kept all of them where every block fit: 8.3 GiB where 4.5 were
    # planned, a LoRA student at the 1.3B shape on an H100).
    cast("ModelMixin", model).enable_gradient_checkpointing(streamer.checkpointed)
    return streamer if streamed else None


def load_streamed_expert(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    source_kind: str,
    resident_blocks: int,
    share: tuple[str, object] | None = None,
    quantize: str | None = None,
    patch: Patch = (),
) -> tuple[nn.Module, BlockStreamer | None]:
    """One expert whose blocks stream to `device`, read from its files without ever holding the whole
    expert in RAM: `host` packs the streamed blocks into (pinned) RAM once; `disk` reads each block when
    it is needed, so the teacher may be larger than RAM. With `quantize="fp8"` the blocks' Linear layers
    are fp8 (wandistiller.teacher.fp8), quantized as each block is read: the streamers move fp8 bytes. `patch`: a
    fine-tuned teacher's LoRAs (teacher.lora), merged into every tensor as it is read (before any quantizing)."""

    disk = DiskSource(path, dtype, pin=device.type == "cuda" and source_kind == "disk")
    disk.patch = patch
    disk.work_device = device if device.type == "cuda" else None  # merges (and quantizes) there
    model = _skeleton_with_resident_weights(disk)
    if quantize:
        quantize_model(model, device=device)  # on the skeleton: layers of fp8 buffers, still on meta
        disk.fp8_layers = block_fp8_layers(model)
    streamer = stream_blocks(model, device, source_kind, resident_blocks, disk=disk, share=share)
    return freeze(model), streamer


def load_fp8_expert(path: Path, dtype: torch.dtype, device: torch.device, patch: Patch = ()) -> nn.Module:
    """A resident fp8 expert on `device`, read block by block and quantized as read: RAM holds the fp8
    teacher plus one bf16 block, never the bf16 teacher (a 14B expert: ~14.5 GB, not 28.6 + 14.5). `patch`: a
    fine-tuned teacher's LoRAs, merged before quantizing."""
    model, _ = load_streamed_expert(path, dtype, device, "host", resident_blocks=2**31, quantize="fp8", patch=patch)
    return model


def _skeleton_with_resident_weights(source: DiskSource) -> nn.Module:
    """The model with every weight on the meta device, then the non-block weights read from its files."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights():
        model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(source.folder))
    for name, p in list(model.named_parameters()):
        if name in source.weight_map and not name.startswith("blocks."):
            replace_tensor(model, name, source.read(name).clone())  # not a view of the mapped file
        else:
            replace_tensor(model, name, torch.empty_like(p, dtype=source.dtype_of(name), device="meta"))
    return model
