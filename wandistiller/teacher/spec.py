"""The teacher's folder: find it (local, built-in, or fetched from the Hub), check it, and read its shape
(`TeacherSpec`) from its JSON and safetensors headers alone, before any weights load; `loading` turns what
the checks could not see into one line when a component loads. The runtime teacher: teacher/model.py.

One code path for every teacher: a Hub id is first fetched into the local cache by diffusers, then
every teacher -- the embedded tiny one included -- is a local diffusers-format folder loaded with
`from_pretrained(..., use_safetensors=True)`. No remote code.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from wandistiller.core.arch import Layout, json_kind, wan_config_problem
from wandistiller.core.errors import UserError, quieted
from wandistiller.core.tensor_files import safetensors_problem
from wandistiller.teacher.tiny import BUILTINS, ensure_tiny_teacher

NUM_TRAIN_TIMESTEPS = 1000


@dataclass(frozen=True)
class TeacherSpec:
    """What the folder says about the teacher, read from JSON files only (no weights)."""

    path: Path
    experts: tuple[str, ...]  # ("transformer",) or ("transformer", "transformer_2")
    transformer_config: dict = field(hash=False)
    boundary_ratio: float | None
    flow_shift: float
    num_train_timesteps: int
    # teacher.lora, checked (teacher/finetune.py's TeacherLora): merged into the experts wherever they load.
    loras: tuple = ()
    # What the experts take besides noise and text, read off the folder's configs (`folder_layout`).
    layout: Layout = Layout.t2v
    # Wan 2.1 I2V's CLIP vision tower (image_encoder/ + image_processor/): its image tokens feed every block.
    image_encoder: bool = False

    @property
    def latent_channels(self) -> int:
        """The channels of the latents the experts denoise (16, or TI2V's 48): their output, not their input
        (an I2V expert's 36 are these, a mask and the image's latents)."""
        c = self.transformer_config
        return int(c.get("out_channels") or c["in_channels"])

    @property
    def boundary_timestep(self) -> float | None:
        return None if self.boundary_ratio is None else self.boundary_ratio * self.num_train_timesteps


def builtin_teacher(teacher_cfg, cache_dir) -> str | None:
    """The embedded teacher to build (a name in teacher/tiny.py's BUILTINS), or None. `teacher.builtin` applies only
    to a path in the cache's teachers/ folder: a folder of the user's is never written into, whatever builtin says."""
    if teacher_cfg.builtin is None:
        return None
    path, teachers = Path(str(teacher_cfg.path)).expanduser(), Path(str(cache_dir)).expanduser() / "teachers"
    try:
        inside = path.resolve().parent == teachers.resolve()
    except (OSError, RuntimeError):  # a symlink loop: not the cache's own folder, whatever it is
        return None
    return str(teacher_cfg.builtin) if inside else None


def check_teacher_path(teacher_cfg, cache_dir) -> None:
    """resolve_teacher_path's refusals of `teacher.path`, without building, downloading or importing diffusers: a
    run's preflight says a mistyped folder first, in a second, not after its other checks' imports (4 s)."""
    if builtin_teacher(teacher_cfg, cache_dir) is None:
        local_teacher_folder(teacher_cfg)


def local_teacher_folder(teacher_cfg) -> Path | None:
    """`teacher.path` as a local folder, or None for a Hub id to download; anything else is one line."""
    path = Path(teacher_cfg.path).expanduser()
    key = f"teacher.path={teacher_cfg.path!r}"
    if path.is_dir():
        return path
    if path.exists():
        raise UserError(f"{key} is a file; point it at a diffusers-format Wan folder (holding model_index.json)")
    if path.is_symlink():
        raise UserError(f"{key} is a symbolic link that leads nowhere (a loop or a missing target); fix the link")
    hub_shaped = teacher_cfg.path.count("/") == 1 and not teacher_cfg.path.startswith((".", "/", "~"))
    if not hub_shaped or path.parent.is_dir():  # models/Wan2.1-… in an existing models/: a folder, not a Hub id
        raise UserError(f"{key} does not exist; point it at a diffusers-format Wan folder")
    return None


def resolve_teacher_path(teacher_cfg, cache_dir) -> Path:
    """A local folder as is; the embedded teachers built on first use; a Hub id fetched by diffusers."""

    builtin = builtin_teacher(teacher_cfg, cache_dir)
    if builtin is not None:
        return ensure_tiny_teacher(teacher_cfg.path, **BUILTINS[builtin])
    local = local_teacher_folder(teacher_cfg)
    if local is not None:
        return local
    from diffusers import DiffusionPipeline

    try:
        with quieted("diffusers", logging.ERROR):  # its "Couldn't connect to the Hub" lines: ours below says it
            return Path(DiffusionPipeline.download(teacher_cfg.path, use_safetensors=True))
    except Exception as e:  # offline, unknown repo, gated repo: all the same to the user
        raise UserError(
            f"teacher.path={teacher_cfg.path!r} is not a local folder and could not be fetched from the Hub "
            f"({type(e).__name__}); download it (hf download {teacher_cfg.path} --local-dir DIR) and set "
            "teacher.path=DIR"
        ) from None


def read_json(path: Path, what: str) -> dict:
    """A teacher folder's JSON object (a VAE's config), refused in one line as the spec's own reads are."""
    return _read_json(path, what)


def _read_json(path: Path, what: str) -> dict:
    """A JSON object from a teacher folder; anything else is one UserError naming the file."""
    try:
        raw = path.read_bytes()
        if raw.startswith(b"\xef\xbb\xbf"):  # diffusers and transformers read these as plain UTF-8 and fail on it
            raise UserError(f"{what}: {path} starts with a byte-order mark; save it as UTF-8 without one")
        body = json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"{what}: {path} is missing; is this a diffusers-format Wan folder?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{what}: {path} is not valid JSON ({e}); re-download the teacher") from None
    except OSError as e:
        raise UserError(f"{what}: {path} cannot be read ({e.strerror})") from None
    if not isinstance(body, dict):
        raise UserError(f"{what}: {path} holds a JSON {json_kind(body)}, not an object; re-download the teacher")
    return body


