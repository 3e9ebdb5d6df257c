"""A pocket build's finished stages, kept under `--out`'s `.stages/` so a build stopped after hours (the video
teacher's is about 5 h on two cores) goes on from the stage it was in, and makes the same bytes as one unbroken.

Every stage seeds its own generators and starts from the weights the last one returned, so what a stage makes is
a function of those weights, its inputs and its settings alone: saved (fp32 safetensors, exact) and read back, they
are what the unbroken build would hold. Each stage's folder is named for a digest of everything before it: the
training code and library versions, the weights the part started from, its training data, and every earlier stage's
settings (its steps, seeds, learning rates, shapes).
A stage saved under other code, data or settings is never taken; it is remade. The stages are removed once every
part the build was asked for is written.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
from safetensors.torch import load_file

log = logging.getLogger("wandistiller.pocket")
STAGES_DIR = ".stages"
# What a stage's weights follow from besides its settings and inputs: the package's training arithmetic (these
# modules: the objectives, the rendered clips the VAE trains on, the sigma shift, the shapes, the I2V conditioning).
# Not pocket/build.py, whose every number a stage's weights follow from goes into that stage's settings: an edit
# of the build's command line leaves a 5-hour build's stages good.
_SOURCES = (
    "pocket/train.py",
    "pocket/video.py",
    "pocket/clips.py",
    "pocket/digits.py",
    "pocket/i2v.py",
    "data/batches.py",
    "core/arch.py",
    "teacher/vae.py",
    "teacher/image.py",
)

Model = TypeVar("Model")


def _code_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for pattern in _SOURCES:
        for path in sorted(root.glob(pattern)):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def folder_digest(folder: Path) -> str:
    """Every file of a built folder (the teacher a part starts from), names and bytes."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


class Stages:
    """One part's stages (`image`, `video`, `i2v`) under `out/.stages/<part>`, chained: `origin` names what the part
    starts from (a digest of the teacher folder it grows from)."""

    def __init__(self, out: Path, part: str, origin: str = "") -> None:
        import diffusers

        self.folder = out / STAGES_DIR / part
        self.resumed: list[str] = []
        self._key = self._next("", part, origin, _code_digest(), torch.__version__, diffusers.__version__)

    @staticmethod
    def _next(key: str, *parts: object) -> str:
        digest = hashlib.sha256(key.encode())
        for part in parts:
            if isinstance(part, torch.Tensor):
                part = part.detach().contiguous()
                digest.update(f"{part.dtype}{tuple(part.shape)}".encode() + part.view(torch.uint8).numpy().tobytes())
            else:
                digest.update(repr(part).encode())
            digest.update(b"\0")
        return digest.hexdigest()

    def feed(self, *tensors: torch.Tensor | None) -> None:
        """Mix what the following stages train on into the chain (latents, text states, an I2V condition)."""
        self._key = self._next(self._key, *(t if t is not None else "none" for t in tensors))

    def __call__(self, name: str, settings: object, make: Callable[[], Model], load: Callable[[Path], Model]) -> Model:
        """The stage's weights: read back where this very stage was saved, else made by `make()` and saved (whole or
        not at all: a build killed while saving leaves no stage to resume from). `load` reads a saved one."""
        self._key = self._next(self._key, name, settings)
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
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial, safe_serialization=True)  # type: ignore[attr-defined]
        shutil.rmtree(path, ignore_errors=True)  # a folder of this name without its config: not a saved stage
        os.replace(partial, path)
        return model


def clear_stages(out: Path) -> None:
    """The build's folders are written: its stages go."""
    shutil.rmtree(out / STAGES_DIR, ignore_errors=True)


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
