"""The frozen Wan teacher: find its folder, check it, load it, and compute guided velocity targets.

One code path for every teacher: a Hub id is first fetched into the local cache by diffusers, then
every teacher -- the embedded tiny one included -- is a local diffusers-format folder loaded with
`from_pretrained(..., use_safetensors=True)`. No remote code.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from wandistiller.core.errors import UserError, quieted

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

    @property
    def boundary_timestep(self) -> float | None:
        return None if self.boundary_ratio is None else self.boundary_ratio * self.num_train_timesteps


def builtin_teacher(teacher_cfg, cache_dir) -> str | None:
    """The embedded teacher to build ("tiny", "tiny_moe"), or None. `teacher.builtin` applies only to a path
    in the cache's teachers/ folder: a folder of the user's is never written into, whatever builtin says."""
    if teacher_cfg.builtin is None:
        return None
    path, teachers = Path(str(teacher_cfg.path)).expanduser(), Path(str(cache_dir)).expanduser() / "teachers"
    try:
        inside = path.resolve().parent == teachers.resolve()
    except (OSError, RuntimeError):  # a symlink loop: not the cache's own folder, whatever it is
        return None
    return str(teacher_cfg.builtin) if inside else None


def resolve_teacher_path(teacher_cfg, cache_dir) -> Path:
    """A local folder as is; the embedded teachers built on first use; a Hub id fetched by diffusers."""
    from wandistiller.teacher.tiny import ensure_tiny_teacher

    builtin = builtin_teacher(teacher_cfg, cache_dir)
    if builtin is not None:
        return ensure_tiny_teacher(teacher_cfg.path, two_experts=builtin == "tiny_moe")
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
    from diffusers import DiffusionPipeline

    try:
        with quieted("diffusers", logging.ERROR):  # its "Couldn't connect to the Hub" lines: ours below says it
            return Path(DiffusionPipeline.download(teacher_cfg.path, use_safetensors=True))
    except Exception as e:  # offline, unknown repo, gated repo: all the same to the user
        raise UserError(
            f"{key} is not a local folder and could not be fetched from the Hub ({type(e).__name__}); download "
            f"it (hf download {teacher_cfg.path} --local-dir DIR) and set teacher.path=DIR"
        ) from None


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
        from wandistiller.core.arch import json_kind

        raise UserError(f"{what}: {path} holds a JSON {json_kind(body)}, not an object; re-download the teacher")
    return body


def _require_safetensors(folder: Path, key: str) -> None:
    """Weights are there, as safetensors, and each file's header agrees with its size (no weights read)."""
    from wandistiller.core.files import safetensors_problem

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
    from wandistiller.core.arch import wan_config_problem

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
    from safetensors import safe_open

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


def _check_components(path: Path, index: dict, key: str) -> None:
    """Every other component is named with a real class of its kind, and its files are there and parse:
    a missing, garbage or bogus one is one line now, not a library traceback when it loads."""
    import importlib

    for name, (library, base) in COMPONENTS.items():
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
    tokenizer = path / "tokenizer"
    if (tokenizer / "tokenizer.json").is_file():
        _read_json(tokenizer / "tokenizer.json", key)
    elif not (tokenizer / "spiece.model").is_file():
        raise UserError(f"{key}: {tokenizer} holds no tokenizer.json or spiece.model; re-download the teacher")


def _is_a(cls: type, library: str, base: str) -> bool:
    import importlib

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