def _require_safetensors(folder: Path, key: str) -> None:
    """Weights are there, as safetensors, and each file's header agrees with its size (no weights read)."""

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
            raise UserError(
                f"{key}: {folder} holds only pickle .bin weights; WanDistiller loads safetensors only "
                "(convert with diffusers' save_pretrained(safe_serialization=True))"
            )
        raise UserError(f"{key}: {folder} holds no weights (*.safetensors)")
    for file in files:
        problem = safetensors_problem(file)
        if problem:
            raise UserError(f"{key}: {problem}; re-download the teacher (hf download … --local-dir DIR)")


def _component(index: dict, name: str, key: str) -> str | None:
    """The class a model_index.json entry names (["diffusers", "WanTransformer3DModel"]), or None if absent."""
    entry = index.get(name)
    if entry is None:
        return None
    if not (isinstance(entry, list) and len(entry) == 2 and all(e is None or isinstance(e, str) for e in entry)):
        raise UserError(
            f"{key}: model_index.json's {name!r} is {json.dumps(entry)}; it should be [library, class], "
            'e.g. ["diffusers", "WanTransformer3DModel"]'
        )
    return entry[1]


def _expert_config(path: Path, name: str, key: str) -> dict:

    config = _read_json(path / name / "config.json", key)
    problem = wan_config_problem(config)
    if problem:
        raise UserError(f"{key}: {name}/config.json: {problem}; re-download the teacher")
    blocks = _stored_blocks(path / name)
    if blocks != config["num_layers"]:  # fewer would leave blocks random in silence; more fail late
        raise UserError(
            f"{key}: {name}/config.json says num_layers={config['num_layers']} but its weights hold {blocks} "
            "blocks; re-download the teacher (config and weights come from different models)"
        )
    return config


def _stored_blocks(folder: Path) -> int:
    """How many transformer blocks the safetensors files hold, from their headers (no weights read)."""

    indices = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            indices |= {int(k.split(".")[1]) for k in f.keys() if k.startswith("blocks.") and k.split(".")[1].isdigit()}
    return max(indices) + 1 if indices else 0


# model_index.json entries besides the experts: the library, and the base class the named class must have.
COMPONENTS = {
    "text_encoder": ("transformers", "PreTrainedModel"),
    "tokenizer": ("transformers", "PreTrainedTokenizerBase"),
    "vae": ("diffusers", "AutoencoderKLWan"),
    "scheduler": ("diffusers", "SchedulerMixin"),
}


