"""Teacher placements: where the teacher's weights live, and who runs it for whom.

One small class per placement, each named by `_target_` in `conf/teacher_placement/<name>.yaml`,
behind one interface:

    name                       the option's name (what the planner and reports call it)
    serving                    "local" (every rank runs its own teacher), "node_owner" (one rank per
                               node runs it and also trains) or "dedicated_owner" (one rank per node
                               only runs the teacher; the others train)
    check(precision, world)    refuse early, before any weights load or download, naming a fix
    teacher_device(topology)   where inputs go (and targets come from)
    load(spec, teacher_cfg, precision, topology) -> Teacher
"""

from __future__ import annotations

import torch

from wandistiller.distributed import Topology
from wandistiller.errors import UserError
from wandistiller.precision import Precision
from wandistiller.teacher import Teacher, TeacherSpec, load_expert


def guidance_scales(spec: TeacherSpec, teacher_cfg) -> list[float]:
    """The CFG scale per expert; the low-noise expert falls back to the main scale, as WanPipeline does."""
    scales = [teacher_cfg.guidance_scale]
    if len(spec.experts) == 2:
        scale_2 = teacher_cfg.guidance_scale_2
        scales.append(teacher_cfg.guidance_scale if scale_2 is None else scale_2)
    return scales


def load_teacher(spec: TeacherSpec, teacher_cfg, dtype: torch.dtype, device: torch.device, **load_kwargs) -> Teacher:
    experts = [load_expert(spec, name, dtype, **load_kwargs) for name in spec.experts]
    if "device_map" not in load_kwargs:
        experts = [e.to(device) for e in experts]
    return Teacher(spec, experts, guidance_scales(spec, teacher_cfg), device)


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class CpuPlacement:
    """One teacher per node in CPU RAM, computing on the CPU, serving the node's ranks."""

    name, serving, compilable = "cpu", "node_owner", True

    def __init__(self, **_: object):
        pass

    def check(self, precision: Precision, world) -> None:
        if precision.teacher_dtype == torch.float16:
            raise UserError("teacher_placement=cpu cannot run an fp16 teacher; use precision=bf16 or precision=fp32")

    def teacher_device(self, topology: Topology) -> torch.device:
        return torch.device("cpu")

    def load(self, spec: TeacherSpec, teacher_cfg, precision: Precision, topology: Topology) -> Teacher:
        return load_teacher(spec, teacher_cfg, precision.teacher_dtype, self.teacher_device(topology))


class GpuPlacement:
    """A full teacher on every rank's own GPU, loaded straight onto it."""

    name, serving, compilable = "gpu", "local", True

    def __init__(self, **_: object):
        pass

    def check(self, precision: Precision, world) -> None:
        if _gpus() == 0:
            raise UserError("teacher_placement=gpu needs a CUDA GPU and none is visible; use teacher_placement=cpu")

    def teacher_device(self, topology: Topology) -> torch.device:
        return torch.device("cuda", topology.local_rank % _gpus())

    def load(self, spec: TeacherSpec, teacher_cfg, precision: Precision, topology: Topology) -> Teacher:
        device = self.teacher_device(topology)
        return load_teacher(spec, teacher_cfg, precision.teacher_dtype, device, device_map=str(device))


class Gpu0Placement:
    """The teacher on GPU 0 in a dedicated process; students train on GPUs 1..n.

    The owner computes step k+1's targets while the students train step k. With `train_on_owner`
    the owner trains too (on GPU 0, beside the teacher) and serves synchronously.
    `debug_cpu` keeps this process layout but puts the teacher on the CPU (tests, dry runs).
    """

    name, compilable = "gpu0", True

    def __init__(self, train_on_owner: bool = False, debug_cpu: bool = False, **_: object):
        self.train_on_owner, self.debug_cpu = train_on_owner, debug_cpu
        self.serving = "node_owner" if train_on_owner else "dedicated_owner"

    def check(self, precision: Precision, world) -> None:
        if not self.train_on_owner and world.nproc_per_node < 2:
            raise UserError(
                "teacher_placement=gpu0 runs the teacher in its own process: set distributed.nproc_per_node to "
                "1 + the number of student GPUs (or teacher_placement.train_on_owner=true)"
            )
        if self.debug_cpu:
            return
        if _gpus() < 2:
            other = "gpu" if _gpus() == 1 else "cpu"
            raise UserError(
                f"teacher_placement=gpu0 needs 2 or more GPUs (teacher on GPU 0, students on 1..n) and this machine "
                f"has {_gpus()}; use teacher_placement={other}"
            )

    def teacher_device(self, topology: Topology) -> torch.device:
        return torch.device("cpu") if self.debug_cpu else torch.device("cuda", 0)

    def load(self, spec: TeacherSpec, teacher_cfg, precision: Precision, topology: Topology) -> Teacher:
        device = self.teacher_device(topology)
        kwargs = {} if self.debug_cpu else {"device_map": str(device)}
        return load_teacher(spec, teacher_cfg, precision.teacher_dtype, device, **kwargs)


