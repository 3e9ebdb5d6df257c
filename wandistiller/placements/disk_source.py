"""The `disk` placement's source: an expert's tensors read from its safetensors files, memory-mapped,
and the copy of a teacher stored wider than it computes, converted once into `offload_dir`."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from wandistiller.core import leftovers
from wandistiller.core.errors import UserError
from wandistiller.teacher.finetune import Patch, patch_tensor
from wandistiller.teacher.fp8 import E4M3, quantize_block_tensors

# converted_copy's temporary folders: `<teacher>-<dtype>-<12 hex>.partial`, then `-<host>-<pid>`.
PARTIAL = r".+-[a-z0-9]+-[0-9a-f]{12}\.partial"


class DiskSource:
    """An expert's tensors read on demand from its safetensors files (memory-mapped), each in the dtype the
    teacher computes it in: `dtype`, or float32 for the modules diffusers keeps in float32."""

    def __init__(self, folder: Path, dtype: torch.dtype, pin: bool = False, fp8_layers: frozenset[str] = frozenset()):
        from diffusers import WanTransformer3DModel

        index_file = folder / "diffusion_pytorch_model.safetensors.index.json"
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
        else:
            weight_map = {
                k: "diffusion_pytorch_model.safetensors" for k in _keys(folder / "diffusion_pytorch_model.safetensors")
            }
        self.files = {name: safe_open(folder / name, framework="pt") for name in set(weight_map.values())}
        self.folder, self.weight_map, self.dtype, self.pin = folder, weight_map, dtype, pin
        # A block's layers computed in fp8 (wandistiller.teacher.fp8): their weights are quantized as they are read.
        self.fp8_layers = fp8_layers
        self.work_device: torch.device | None = None  # where to quantize (a GPU: seconds for a 14B expert)
        # A fine-tuned teacher's LoRAs (teacher.lora: teacher/finetune.py), merged into each tensor as it is read.
        self.patch: Patch = ()
        self.keep_fp32 = set(WanTransformer3DModel._keep_in_fp32_modules or [])
        self.block_keys: dict[int, list[str]] = {}  # block index -> its keys
        for key in weight_map:
            if key.startswith("blocks."):
                self.block_keys.setdefault(int(key.split(".")[1]), []).append(key)

    def dtype_of(self, name: str) -> torch.dtype:
        return torch.float32 if any(part in self.keep_fp32 for part in name.split(".")) else self.dtype

    def read(self, key: str) -> torch.Tensor:
        t = self.files[self.weight_map[key]].get_tensor(key)
        if t.dtype == E4M3 or key.endswith(".weight_scale"):  # a converted fp8 copy: stored as computed
            return t
        if self.patch:  # merged in float32 before the cast, on the work device where there is one
            t = patch_tensor(key, t, self.patch, self.work_device)
        return t.to(self.dtype_of(key))

    def fetch(self, i: int) -> dict[str, torch.Tensor]:
        """Block i's tensors by their names inside the block, fp8 layers quantized (pinned when streaming
        to a GPU)."""
        start = len(f"blocks.{i}.")
        tensors = {key[start:]: self.read(key) for key in self.block_keys[i]}
        out = quantize_block_tensors(tensors, self.fp8_layers, self.work_device)
        return {n: t.pin_memory() for n, t in out.items()} if self.pin else out

    def stored_as_computed(self) -> bool:
        """Whether the files already hold every tensor in the dtype it computes in (read from headers)."""
        names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
        return all(
            self.files[file].get_slice(key).get_dtype() == names[self.dtype_of(key)]
            for key, file in self.weight_map.items()
        )


def converted_copy(
    folder: Path, dtype: torch.dtype, offload_dir: str | None, topology, fp8_layers: frozenset[str] = frozenset()
) -> Path:
    """The folder `disk` streams from: the expert's own, or a copy in `offload_dir` already in `dtype`.

    Wan's Hub checkpoints are stored in float32; streaming them into a bf16 teacher would read twice the
    bytes from disk and convert every block on every forward. The copy is written once (by the node's
    first rank, block by block, so RAM holds one block) and reused by later runs. With `fp8_layers` the
    copy holds those layers' fp8 weights and scales (half the bytes again, and no quantizing per forward).
    """

    source = DiskSource(folder, dtype, fp8_layers=fp8_layers)
    if offload_dir is None or (source.stored_as_computed() and not fp8_layers):
        return folder
    files = sorted(folder.glob("*.safetensors"))
    stamp = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = hashlib.sha1(repr((str(folder.resolve()), stamp, str(dtype), sorted(fp8_layers))).encode()).hexdigest()[:12]
    dtype_name = str(dtype).split(".")[-1] + ("_fp8" if fp8_layers else "")
    target = Path(offload_dir).expanduser() / f"{folder.name}-{dtype_name}-{key}"
    if topology.local_rank == 0 and not target.is_dir():
        # A killed conversion leaves tens of GB behind: remove those whose writer is gone.
        leftovers.remove_dead(target.parent, PARTIAL)
        needed = sum(f.stat().st_size for f in files)  # at most the stored size: the copy is never wider
        where = f"teacher_placement.offload_dir={offload_dir}"
        try:
            partial = target.with_name(leftovers.owned_name(f"{target.name}.partial"))
            partial.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(partial).free
        except OSError as e:
            raise UserError(
                f"{where} cannot be written ({e.strerror}); disk converts the teacher to {dtype_name} there once: "
                "point it at a writable folder"
            ) from None
        if free < needed:
            shutil.rmtree(partial, ignore_errors=True)
            raise UserError(
                f"{where} has {free / 2**30:.1f} GiB free and the {dtype_name} copy of {folder} needs up to "
                f"{needed / 2**30:.1f} GiB: point it at a larger disk"
            )
        # One file per block, one for the rest: RAM holds one block's tensors at a time.
        weight_map: dict[str, str] = {}
        for file, read in _groups(source):
            tensors = {name: t.contiguous() for name, t in read().items()}
            save_file(tensors, partial / file)
            weight_map |= dict.fromkeys(tensors, file)
        index = {"metadata": {"converted_from": str(folder)}, "weight_map": weight_map}
        (partial / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        shutil.copy(folder / "config.json", partial / "config.json")
        try:
            partial.rename(target)
        except OSError:  # another job finished the same copy first
            shutil.rmtree(partial, ignore_errors=True)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return target


def _groups(source: DiskSource):
    """(file name, a function reading its tensors by full name): one file per block (as `fetch` gives it,
    fp8 layers quantized), one for the rest."""
    for i in sorted(source.block_keys):
        yield f"blocks-{i:03d}.safetensors", lambda i=i: {f"blocks.{i}.{n}": t for n, t in source.fetch(i).items()}
    rest = [k for k in source.weight_map if not k.startswith("blocks.")]
    yield "rest.safetensors", lambda: {name: source.read(name) for name in rest}


def _keys(file: Path) -> list[str]:

    with safe_open(file, framework="pt") as f:
        return list(f.keys())