# Components only some folders have (Wan 2.1 I2V's CLIP vision tower): checked as COMPONENTS where named.
IMAGE_COMPONENTS = {
    "image_encoder": ("transformers", "PreTrainedModel"),
    "image_processor": ("transformers", "ImageProcessingMixin"),
}


def _check_components(path: Path, index: dict, key: str) -> None:
    """Every other component is named with a real class of its kind, and its files are there and parse:
    a missing, garbage or bogus one is one line now, not a library traceback when it loads."""

    named = {name: kind for name, kind in IMAGE_COMPONENTS.items() if _component(index, name, key)}
    for name, (library, base) in (COMPONENTS | named).items():
        entry = _component(index, name, key)
        found = getattr(importlib.import_module(library), entry, None) if isinstance(entry, str) else None
        if index.get(name, [None])[0] != library or not (isinstance(found, type) and _is_a(found, library, base)):
            raise UserError(
                f"{key}: model_index.json's {name!r} is {json.dumps(index.get(name))}; a Wan folder names a "
                f"{library} {base} there (re-download the teacher)"
            )
    for config in ("text_encoder/config.json", "vae/config.json", "tokenizer/tokenizer_config.json"):
        _read_json(path / config, key)
    _require_safetensors(path / "vae", key)
    if "image_encoder" in named:
        _read_json(path / "image_encoder" / "config.json", key)
        _require_safetensors(path / "image_encoder", key)
    if "image_processor" in named:
        _read_json(path / "image_processor" / "preprocessor_config.json", key)
    tokenizer = path / "tokenizer"
    if (tokenizer / "tokenizer.json").is_file():
        _read_json(tokenizer / "tokenizer.json", key)
    elif not (tokenizer / "spiece.model").is_file():
        raise UserError(f"{key}: {tokenizer} holds no tokenizer.json or spiece.model; re-download the teacher")


def _is_a(cls: type, library: str, base: str) -> bool:

    return issubclass(cls, getattr(importlib.import_module(library), base))


def _schedule(path: Path, key: str) -> tuple[float, int]:
    """(flow shift, train timesteps) from the scheduler's config: UniPC / DPM++ call the shift flow_shift,
    FlowMatchEulerDiscrete calls it shift."""
    scheduler = _read_json(path / "scheduler" / "scheduler_config.json", key)
    shift = scheduler.get("flow_shift") or scheduler.get("shift") or 1.0
    steps = scheduler.get("num_train_timesteps", NUM_TRAIN_TIMESTEPS)
    if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not shift > 0:
        raise UserError(f"{key}: scheduler_config.json's flow_shift={shift!r} must be a positive number")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        raise UserError(f"{key}: scheduler_config.json's num_train_timesteps={steps!r} must be a positive integer")
    return float(shift), steps


def folder_layout(path: Path, index: dict, config: dict, key: str) -> Layout:
    """What the experts take besides noise and text, from the configs alone (never the folder's name), as the
    model's own pipeline decides it: model_index.json's expand_timesteps is TI2V 5B's first-frame replacement
    (WanPipeline / WanImageToVideoPipeline read it so); an expert taking more channels than it returns takes a
    mask and the image's latents beside the noise (WanImageToVideoPipeline's concatenation: 4 mask channels, one
    per frame the VAE folds into a latent frame, then the VAE's latent channels)."""
    vae = _read_json(path / "vae" / "config.json", key)
    z, folded = vae.get("z_dim", 16), vae.get("scale_factor_temporal", 4)
    given, made = config["in_channels"], config.get("out_channels") or config["in_channels"]
    where = f"{key}: transformer/config.json's in_channels={given}, out_channels={made} and vae/config.json's z_dim={z}"
    if index.get("expand_timesteps") is True:
        if given == made == z:
            return Layout.ti2v
        raise UserError(f"{where} do not agree with expand_timesteps (TI2V: all three equal); re-download the teacher")
    if given == made == z:
        layout = Layout.t2v
    elif made == z and given == made + folded + z:
        layout = Layout.i2v
    else:
        raise UserError(
            f"{where} are neither text-to-video's (all equal) nor image-to-video's (in = out + {folded} mask "
            f"channels + z_dim); re-download the teacher"
        )
    if config.get("image_dim") is not None and not (
        _component(index, "image_encoder", key) and _component(index, "image_processor", key)
    ):
        raise UserError(
            f"{key}: transformer/config.json's image_dim={config['image_dim']} wants CLIP image tokens, but "
            "model_index.json names no image_encoder and image_processor; re-download the teacher"
        )
    return layout