class DeviceMapPlacement:
    """One teacher per node spread over the node's GPUs by accelerate, owned by the node's first rank.

    `strategy` is "balanced", "sequential" or a module->device dict (`device_map`). Only the owner
    loads it, so N ranks make one spread copy, not N (a plain device_map under torchrun loads N).
    """

    serving, compilable = "node_owner", False  # accelerate's cross-device hooks and dynamo: not tried

    def __init__(self, strategy="balanced", max_memory=None, debug_cpu: bool = False, **_: object):
        self.strategy, self.max_memory, self.debug_cpu = strategy, max_memory, debug_cpu
        self.name = strategy if isinstance(strategy, str) else "device_map"

    def check(self, precision: Precision, world) -> None:
        if not self.debug_cpu and _gpus() == 0:
            raise UserError(
                f"teacher_placement={self.name} spreads the teacher over GPUs and none is visible; "
                "use teacher_placement=cpu"
            )

    def teacher_device(self, topology: Topology) -> torch.device:
        return torch.device("cpu") if self.debug_cpu else torch.device("cuda", topology.local_rank % _gpus())

    def load(self, spec: TeacherSpec, teacher_cfg, precision: Precision, topology: Topology) -> Teacher:
        device = self.teacher_device(topology)
        if self.debug_cpu:
            return load_teacher(spec, teacher_cfg, precision.teacher_dtype, device)
        strategy = self.strategy if isinstance(self.strategy, str) else dict(self.strategy)
        max_memory = {int(k) if str(k).isdigit() else k: v for k, v in (self.max_memory or {}).items()} or None
        teacher = load_teacher(
            spec, teacher_cfg, precision.teacher_dtype, device, device_map=strategy, max_memory=max_memory
        )
        # Inputs go where the first layer lives; accelerate's hooks carry activations across GPUs.
        teacher.device = teacher.experts[0].patch_embedding.weight.device
        return teacher