def inspect_teacher(path: Path) -> TeacherSpec:
    """Check that `path` is a Wan text-to-video diffusers folder and read its shape, without weights."""
    key = f"teacher.path={str(path)!r}"
    if not path.is_dir():
        raise UserError(f"{key} is not a folder")
    index = _read_json(path / "model_index.json", key)
    experts = tuple(name for name in ("transformer", "transformer_2") if _component(index, name, key))
    if not experts or _component(index, "transformer", key) != "WanTransformer3DModel":
        raise UserError(
            f"{key} is a {index.get('_class_name', 'unknown')} folder without a WanTransformer3DModel 'transformer'; "
            "point it at a Wan T2V diffusers folder (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers)"
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
    return TeacherSpec(
        path=path,
        experts=experts,
        transformer_config=config,
        boundary_ratio=boundary_ratio if len(experts) == 2 else None,
        flow_shift=flow_shift,
        num_train_timesteps=num_train_timesteps,
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


def freeze(model: nn.Module) -> nn.Module:
    """The one place a teacher module becomes a frozen teacher: eval, no grads, nothing left on meta."""
    model.eval().requires_grad_(False)
    on_meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if on_meta:
        raise RuntimeError(f"teacher tensors left on the meta device after loading: {on_meta[:5]}")
    return model


def load_expert(spec: TeacherSpec, name: str, dtype: torch.dtype, **load_kwargs) -> nn.Module:
    from diffusers import WanTransformer3DModel

    with loading(spec, name):
        model = WanTransformer3DModel.from_pretrained(
            spec.path, subfolder=name, dtype=dtype, use_safetensors=True, **load_kwargs
        )
    return freeze(model)


def compile_blocks(expert: nn.Module) -> None:
    """Regional torch.compile: one graph for the block, reused by all 40 (as diffusers' compile_repeated_blocks).

    Only each block's `forward` is compiled, not its whole call (which compile_repeated_blocks takes), so
    hooks on a block stay eager: the streamers swap weights in them between calls, which a graph could not.
    Weights are graph inputs, so swapping them does not recompile; outputs equal the resident compiled ones.
    """
    for block in expert.blocks:
        block.forward = torch.compile(block.forward, fullgraph=True)
    log_first_call(expert.blocks[0], "the teacher's block graph")


def log_first_call(module: nn.Module, what: str) -> None:
    """One log line when `module`'s first call starts (torch.compile compiles then, lazily) and one with how
    long that call took: a compile takes from seconds to minutes, and a silent wait looks like a hang."""
    import time

    log, started = logging.getLogger("wandistiller"), []

    def before(m, args, kwargs=None):
        log.info("compiling %s (torch.compile, on its first call)", what)
        started.append(time.perf_counter())
        pre.remove()

    def after(m, args, out):
        log.info("compiled %s in %.1f s (its first call, compute included)", what, time.perf_counter() - started[0])
        post.remove()

    pre, post = module.register_forward_pre_hook(before), module.register_forward_hook(after)


class Teacher:
    """Guided-velocity targets from one or two frozen Wan experts.

    Mirrors WanPipeline's denoising step: for two experts, `transformer` serves t >= boundary and
    `transformer_2` the rest (timestep space, not index space); CFG is uncond + g * (cond - uncond)
    with the expert's own scale. Cond and uncond run as one batch of 2B.
    """

    def __init__(self, spec: TeacherSpec, experts: list[nn.Module], guidance_scales: list[float], device: torch.device):
        if len(experts) != len(guidance_scales):
            raise ValueError("one guidance scale per expert")
        self.spec = spec
        self.experts = experts
        self.guidance_scales = guidance_scales
        self.device = device
        self.dtype = experts[0].dtype  # ModelMixin.dtype skips the modules diffusers keeps in fp32
        # Sharded experts' forwards are collectives: every rank runs every expert, even without samples for it.
        self.collective = False
        self.streamers: list = []  # set by the streaming placements (offload, disk)

    def copy_ms(self) -> float | None:
        """Time spent streaming weights since the last call; None for a teacher that does not stream."""
        return sum(s.drain_copy_ms() for s in self.streamers) if self.streamers else None

    def expert_index(self, t: torch.Tensor) -> torch.Tensor:
        """0 for `transformer` (t >= boundary, the high-noise expert), 1 for `transformer_2`."""
        if len(self.experts) == 1:
            return torch.zeros_like(t, dtype=torch.long)
        return (t < self.spec.boundary_timestep).long()

    @torch.no_grad()
    def targets(
        self, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor, want_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Guided velocity (float32, on the teacher's device) and, if asked, the last block's cond hidden states."""
        x_t, t = x_t.to(self.device, self.dtype), t.to(self.device)
        cond, uncond = cond.to(self.device, self.dtype), uncond.to(self.device, self.dtype)
        which = self.expert_index(t)
        out = torch.empty(x_t.shape, dtype=torch.float32, device=self.device)
        hidden = None
        for i, (expert, scale) in enumerate(zip(self.experts, self.guidance_scales)):
            # One expert serves every row: no nonzero(), which would make the host wait for the device.
            rows = slice(None) if len(self.experts) == 1 else (which == i).nonzero().flatten()
            count = len(t) if len(self.experts) == 1 else rows.numel()
            if count == 0:
                if self.collective:  # keep step with the other ranks: one sample's forward, thrown away
                    expert(hidden_states=x_t[:1], timestep=t[:1], encoder_hidden_states=cond[:1], return_dict=False)
                continue
            if count < len(t):  # group the samples each expert serves, as one batch per expert
                xs, ts, cs, us = x_t[rows], t[rows], cond[rows], uncond[rows]
            else:
                xs, ts, cs, us = x_t, t, cond, uncond
            with capture_last_block(expert, want_hidden) as captured:
                pred = expert(
                    hidden_states=torch.cat([xs, xs]),
                    timestep=torch.cat([ts, ts]),
                    encoder_hidden_states=torch.cat([cs, us]),
                    return_dict=False,
                )[0]
            # (to this device: a model spread over GPUs returns from its last one)
            pred_cond, pred_uncond = pred.to(self.device, torch.float32).chunk(2)
            out[rows] = pred_uncond + scale * (pred_cond - pred_uncond)
            if want_hidden:
                h = captured[0][:count].to(self.device, torch.float32)
                hidden = h.new_empty((len(t), *h.shape[1:])) if hidden is None else hidden
                hidden[rows] = h
        return out, hidden


class capture_last_block:
    """Context manager: a forward hook that keeps the last transformer block's output."""

    def __init__(self, model: nn.Module, enabled: bool):
        self.model, self.enabled, self.captured, self.handle = model, enabled, [], None

    def __enter__(self) -> list[torch.Tensor]:
        if self.enabled:
            self.handle = self.model.blocks[-1].register_forward_hook(lambda m, i, o: self.captured.append(o))
        return self.captured

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            self.handle.remove()
