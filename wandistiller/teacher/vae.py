"""The teacher's own VAE, in both directions, with the latent normalisation WanPipeline uses.

WanPipeline turns a sampled latent z into an image with `decode(z * std + mean)` (its code writes it as
`z / (1/std) + mean`), so a real image enters latent space as `(encode(x) - mean) / std`. Training on
image latents and decoding student samples must both go through exactly this pair.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from wandistiller.core.arch import POCKET_VAE
from wandistiller.core.errors import UserError
from wandistiller.teacher.spec import TeacherSpec, loading, read_json


def load_vae(spec: TeacherSpec, device: torch.device, dtype: torch.dtype = torch.float32):
    from diffusers import AutoencoderKLWan

    with loading(spec, "VAE"):
        vae = AutoencoderKLWan.from_pretrained(spec.path, subfolder="vae", dtype=dtype, use_safetensors=True)
    return vae.to(device).eval().requires_grad_(False)


def vae_skeleton(spec: TeacherSpec):
    """The teacher's VAE without weights (accelerate's empty init, its own config): for a pipeline that reads only
    its config (z_dim, the scale factors) because it is given latents and conditioning already encoded -- the ODE
    points of an image-to-video teacher -- so no VAE is read or held for it."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLWan

    with init_empty_weights():
        return AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(spec.path, subfolder="vae"))


def time_compression(vae_config: dict) -> int:
    """How many frames the VAE folds into one latent frame: 2 per temporal downsampling stage (Wan 2.1's 4)."""
    return 2 ** sum(bool(x) for x in vae_config.get("temperal_downsample") or ())


def pixel_frames(latent_frames: int, vae_config: dict) -> int:
    """The frames a clip of `latent_frames` latent frames spans: Wan's causal VAE keeps the first frame alone."""
    return (latent_frames - 1) * int(vae_config.get("scale_factor_temporal", 4)) + 1


STILLS_FIX = "use data.latent_frames=1, or a video teacher (e.g. teacher=pocket_video)"
# A resumed clip run keeps its frames: what it needs is the teacher it was trained with.
RESUMED_FIX = "a resume keeps the run's data.latent_frames: resume with the video teacher it was trained with"


def frames_problem(vae_config: dict, latent_frames: int, fix: str = STILLS_FIX) -> str | None:
    """Why this VAE cannot make `latent_frames` latent frames (None where it can), ending with `fix`. One frame
    always works; a clip needs a VAE that compresses time, by the factor its config says (WanPipeline and the
    decoder read `scale_factor_temporal`; the layers do `temperal_downsample`)."""
    if latent_frames <= 1:
        return None
    told, made = int(vae_config.get("scale_factor_temporal", 4)), time_compression(vae_config)
    stages = json.dumps(vae_config.get("temperal_downsample"))
    key = f"data.latent_frames={latent_frames}"
    if made == 1:
        return (
            f"{key}: the teacher's VAE does not compress time (temperal_downsample={stages}), a VAE for stills; " + fix
        )
    if made != told:
        return (
            f"{key}: the teacher's VAE says scale_factor_temporal={told} but compresses time {made}x "
            f"(temperal_downsample={stages}), so its clips would not decode as they were sampled (a VAE trained on "
            "stills); " + fix
        )
    return None


def check_latent_frames(teacher_path: Path, latent_frames: int, resumed: bool = False) -> None:
    """Refuse, in one line, a `data.latent_frames` the teacher's VAE cannot make (before anything loads); a resumed
    run (`resumed`) is told to bring back its teacher, not to change its frames. One frame on a pocket video
    teacher is refused too: it is judged on its clips alone, so such a run trained, then its evaluation refused it."""
    if latent_frames <= 1 and pocket_frames(teacher_path) == "clips":
        raise UserError(
            f"data.latent_frames={latent_frames} makes single frames, but the teacher at {teacher_path} is a pocket "
            "video teacher, trained and judged on clips of 9 frames: "
            + (
                "a resume keeps the run's data.latent_frames, so this run cannot go on on it (a run of an earlier "
                "version): start a new run folder with data.latent_frames=5"
                if resumed
                else "set data.latent_frames=5 (as its experiments do: +experiment=pocket_video, pocket_i2v_lora, …)"
            )
        )
    if latent_frames <= 1:
        return
    vae_config = read_json(Path(teacher_path) / "vae" / "config.json", "teacher.path")
    problem = frames_problem(vae_config, latent_frames, RESUMED_FIX if resumed else STILLS_FIX)
    if problem:
        raise UserError(problem)