class StreamPlacement:
    """Teacher weights outside the compute device, streamed in block by block, one block ahead.

    `offload`: weights in pinned host RAM, computing on this rank's GPU; with `share_host_copy` the ranks
    of a node share one pinned copy (through /dev/shm). `disk`: weights stay in the safetensors files
    (memory-mapped) and stream from there, for teachers larger than RAM; on a machine without a GPU it
    computes on the CPU. The first `resident_blocks` blocks stay on the device (a run gets the planner's
    count of what fits beside the student; "auto" without a plan: what the free memory holds).
    """

    serving, compilable = "local", True  # compile_blocks leaves the streamer's hooks eager

    def __init__(
        self,
        source: str = "host",
        resident_blocks="auto",
        share_host_copy: bool = True,
        offload_dir: str | None = None,
        **_: object,
    ):
        self.source, self.resident_blocks, self.share_host_copy = source, resident_blocks, share_host_copy
        self.offload_dir = offload_dir
        self.name = {"host": "offload", "disk": "disk"}[source]

    def check(self, precision: Precision, world) -> None:
        if self.source == "host" and _gpus() == 0:
            raise UserError(
                "teacher_placement=offload streams the teacher from RAM to a GPU and none is visible; "
                "use teacher_placement=cpu (the same RAM, computing on the CPU)"
            )
        if self.resident_blocks != "auto" and (not str(self.resident_blocks).isdigit()):
            raise UserError(f"teacher_placement.resident_blocks={self.resident_blocks!r}: use auto or a count >= 0")

    def teacher_device(self, topology: Topology) -> torch.device:
        return torch.device("cuda", topology.local_rank % _gpus()) if _gpus() else torch.device("cpu")

    def load(self, spec: TeacherSpec, teacher_cfg, precision: Precision, topology: Topology) -> Teacher:
        import os

        from wandistiller.streaming import converted_copy, load_streamed_expert

        device = self.teacher_device(topology)
        experts, streamers = [], []
        for name in spec.experts:
            folder = spec.path / name
            if self.source == "disk" and not all(os.access(f, os.R_OK) for f in folder.glob("*.safetensors")):
                raise UserError(
                    f"teacher_placement=disk reads {folder} while training and cannot: make its "
                    "*.safetensors readable, or use teacher_placement=offload"
                )
            if self.source == "disk":
                folder = converted_copy(folder, precision.teacher_dtype, self.offload_dir, topology)
            expert, streamer = load_streamed_expert(
                folder,
                precision.teacher_dtype,
                device,
                self.source,
                self._resident(spec, precision, device),
                share=self._share(folder, topology),
            )
            experts.append(expert)
            streamers += [streamer] if streamer is not None else []
        teacher = Teacher(spec, experts, guidance_scales(spec, teacher_cfg), device)
        teacher.streamers = streamers
        return teacher

    def _share(self, folder, topology: Topology) -> tuple[str, Topology] | None:
        """(a name the node's ranks agree on, topology) when they should share one host copy, else None."""
        import hashlib
        import os

        if self.source != "host" or not self.share_host_copy or topology.local_world_size < 2:
            return None
        job = ":".join(os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"))
        return f"wandistiller-{hashlib.sha1(f'{job}:{folder}'.encode()).hexdigest()[:16]}", topology

    def _resident(self, spec: TeacherSpec, precision: Precision, device: torch.device) -> int:
        if self.resident_blocks != "auto":
            return int(self.resident_blocks)
        if device.type != "cuda":
            return 0
        from wandistiller.plan import resident_blocks

        free, _ = torch.cuda.mem_get_info(device)
        return resident_blocks(spec.transformer_config, len(spec.experts), precision.teacher_dtype, free)


class ShardedPlacement:
    """The frozen teacher sharded across all ranks with FSDP2 (`fully_shard`, one unit per block); each
    rank runs its own batch, all-gathering each block's weights as it goes.

    Loading is staggered rank by rank on a node, so host RAM holds one full copy at a time, and each
    block moves to the device on its own, so a GPU never holds more than one full block plus its shards.
    Every rank must run the same forwards (they are collectives): `Teacher.collective` makes sure.
    """

    name, serving, collective, compilable = "sharded", "local", True, False

    def __init__(self, **_: object):
        pass

    def check(self, precision: Precision, world) -> None:
        if world.nproc_per_node * world.nnodes < 2:
            raise UserError(
                "teacher_placement=sharded splits the teacher over ranks: set distributed.nproc_per_node "
                "to 2 or more (or use teacher_placement=gpu, offload or cpu for one process)"
            )

    def teacher_device(self, topology: Topology) -> torch.device:
        return torch.device("cuda", topology.local_rank % _gpus()) if _gpus() else torch.device("cpu")

    def load(self, spec: TeacherSpec, teacher_cfg, precision: Precision, topology: Topology) -> Teacher:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        device = self.teacher_device(topology)
        mesh = init_device_mesh(device.type, (topology.world_size,))
        experts = []
        for name in spec.experts:
            for turn in range(topology.local_world_size):
                if turn == topology.local_rank:
                    expert = load_expert(spec, name, precision.teacher_dtype)  # on the CPU
                    for block in expert.blocks:
                        fully_shard(block, mesh=mesh)
                    fully_shard(expert, mesh=mesh)
                    experts.append(expert)
                dist.barrier()
        teacher = Teacher(spec, experts, guidance_scales(spec, teacher_cfg), device)
        teacher.collective = True
        return teacher


class AutoPlacement:
    """Resolved by the planner (`wandistiller.plan`) into the fastest placement that fits."""

    name, serving, compilable = "auto", None, True

    def __init__(self, **_: object):
        pass
