"""A pocket build's finished stages, kept under `--out`'s `.stages/` so a build stopped after hours (the video
teacher's is about 5 h on two cores) goes on from the stage it was in, and makes the same bytes as one unbroken.

Every stage is one call, `make = partial(function, *arguments)`, that seeds its own generators: what it makes is a
function of its arguments (the weights it starts from, its training data, its steps, seeds, learning rates and shapes)
and of the code alone. Saved (fp32 safetensors, exact) and read back, its weights are what the unbroken build would
hold. Each stage's folder is named for a digest of everything before it and of the call itself: the training code
(SOURCES, read as the build starts, and the stage function's running code) and library versions, the part's origin,
every earlier stage's call, this one's arguments as the function receives them (its defaults included, tensors and
models by their bytes), and the kind of CPU it ran on. So no setting is copied beside the code that uses it: a stage
saved under other code, data, settings or CPU is never taken; it is remade. A build's stages are removed when it ends
with every part it asked for written (pocket/build.build_parts).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import inspect
import json
import logging
import os
import platform
import shutil
import types
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
from safetensors.torch import load_file

log = logging.getLogger("wandistiller.pocket")
STAGES_DIR = ".stages"
# What a stage's weights follow from besides its settings and inputs: the package's training arithmetic (these
# modules: the objectives, the rendered clips the VAE trains on, the sigma shift, the shapes, the I2V conditioning)
# and the digits it renders.
# Not pocket/build.py, whose stage functions' running code and arguments go into each stage's key (`_call`): an edit
# elsewhere in it (its command line) leaves a 5-hour build's stages good.
SOURCES = (
    "pocket/train.py",
    "pocket/video.py",
    "pocket/clips.py",
    "pocket/digits.py",
    "pocket/i2v.py",
    "data/batches.py",
    "core/arch.py",
    "teacher/vae.py",
    "teacher/image.py",
    "assets/pocket/digits.csv.gz",  # the digits every clip and image is rendered from (the VAE stages render their own)
)
# The float kernels a stage's arithmetic ran on: torch and oneDNN pick them by instruction set (and these variables),
# and the same stage trains other bytes under each (docs/QUALITY.md). A stage made on another kind of CPU, or a shared
# --out resumed on another host, is trained again rather than mixed into this one's build.
_KERNEL_SETTINGS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA")

Model = TypeVar("Model")


def _cpu() -> str:
    """The CPU's model name, its instruction set as torch uses it, and the variables that change the kernels."""
    try:
        model = next(
            (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), ""
        )
    except OSError:  # not Linux
        model = platform.processor()
    settings = {name: os.environ.get(name) for name in _KERNEL_SETTINGS}
    return f"{model}|{torch.backends.cpu.get_cpu_capability()}|{settings}"