def latent_stats(vae) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std), shaped [1, C, 1, 1, 1] on the VAE's device and dtype."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(vae.device, vae.dtype)
    std = torch.tensor(vae.config.latents_std).view(shape).to(vae.device, vae.dtype)
    return mean, std


@torch.no_grad()
def encode_images(vae, pixels: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] in [-1, 1] -> normalised latents [B, C, 1, H/8, W/8] (float32, CPU).

    The posterior's mode, not a sample: the cached latents are then a function of the images alone.
    """
    mean, std = latent_stats(vae)
    z = vae.encode(pixels[:, :, None].to(vae.device, vae.dtype)).latent_dist.mode()
    return ((z - mean) / std).float().cpu()


@torch.no_grad()
def encode_clips(vae, pixels: torch.Tensor) -> torch.Tensor:
    """[B, 3, F, H, W] in [-1, 1] -> normalised latents [B, C, (F - 1) / scale_factor_temporal + 1, H/s, W/s]
    (float32, CPU), the posterior's mode as for images."""
    mean, std = latent_stats(vae)
    z = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
    return ((z - mean) / std).float().cpu()


@torch.no_grad()
def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents [B, C, F, h, w] -> first frames [B, 3, H, W] in [0, 1], as WanPipeline decodes."""
    from diffusers.video_processor import VideoProcessor

    mean, std = latent_stats(vae)
    video = vae.decode(latents.to(vae.device, vae.dtype) * std + mean, return_dict=False)[0]
    processor = VideoProcessor(vae_scale_factor=vae.config.scale_factor_spatial)
    return processor.postprocess_video(video, output_type="pt")[:, 0].float().cpu()


@torch.no_grad()
def decode_clips(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents [B, C, f, h, w] -> every frame [B, F, 3, H, W] in [0, 1], as WanPipeline decodes a video
    (`decode_latents` keeps the first frame: what a one-frame run shows)."""
    from diffusers.video_processor import VideoProcessor

    mean, std = latent_stats(vae)
    video = vae.decode(latents.to(vae.device, vae.dtype) * std + mean, return_dict=False)[0]
    processor = VideoProcessor(vae_scale_factor=vae.config.scale_factor_spatial)
    return processor.postprocess_video(video, output_type="pt").float().cpu()


def pocket_frames(teacher_path) -> str | None:
    """What a pocket teacher's VAE makes, read off its `vae/config.json`: "clips" (the pocket video teacher's: the
    time compression its layers make is the one its config declares, so clips decode as sampled), "image" (the
    pocket image teacher's, trained on single frames: its config declares Wan's 4x where its layers make 2x), None
    for any other teacher (a real Wan VAE makes both: one frame is an image)."""
    try:
        config = json.loads((Path(teacher_path) / "vae" / "config.json").read_text())
    except (TypeError, OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if not all(config.get(k) == v for k, v in POCKET_VAE.items() if k != "temperal_downsample"):
        return None
    made = time_compression(config)
    if made > 1 and made == config.get("scale_factor_temporal", 4):
        return "clips"
    return "image" if config.get("temperal_downsample") == POCKET_VAE["temperal_downsample"] else None


def pocket_frames_problem(teacher_path, latent_frames: int) -> str | None:
    """Why a run of `latent_frames` cannot be judged against the teacher at `teacher_path` (None where it can): a
    clip run against the pocket image teacher, a one-frame run against the pocket video teacher."""
    kind = pocket_frames(teacher_path)
    if kind == "image" and latent_frames > 1:
        return (
            f"the run makes clips (data.latent_frames={latent_frames}) but the teacher at {teacher_path} is the "
            "pocket image teacher (single frames)"
        )
    if kind == "clips" and latent_frames == 1:
        return (
            f"the run makes single frames (data.latent_frames=1) but the teacher at {teacher_path} makes clips (its "
            "VAE is the pocket video and image-to-video teachers')"
        )
    return None
