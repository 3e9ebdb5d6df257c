"""How a training rank gets its teacher targets: computed locally, or served by a teacher owner.

A step's inputs are a pure function of (seed, step, micro, data-parallel rank), so an owner rebuilds
every served rank's batch itself; only the targets travel. The owner runs the teacher on each rank's
batch separately -- the same shapes a local teacher would see -- so served targets are bitwise-equal
to local ones. Sends are point-to-point and ordered per (owner, rank) pair, so no tags are needed.

A method that calls the teacher at inputs the student makes (dmd: `Method.student_inputs`) cannot be
rebuilt from the seed: there the rank sends its inputs -- x_t, t and its prompt indices, from which the
owner looks up the cond/uncond embeddings, and an image-to-video teacher's image, it holds too (`TextFn`) -- and
the owner runs the teacher on
exactly those. The seed-rebuilt path (every other method) is untouched by this one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from wandistiller.core.distributed import Served
from wandistiller.data.batches import Batch
from wandistiller.teacher.image import ImageCondition
from wandistiller.teacher.model import Teacher

# (step, micro, dp_rank) -> that rank's batch
BatchFn = Callable[[int, int, int], Batch]
# prompt indices -> (cond, uncond, image) on the owner's teacher device: the text (and an image-to-video teacher's
# image, else None) of inputs a rank sent (None: the owner rebuilds whole batches from the seed with its BatchFn)
TextFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, ImageCondition | None]]
INPUT_DIMS = 5  # x_t's [B, C, F, H, W]: the header a rank sends before its inputs


def hidden_shape(teacher_config: dict, batch: Batch, layers: tuple[int, ...]) -> tuple[int, int, int, int]:
    """The teacher's stacked hidden states for `layers`: (layers, batch, tokens, width)."""
    pt, ph, pw = teacher_config["patch_size"]
    _, _, f, h, w = batch.x_t.shape
    width = teacher_config["num_attention_heads"] * teacher_config["attention_head_dim"]
    return (len(layers), batch.x_t.shape[0], (f // pt) * (h // ph) * (w // pw), width)


class LocalTargets:
    """This rank holds a teacher and computes its own targets."""

    skippable = True  # a step whose loss needs no teacher may skip `get`: no other rank waits for it

    def __init__(self, teacher: Teacher):
        self.teacher = teacher

    def get(self, step: int, micro: int, batch: Batch, layers: tuple[int, ...]):
        return self.teacher.targets(batch.x_t, batch.t, batch.cond, batch.uncond, layers, batch.image)

    def copy_ms(self) -> float | None:
        return self.teacher.copy_ms()

    def finish(self) -> None:
        pass


class WholeStepTargets(LocalTargets):
    """This rank's targets for all of a step's micro-batches from one teacher call, at the first of them.

    A streamed teacher (offload, disk) moves its weights once per forward, so at small micro-batches it
    is bound by copying; one call per step moves them once for `accum` micro-batches, and the larger
    batch hides the copies behind compute. The targets equal per-micro-batch ones to rounding (other
    batch shapes pick other kernels), not bit for bit.
    """

    def __init__(self, teacher: Teacher, batch_fn: BatchFn, dp_rank: int, accum: int):
        super().__init__(teacher)
        self.batch_fn, self.dp_rank, self.accum = batch_fn, dp_rank, accum
        self.step: int | None = None
        self.rows = 0
        self.target: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None

    def get(self, step: int, micro: int, batch: Batch, layers: tuple[int, ...]):
        if self.step != step:
            batches = [batch if m == micro else self.batch_fn(step, m, self.dp_rank) for m in range(self.accum)]
            x_t, t, cond, uncond = (
                torch.cat([getattr(b, k).to(batch.x_t.device) for b in batches]) for k in ("x_t", "t", "cond", "uncond")
            )
            image = ImageCondition.cat([b.image for b in batches])
            image = None if image is None else image.to(batch.x_t.device)
            self.target, self.hidden = self.teacher.targets(x_t, t, cond, uncond, layers, image)
            self.step, self.rows = step, len(batch.t)
        assert self.target is not None  # computed on this step's first micro-batch
        rows = slice(micro * self.rows, (micro + 1) * self.rows)
        return self.target[rows], None if self.hidden is None else self.hidden[:, rows]


class OwnerTargets(LocalTargets):
    """An owner that also trains: serves its node's other ranks, then computes its own targets."""

    skippable = False  # the served ranks wait for their targets every micro-batch

    def __init__(
        self,
        teacher: Teacher,
        served: list[Served],
        batch_fn: BatchFn,
        transfer: torch.device,
        text: TextFn | None = None,
    ):
        super().__init__(teacher)
        self.served, self.batch_fn, self.transfer, self.text = served, batch_fn, transfer, text
        self.in_flight: list = []

    def get(self, step: int, micro: int, batch: Batch, layers: tuple[int, ...]):
        self.finish()  # the previous micro-batch's sends are done before their buffers are dropped
        for s in self.served:
            if self.text is None:
                b = self.batch_fn(step, micro, s.dp_rank)
            else:  # the rank's own inputs (the student made them)
                b = receive_inputs(s.rank, self.transfer, self.text)
            self.in_flight += _send(self.teacher, b, s.rank, layers, self.transfer)
        return super().get(step, micro, batch, layers)

    def finish(self) -> None:
        for work, _ in self.in_flight:
            work.wait()
        self.in_flight = []


class RemoteTargets:
    """A rank without a teacher: receives its targets from its owner."""

    skippable = False  # the owner sends them whatever the loss: receive (and drop) them

    def __init__(self, owner: int, teacher_config: dict, transfer: torch.device, sends_inputs: bool = False):
        self.owner, self.teacher_config, self.transfer = owner, teacher_config, transfer
        self.sends_inputs = sends_inputs  # a method whose inputs the student makes: the owner cannot rebuild them

    def get(self, step: int, micro: int, batch: Batch, layers: tuple[int, ...]):
        if self.sends_inputs:
            send_inputs(batch, self.owner, self.transfer)
        target = torch.empty(batch.x_t.shape, dtype=torch.float32, device=self.transfer)
        dist.recv(target, src=self.owner)
        hidden = None
        if layers:
            hidden = torch.empty(
                hidden_shape(self.teacher_config, batch, layers), dtype=torch.float32, device=self.transfer
            )
            dist.recv(hidden, src=self.owner)
        return target, hidden

    def copy_ms(self) -> float | None:
        return None

    def finish(self) -> None:
        pass


def send_inputs(batch: Batch, owner: int, transfer: torch.device) -> None:
    """A rank's teacher inputs to its owner: x_t's shape, x_t and t (float32) and the prompt indices."""
    if batch.x_t.dim() != INPUT_DIMS:
        raise ValueError(f"x_t of shape {tuple(batch.x_t.shape)}: a served teacher takes [B, C, F, H, W]")
    header = torch.tensor(batch.x_t.shape, dtype=torch.int64)
    for tensor in (header, batch.x_t.float(), batch.t.float(), batch.prompt_idx.long()):
        dist.send(tensor.to(transfer).contiguous(), dst=owner)


def receive_inputs(src: int, transfer: torch.device, text: TextFn) -> Batch:
    """What `send_inputs` sent from rank `src`, as a batch with its text (and image) looked up here."""
    header = torch.empty(INPUT_DIMS, dtype=torch.int64, device=transfer)
    dist.recv(header, src=src)
    shape = [int(n) for n in header.tolist()]
    x_t = torch.empty(shape, dtype=torch.float32, device=transfer)
    t = torch.empty(shape[0], dtype=torch.float32, device=transfer)
    prompt_idx = torch.empty(shape[0], dtype=torch.int64, device=transfer)
    for tensor in (x_t, t, prompt_idx):
        dist.recv(tensor, src=src)
    cond, uncond, image = text(prompt_idx.cpu())
    return Batch(prompt_idx, x_t, t, cond, uncond, image=image)


def _send(teacher: Teacher, batch: Batch, dst: int, layers: tuple[int, ...], transfer: torch.device) -> list:
    target, hidden = teacher.targets(batch.x_t, batch.t, batch.cond, batch.uncond, layers, batch.image)
    sent = [target]
    if layers:
        assert hidden is not None, "the teacher returns hidden states for the layers asked"
        sent.append(hidden)
    tensors = [t.to(transfer).contiguous() for t in sent]
    # Keep each sent tensor referenced until its send completes.
    return [(dist.isend(t, dst=dst), t) for t in tensors]


def serve(
    teacher: Teacher,
    served: list[Served],
    batch_fn: BatchFn,
    steps: range,
    accum: int,
    layers: tuple[int, ...],
    transfer: torch.device,
    ahead: int = 1,
    text: TextFn | None = None,
) -> dict:
    """A dedicated owner's whole job: targets for every served rank, `ahead` steps before they are needed.

    While the students train step k the owner already computes step k+1; it blocks only when it is
    more than `ahead` steps in front. With `text` the ranks send their inputs (a method whose inputs the
    student makes): the owner then waits for each, and computes nothing ahead. Returns how much of its
    time it spent waiting (idle).
    """
    start, waited = time.perf_counter(), 0.0
    per_step: deque[list] = deque()
    for step in steps:
        sends = []
        for micro in range(accum):
            for s in served:
                if text is None:
                    batch = batch_fn(step, micro, s.dp_rank)
                else:
                    t0 = time.perf_counter()
                    batch = receive_inputs(s.rank, transfer, text)
                    waited += time.perf_counter() - t0
                sends += _send(teacher, batch, s.rank, layers, transfer)
        per_step.append(sends)
        while len(per_step) > ahead:
            t0 = time.perf_counter()
            for work, _ in per_step.popleft():
                work.wait()
            waited += time.perf_counter() - t0
    t0 = time.perf_counter()
    for sends in per_step:
        for work, _ in sends:
            work.wait()
    waited += time.perf_counter() - t0
    total = time.perf_counter() - start
    return {"owner_idle_fraction": waited / total if total else 0.0, "owner_wall_s": total}