def _files_digest(root: Path, paths) -> str:
    """The files' names (from `root`) and bytes, in the order given."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _sources_digest() -> str:
    """Read once a process, at the build's start (`Stages` of its first part): a file edited while a build runs hours
    later keys its later stages as the code that trained them, not as the edit."""
    root = Path(__file__).resolve().parents[1]
    return _files_digest(root, (path for pattern in SOURCES for path in sorted(root.glob(pattern))))


def folder_digest(folder: Path) -> str:
    """Every file of a built folder (the teacher a part starts from), names and bytes."""
    return _files_digest(folder, sorted(p for p in folder.rglob("*") if p.is_file()))


class Stages:
    """One part's stages (`image`, `video`, `i2v`) under `out/.stages/<part>`, chained: `origin` names what the part
    starts from (a digest of the teacher folder it grows from)."""

    def __init__(self, out: Path, part: str, origin: str = "") -> None:
        import diffusers

        self.folder = out / STAGES_DIR / part
        self.resumed: list[str] = []
        versions = (torch.__version__, diffusers.__version__)
        self._key = self._next("", part, origin, _sources_digest(), *versions, _cpu(), torch.get_num_threads())

    @staticmethod
    def _next(key: str, *parts: object) -> str:
        digest = hashlib.sha256(key.encode())
        for part in parts:
            _digest_into(digest, part)
            digest.update(b"\0")
        return digest.hexdigest()

    def __call__(self, name: str, make: partial[Model], load: Callable[[Path], Model]) -> Model:
        """The stage's weights: read back where this very call was saved, else made by `make()` and saved (whole or
        not at all: a build killed while saving leaves no stage to resume from). `load` reads a saved one."""
        self._key = self._next(self._key, name, *_call(make))
        path = self.folder / f"{name}-{self._key[:16]}"
        if (path / "config.json").is_file():
            try:
                model = load(path)
            except Exception as e:  # a damaged stage (a disk's fault: they are written whole) is trained again
                log.warning("stage %s: %s unreadable (%s); training it again", name, path, str(e).splitlines()[0])
            else:
                log.info("stage %s: resumed from %s", name, path)
                self.resumed.append(name)
                return model
        model = make()
        unfinished = path.with_name(path.name + ".partial")
        shutil.rmtree(unfinished, ignore_errors=True)
        model.save_pretrained(unfinished, safe_serialization=True)  # type: ignore[attr-defined]
        _synced(unfinished)  # on disk before it is named a stage: a stage kept across a power cut is whole
        shutil.rmtree(path, ignore_errors=True)  # a folder of this name without its config: not a saved stage
        os.replace(unfinished, path)
        _synced(path.parent)
        return model


def _call(make: partial) -> tuple:
    """What a stage's weights follow from besides SOURCES: its function's name and running code, and every argument as
    the function receives it (its defaults too, so an unchanged call to a function whose default changed is a new
    one)."""
    function = make.func
    bound = inspect.signature(function).bind(*make.args, **make.keywords)
    bound.apply_defaults()
    # not its __module__: `python -m wandistiller.pocket.build` runs the build's own functions as __main__'s
    return (function.__qualname__, _code(function.__code__, function.__doc__), *bound.arguments.items())


def _code(code: types.CodeType, doc: str | None = None) -> tuple:
    """A function's code as it runs: its bytecode, the names it reads and its constants (nested functions' too), not
    its docstring or line numbers. Not its file, which may have been edited since the build started hours ago."""
    consts = [c for c in code.co_consts if not (doc is not None and c is doc)]
    return (
        code.co_code,
        code.co_names,
        tuple(_code(c) if isinstance(c, types.CodeType) else sorted(map(repr, c)) if isinstance(c, frozenset) else c
              for c in consts),
    )  # fmt: skip


def _digest_into(digest, part: object) -> None:
    """`part` into `digest`: a tensor by its bytes, a model by its class, config and weights, a mapping or a sequence
    part by part, anything else by its repr (numbers, strings, bytes)."""
    if isinstance(part, torch.Tensor):
        part = part.detach().contiguous().reshape(-1)  # a 0-dim tensor has no byte view of its own
        digest.update(f"{part.dtype}{tuple(part.shape)}".encode())
        digest.update(part.view(torch.uint8).numpy())
    elif isinstance(part, torch.nn.Module):
        # as its config.json holds it (a tuple read back is a list), without the keys that name a path or version
        config = {k: v for k, v in dict(getattr(part, "config", {})).items() if not k.startswith("_")}
        digest.update(type(part).__qualname__.encode() + json.dumps(config, sort_keys=True, default=str).encode())
        _digest_into(digest, part.state_dict())
    elif isinstance(part, Mapping):
        for key, value in part.items():
            _digest_into(digest, (key, value))
    elif isinstance(part, (list, tuple)):  # part by part, however deep (a repr would shorten a long tensor)
        digest.update(type(part).__name__.encode())
        for value in part:
            _digest_into(digest, value)
    else:
        digest.update(repr(part).encode())
    digest.update(b"\1")


# What a file system that cannot flush a folder's entries answers (SMB/CIFS, some FUSE and Ceph mounts): its files
# are still flushed, and a build there must still be able to keep its stages.
NO_FOLDER_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


def _synced(folder: Path) -> None:
    """`folder`'s files and its entries flushed to disk (the entries where the file system can)."""
    for path in [*(p for p in folder.iterdir() if p.is_file()), folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as e:
            if path is not folder or e.errno not in NO_FOLDER_FSYNC:
                raise
        finally:
            os.close(fd)


def clear_stages(out: Path, parts: list[str]) -> None:
    """The parts' folders are written: their stages go (another part's, a build stopped earlier, are kept)."""
    for part in parts:
        shutil.rmtree(out / STAGES_DIR / part, ignore_errors=True)
    with contextlib.suppress(OSError):  # not empty: another part's stages
        (out / STAGES_DIR).rmdir()


def read_model(cls, folder: Path):
    """A diffusers model class's folder (config + safetensors) read back exactly, frozen as the training functions
    return it. Built from its config, not `from_pretrained`, which records the folder's path in the config the next
    folder is saved with: the shipped I2V teachers' VAE config named a build machine's /tmp, and a stage's path made
    a resumed build's bytes differ from an unbroken one's."""
    model = cls.from_config(cls.load_config(folder))
    model.load_state_dict(load_file(folder / "diffusion_pytorch_model.safetensors"), strict=True)
    return model.eval().requires_grad_(False)


def loader(cls) -> Callable[[Path], object]:
    """`read_model` for one class: how a stage of it is read back."""
    return partial(read_model, cls)