def _a(name) -> str:
    """`name` with its article: "a WanPipeline", "an AutoencoderKL", "no known model" as it is."""
    text = str(name)[:100]
    if text.startswith("no "):
        return text
    return f"{'an' if text[:1].lower() in 'aeiou' else 'a'} {text}"


def inspect_teacher(path: Path) -> TeacherSpec:
    """Check that `path` is a Wan text- or image-to-video diffusers folder and read its shape, without weights."""
    key = f"teacher.path={str(path)!r}"
    if not path.is_dir():
        raise UserError(f"{key} is not a folder")
    index = _read_json(path / "model_index.json", key)
    experts = tuple(name for name in ("transformer", "transformer_2") if _component(index, name, key))
    if not experts or _component(index, "transformer", key) != "WanTransformer3DModel":
        raise UserError(
            f"{key} holds {_a(index.get('_class_name', 'no known model'))} without a WanTransformer3DModel "
            "'transformer'; point it at a Wan diffusers folder (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers)"
        )
    for name in experts + ("text_encoder",):
        _require_safetensors(path / name, key)
    _check_components(path, index, key)
    config = _expert_config(path, "transformer", key)
    if experts == ("transformer", "transformer_2"):
        config_2 = _expert_config(path, "transformer_2", key)
        if config_2.get("in_channels") != config.get("in_channels") or config_2.get("text_dim") != config.get(
            "text_dim"
        ):
            raise UserError(f"{key}: transformer and transformer_2 disagree on in_channels/text_dim")
    boundary_ratio = index.get("boundary_ratio")
    if len(experts) == 2 and not (isinstance(boundary_ratio, (int, float)) and 0 < boundary_ratio < 1):
        raise UserError(
            f"{key} has transformer_2 but boundary_ratio={boundary_ratio!r} in model_index.json; "
            "set it to a number in (0, 1) (Wan 2.2: 0.875)"
        )
    flow_shift, num_train_timesteps = _schedule(path, key)
    layout = folder_layout(path, index, config, key)
    return TeacherSpec(
        path=path,
        experts=experts,
        transformer_config=config,
        boundary_ratio=boundary_ratio if len(experts) == 2 else None,
        flow_shift=flow_shift,
        num_train_timesteps=num_train_timesteps,
        layout=layout,
        image_encoder=config.get("image_dim") is not None,
    )


@contextlib.contextmanager
def loading(spec: TeacherSpec, what: str) -> Iterator[None]:
    """A teacher component's library load: what the folder checks could not see (a truncated tokenizer
    model, a config the library rejects) is one line naming the component, not a library traceback."""
    try:
        yield
    except (UserError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # transformers / diffusers / sentencepiece raise many types for a damaged file
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UserError(
            f"teacher.path={str(spec.path)!r}: its {what} cannot be loaded ({type(e).__name__}: {first}); "
            "re-download the teacher"
        ) from None


# The diffusers pipeline a student of each layout samples with: an image-to-video teacher's takes the given image.
# TI2V 5B's own folder names WanPipeline (text to video); diffusers gives it an image through WanImageToVideoPipeline,
# so its folder keeps its own model_index.json and the card loads it with that class.
PIPELINES = {Layout.t2v: "WanPipeline", Layout.i2v: "WanImageToVideoPipeline", Layout.ti2v: "WanImageToVideoPipeline"}


def pipeline_name(teacher_path: Path | None) -> str:
    """The diffusers pipeline class that samples a student of this teacher (`PIPELINES`); WanPipeline without one."""
    return PIPELINES[teacher_layout(teacher_path)]


def teacher_layout(teacher_path: Path | None) -> Layout:
    """The teacher's layout (what its experts take besides noise and text), read off its configs; t2v without one."""
    return inspect_teacher(teacher_path).layout if teacher_path is not None else Layout.t2v
