"""A ComfyUI workflow beside each single file, and the README that says what else it needs and where it goes.

The workflow is ComfyUI's own (UI) format, which it opens by dropping the JSON on its canvas: nodes with their
widget values, and links between their slots. It names only core nodes, as ComfyUI's own Wan text-to-video example
does: "Load Diffusion Model" (UNETLoader) for the student's file, CLIPLoader (type wan) for the umT5-XXL text
encoder, VAELoader for the Wan VAE, ModelSamplingSD3 at the teacher's flow shift, an empty latent of the student's
size and one frame, the sampler at the student's steps with cfg 1 (it was distilled from guided targets), VAEDecode
and SaveImage. A few-step student samples at exactly the sigmas it was trained at (`Sampling.sigmas`): KSampler with
ComfyUI's `simple` or `beta` scheduler where that function gives them at the ModelSamplingSD3 shift, else
ManualSigmas (the sigmas as text) into SamplerCustomAdvanced with KSamplerSelect euler and BasicGuider. A pair (Wan
2.2 A14B) gets two loaders and two KSamplerAdvanced (or SplitSigmas and two SamplerCustomAdvanced, the second without
new noise), the high-noise expert's steps first, split where the sigmas cross the boundary.

A LoRA student's workflow (`loras`) loads the teacher's own diffusion model file (its usual name in ComfyUI's folders
for the Wan teachers, `TEACHER_FILES`) and puts the adapters on it with LoraLoaderModelOnly (strength 1: the scale the
student was trained at) before the same sampler; a pair adapts each expert with its own file.

An image-to-video student's workflow feeds its experts as ComfyUI's own Wan image-to-video examples do, its first
frame from LoadImage (`IMAGE_NODES`): Wan 2.1 / 2.2 I2V through WanImageToVideo (the mask and the image's latents on
the conditioning; Wan 2.1's CLIP image tokens from CLIPVisionLoader and CLIPVisionEncode), TI2V 5B through
Wan22ImageToVideoLatent (the image's latent as the first latent frame). It samples `Sampling.frames` frames and saves
them as an animated WEBP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from wandistiller.state.singlefile import expert_names

# The usual names of the teacher's other files in ComfyUI's folders (Comfy-Org's repackaged Wan files).
TEXT_ENCODER = "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
VAE = "wan_2.1_vae.safetensors"
VAE_22 = "wan2.2_vae.safetensors"  # TI2V 5B's own 48-channel VAE
CLIP_VISION = "clip_vision_h.safetensors"  # Wan 2.1 I2V's CLIP ViT-H/14
FIRST_FRAME = "first_frame.png"  # LoadImage's widget: the user picks their image in ComfyUI's input folder
FPS = 16  # Wan's clips are 16 frames a second
REPACKAGED = "Comfy-Org's Wan repackage"
FOLDERS = {
    "diffusion_model": "models/diffusion_models",
    "text_encoder": "models/text_encoders",
    "vae": "models/vae",
    "lora": "models/loras",
    "clip_vision": "models/clip_vision",
}
# The Wan teachers' diffusion model files as ComfyUI users have them (Comfy-Org's repackage), by Hub id; a pair's
# high-noise expert first. Another teacher (pocket, a local folder) is named by a placeholder the README explains.
TEACHER_FILES = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": ("wan2.1_t2v_1.3B_fp16.safetensors",),
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": ("wan2.1_t2v_14B_fp16.safetensors",),
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": (
        "wan2.2_t2v_high_noise_14B_fp16.safetensors",
        "wan2.2_t2v_low_noise_14B_fp16.safetensors",
    ),
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": ("wan2.1_i2v_480p_14B_fp16.safetensors",),
    "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers": ("wan2.1_i2v_720p_14B_fp16.safetensors",),
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": (
        "wan2.2_i2v_high_noise_14B_fp16.safetensors",
        "wan2.2_i2v_low_noise_14B_fp16.safetensors",
    ),
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": ("wan2.2_ti2v_5B_fp16.safetensors",),
}

# The ComfyUI node that gives an image-to-video student its first frame, by what its experts take (core/arch.py's
# Layout): WanImageToVideo puts the mask and the image's latents (and CLIP image tokens) on the conditioning and
# returns an empty latent; Wan22ImageToVideoLatent returns the latent with the image's own as its first frame.
WAN_I2V, WAN22_I2V = "WanImageToVideo", "Wan22ImageToVideoLatent"
IMAGE_NODES = {"i2v": WAN_I2V, "ti2v": WAN22_I2V}

# What a workflow makes (`python -m wandistiller.export --workflow`), by name: a clip from text alone, or from the
# prompt and a first frame. The default is the teacher's own; `workflow_problem` says which a student cannot take.
WORKFLOWS = {
    "text-to-video": "a clip from the prompt alone",
    "image-to-video": "a clip from the prompt and a first frame",
}


def default_workflow(layout: str) -> str:
    """The workflow a student of this layout gets unless the user names another: the teacher's own."""
    return "image-to-video" if layout in IMAGE_NODES else "text-to-video"


def workflow_problem(layout: str, wanted: str) -> str | None:
    """Why a student of `layout` cannot run in the `wanted` workflow, in words; None where it can. TI2V 5B is also a
    text-to-video model (without an image its pipeline is WanPipeline's), so it takes both; the others one each."""
    if wanted == "text-to-video" and layout == "i2v":
        return (
            "its experts take the first frame's mask and latents beside the noise (an image-to-video teacher): "
            "a text-to-video workflow has no image to give them"
        )
    if wanted == "image-to-video" and layout == "t2v":
        return "its teacher is a text-to-video model: its experts take no image"
    return None


Slot = tuple[int, int]  # a node's output: (node id, output slot)


@dataclass(frozen=True)
class Sampling:
    """How the student samples in ComfyUI: its steps, the sampler and scheduler, the flow shift, the image size;
    `boundary`: a pair's switch from the high-noise expert, in timesteps (t / 1000 of the schedule)."""

    steps: int
    sampler: str
    scheduler: str
    shift: float
    width: int
    height: int
    boundary: float | None = None
    prompt: str = "a red 1"  # the workflow's example prompt: one of the teacher's own (state/card.example_prompt)
    # A few-step student's K + 1 trained sigmas (ending at 0). With scheduler "simple" or "beta" ComfyUI's function
    # of that name gives them at `shift` (KSampler); with MANUAL the workflow sets them itself (ManualSigmas).
    sigmas: tuple[float, ...] | None = None
    frames: int = 1  # pixel frames; an image run's 1
    # An image-to-video student's first-frame node (`IMAGE_NODES`; None: text to video), and whether its experts
    # also take CLIP image tokens (Wan 2.1 I2V).
    image_node: str | None = None
    first_frame: bool = False  # a LoadImage gives it (TI2V 5B's text-to-video workflow: its latent node, no image)
    clip_vision: bool = False
    vae: str = VAE


MANUAL = "manual"  # Sampling.scheduler where no ComfyUI scheduler gives the trained sigmas: ManualSigmas sets them


def sigmas_text(sigmas) -> str:
    """ManualSigmas' widget: the sigmas comma-separated, in plain decimals (its parser reads no exponents), to
    8 places: within 1e-8 of the trained ones before ComfyUI's float32."""
    return ", ".join(f"{v:.8f}".rstrip("0").rstrip(".") if v else "0.0" for v in sigmas)


@dataclass
class _Graph:
    nodes: list[dict] = field(default_factory=list)
    links: list[list] = field(default_factory=list)

    def add(
        self,
        kind: str,
        widgets: list,
        inputs: dict[str, tuple[str, tuple[int, int]]],
        outputs: list[str],
        title: str | None = None,
    ) -> int:
        """A node; `inputs`: name -> (type, (node id, output slot)). Returns its id."""
        node_id = len(self.nodes) + 1
        node: dict = {
            "id": node_id,
            "type": kind,
            "pos": [40 + 320 * (node_id % 5), 80 + 220 * (node_id // 5)],
            "size": [300, 120],
            "flags": {},
            "order": node_id - 1,
            "mode": 0,
            "inputs": [],
            "outputs": [{"name": o, "type": o, "links": [], "slot_index": i} for i, o in enumerate(outputs)],
            "properties": {"Node name for S&R": kind},
            "widgets_values": widgets,
        }
        if title:
            node["title"] = title
        for name, (kind_in, (source, slot)) in inputs.items():
            link_id = len(self.links) + 1
            self.links.append([link_id, source, slot, node_id, len(node["inputs"]), kind_in])
            node["inputs"].append({"name": name, "type": kind_in, "link": link_id})
            self.nodes[source - 1]["outputs"][slot]["links"].append(link_id)
        self.nodes.append(node)
        return node_id

    def workflow(self) -> dict:
        return {
            "last_node_id": len(self.nodes),
            "last_link_id": len(self.links),
            "nodes": self.nodes,
            "links": self.links,
            "groups": [],
            "config": {},
            "extra": {},
            "version": 0.4,
        }


def switch_step(s: Sampling) -> int:
    """The step at which a pair hands over to the low-noise expert: the first of ComfyUI's `simple` schedule at
    this shift whose timestep is below the boundary (the high-noise expert serves t >= boundary, as WanPipeline)."""
    assert s.boundary is not None
    if s.sigmas is not None:
        return next((i for i, sigma in enumerate(s.sigmas[: s.steps]) if sigma < s.boundary), s.steps)
    for i in range(s.steps):
        t = 1 - i / s.steps
        if s.shift * t / (1 + (s.shift - 1) * t) < s.boundary:
            return i
    return s.steps


def teacher_files(hub_id: str | None, name: str, experts: int) -> tuple[list[str], bool]:
    """(the teacher's diffusion model files as a ComfyUI user has them, whether those are their usual names): a
    Wan teacher's repackaged files, else `<name>.safetensors` (`<name>_high_noise` / `_low_noise` for a pair)."""
    known = TEACHER_FILES.get(hub_id or "")
    if known is not None and len(known) == experts:
        return list(known), True

    return expert_names(name, experts), False


def _models(g, files: list[str], s: Sampling, loras: list[str] | None, under) -> list[int]:
    """Each expert's diffusion model node: its file (UNETLoader), the teacher's LoRAs then the student's chained on
    it (LoraLoaderModelOnly), at the flow shift (ModelSamplingSD3)."""
    models = []
    for i, file in enumerate(files):
        unet = g.add("UNETLoader", [file, "default"], {}, ["MODEL"])
        for lora, strength in (under or [[]] * len(files))[i]:
            unet = g.add(
                "LoraLoaderModelOnly",
                [lora, strength],
                {"model": ("MODEL", (unet, 0))},
                ["MODEL"],
                title="the teacher's LoRA",
            )
        if loras is not None:
            unet = g.add("LoraLoaderModelOnly", [loras[i], 1.0], {"model": ("MODEL", (unet, 0))}, ["MODEL"])
        models.append(g.add("ModelSamplingSD3", [s.shift], {"model": ("MODEL", (unet, 0))}, ["MODEL"]))
    return models


def workflow(
    files: list[str],
    s: Sampling,
    prompt: str,
    loras: list[str] | None = None,
    under: list[list[tuple[str, float]]] | None = None,
) -> dict:
    """The workflow for one student file, or for a pair (`files`: high-noise, low-noise). `loras`: a LoRA student's
    files (one per expert), each put on the teacher's diffusion model file of `files` by LoraLoaderModelOnly.
    `under`: per expert, the (file, strength) of the LoRAs the teacher was fine-tuned with (teacher.lora), each a
    LoraLoaderModelOnly chained before the student's: the student was distilled from that fine-tuned teacher."""
    g = _Graph()
    clip = g.add("CLIPLoader", [TEXT_ENCODER, "wan", "default"], {}, ["CLIP"])
    vae = g.add("VAELoader", [s.vae], {}, ["VAE"])
    positive = g.add("CLIPTextEncode", [prompt], {"clip": ("CLIP", (clip, 0))}, ["CONDITIONING"])
    negative = g.add(
        "CLIPTextEncode", [""], {"clip": ("CLIP", (clip, 0))}, ["CONDITIONING"], title="negative (unused at cfg 1)"
    )
    if s.image_node is not None:  # the image-to-video teacher's own node makes the latent (and conditioning)
        pos, neg, latent = _first_frame(g, s, positive, negative, vae)
    else:
        pos, neg = (positive, 0), (negative, 0)
        latent = (g.add("EmptyHunyuanLatentVideo", [s.width, s.height, s.frames, 1], {}, ["LATENT"]), 0)
    models = _models(g, files, s, loras, under)
    conditioning = {"positive": ("CONDITIONING", pos), "negative": ("CONDITIONING", neg)}
    if s.scheduler == MANUAL:
        sampled = _manual(g, s, models, pos, latent)
    elif len(models) == 1:
        sampled = g.add(
            "KSampler",
            [0, "fixed", s.steps, 1.0, s.sampler, s.scheduler, 1.0],
            {"model": ("MODEL", (models[0], 0)), **conditioning, "latent_image": ("LATENT", latent)},
            ["LATENT"],
        )
    else:
        split = switch_step(s)
        high = g.add(
            "KSamplerAdvanced",
            ["enable", 0, "fixed", s.steps, 1.0, s.sampler, s.scheduler, 0, split, "enable"],
            {"model": ("MODEL", (models[0], 0)), **conditioning, "latent_image": ("LATENT", latent)},
            ["LATENT"],
            title="high noise",
        )
        sampled = g.add(
            "KSamplerAdvanced",
            ["disable", 0, "fixed", s.steps, 1.0, s.sampler, s.scheduler, split, 10000, "disable"],
            {"model": ("MODEL", (models[1], 0)), **conditioning, "latent_image": ("LATENT", (high, 0))},
            ["LATENT"],
            title="low noise",
        )
    image = g.add("VAEDecode", [], {"samples": ("LATENT", (sampled, 0)), "vae": ("VAE", (vae, 0))}, ["IMAGE"])
    # A clip: one animated file (core's SaveAnimatedWEBP: prefix, fps, lossless, quality, method); an image: SaveImage.
    saved = ["wandistiller", float(FPS), False, 90, "default"] if s.frames > 1 else ["wandistiller"]
    g.add("SaveAnimatedWEBP" if s.frames > 1 else "SaveImage", saved, {"images": ("IMAGE", (image, 0))}, [])
    return g.workflow()


def _first_frame(g: _Graph, s: Sampling, positive: int, negative: int, vae: int) -> tuple[Slot, Slot, Slot]:
    """The first frame given as the student's teacher takes it (comfy_extras/nodes_wan.py): LoadImage, then
    WanImageToVideo (its conditioning and empty latent; Wan 2.1 I2V's CLIP tokens through CLIPVisionEncode, crop
    "none" as ComfyUI's Wan 2.1 example) or Wan22ImageToVideoLatent (the latent alone; TI2V 5B's text-to-video
    workflow: no image). Returns (positive, negative, latent) slots for the sampler. Both nodes take width, height,
    length and batch size as widgets, and resize the image to width x height themselves."""
    size = [s.width, s.height, s.frames, 1]
    image = None
    if s.first_frame:
        image = g.add("LoadImage", [FIRST_FRAME, "image"], {}, ["IMAGE", "MASK"], title="the first frame")
    if s.image_node == WAN22_I2V:
        inputs = {"vae": ("VAE", (vae, 0))} | ({"start_image": ("IMAGE", (image, 0))} if image else {})
        return (positive, 0), (negative, 0), (g.add(WAN22_I2V, size, inputs, ["LATENT"]), 0)
    assert image is not None
    inputs = {
        "positive": ("CONDITIONING", (positive, 0)),
        "negative": ("CONDITIONING", (negative, 0)),
        "vae": ("VAE", (vae, 0)),
    }
    if s.clip_vision:
        loader = g.add("CLIPVisionLoader", [CLIP_VISION], {}, ["CLIP_VISION"])
        encoded = g.add(
            "CLIPVisionEncode",
            ["none"],
            {"clip_vision": ("CLIP_VISION", (loader, 0)), "image": ("IMAGE", (image, 0))},
            ["CLIP_VISION_OUTPUT"],
        )
        inputs["clip_vision_output"] = ("CLIP_VISION_OUTPUT", (encoded, 0))
    inputs["start_image"] = ("IMAGE", (image, 0))
    node = g.add(WAN_I2V, size, inputs, ["CONDITIONING", "CONDITIONING", "LATENT"])
    return (node, 0), (node, 1), (node, 2)


def _manual(g: _Graph, s: Sampling, models: list[int], positive: Slot, latent: Slot) -> int:
    """The trained sigmas set exactly with core nodes: ManualSigmas -> SamplerCustomAdvanced (KSamplerSelect euler,
    BasicGuider: cfg 1, RandomNoise); a pair splits them (SplitSigmas) at the boundary step, the low-noise expert
    continuing the high-noise one's latent without new noise (DisableNoise). Returns the sampled latent's node."""
    assert s.sigmas is not None
    sigmas = g.add("ManualSigmas", [sigmas_text(s.sigmas)], {}, ["SIGMAS"], title="the student's trained sigmas")
    sampler = g.add("KSamplerSelect", [s.sampler], {}, ["SAMPLER"])
    noise = g.add("RandomNoise", [0, "fixed"], {}, ["NOISE"])
    guiders = [
        g.add(
            "BasicGuider", [], {"model": ("MODEL", (m, 0)), "conditioning": ("CONDITIONING", positive)}, ["GUIDER"]
        )  # fmt: skip
        for m in models
    ]
    parts = [(sigmas, 0)]
    if len(models) == 2:
        split = g.add("SplitSigmas", [switch_step(s)], {"sigmas": ("SIGMAS", (sigmas, 0))}, ["SIGMAS", "SIGMAS"])
        parts = [(split, 0), (split, 1)]
    source = latent
    for i, (guider, part) in enumerate(zip(guiders, parts)):
        if i == 1:
            noise = g.add("DisableNoise", [], {}, ["NOISE"])
        node = g.add(
            "SamplerCustomAdvanced",
            [],
            {
                "noise": ("NOISE", (noise, 0)),
                "guider": ("GUIDER", (guider, 0)),
                "sampler": ("SAMPLER", (sampler, 0)),
                "sigmas": ("SIGMAS", part),
                "latent_image": ("LATENT", source),
            },
            ["LATENT", "LATENT"],
            title=None if len(models) == 1 else ("high noise", "low noise")[i],
        )
        source = (node, 0)
    return source[0]


def workflow_text(
    files: list[str],
    s: Sampling,
    prompt: str | None = None,
    loras: list[str] | None = None,
    under: list[list[tuple[str, float]]] | None = None,
) -> str:
    return json.dumps(workflow(files, s, s.prompt if prompt is None else prompt, loras, under), indent=2) + "\n"


def readme(files: list[str], workflow_file: str, s: Sampling, exact: str, warning: str | None) -> str:
    """The README's ComfyUI section: where each file goes, the sampler settings, what the workflow does.
    `exact`: the student's own schedule in words (a few-step student's sigmas); `warning`: the line on shapes a
    guessing loader gets wrong, if any."""
    rows = [(f, "this export", FOLDERS["diffusion_model"]) for f in files]
    return _section(rows, workflow_file, s, exact, warning, "The two files are Wan 2.2 A14B's experts")


def lora_readme(
    loras: list[str], models: list[str], known: bool, teacher: str, workflow_file: str, s: Sampling, exact: str
) -> str:
    """A LoRA student's ComfyUI section: its files into models/loras, the teacher's own diffusion model files
    (`models`; `known`: their usual names, else placeholders to rename) into models/diffusion_models."""
    which = "its usual name" if known else "rename the workflow's to your file of it, in the Wan layout"
    rows = [(f, "this export", FOLDERS["lora"]) for f in loras]
    rows += [(m, f"the teacher {teacher}'s diffusion model ({which})", FOLDERS["diffusion_model"]) for m in models]
    intro = (
        "The adapters go on the teacher's own diffusion model: LoraLoaderModelOnly at strength 1 (the scale they "
        "were trained at), then the sampler below."
    )
    return _section(rows, workflow_file, s, exact, None, "The two LoRA files adapt Wan 2.2 A14B's experts", intro)


def _section(
    rows: list[tuple[str, str, str]],
    workflow_file: str,
    s: Sampling,
    exact: str,
    warning: str | None,
    pair_subject: str,
    intro: str = "",
) -> str:
    where = "\n".join(f"| `{f}` | {source} | `{folder}/` |" for f, source, folder in rows)
    pair = (
        (
            f"\n{pair_subject}: the high-noise one samples the steps whose timestep is at "
            f"or above {s.boundary * 1000:.0f}, the low-noise one the rest ("
            + ("SplitSigmas and two SamplerCustomAdvanced" if s.scheduler == MANUAL else "two KSamplerAdvanced")
            + f", switching at step {switch_step(s)} of {s.steps}).\n"
        )
        if s.boundary is not None
        else ""
    )
    caution = f"\n**Note:** {warning}\n" if warning else ""  # first: it can undo the rest
    text_dir, vae_dir = FOLDERS["text_encoder"], FOLDERS["vae"]
    schedule = (
        "the trained sigmas set by ManualSigmas (SamplerCustomAdvanced, BasicGuider)"
        if s.scheduler == MANUAL
        else f"scheduler `{s.scheduler}`, ModelSamplingSD3 shift {s.shift:g}"
    )
    intro = f"{intro}\n" if intro else ""
    vision = (
        f"| `{CLIP_VISION}` | the teacher's CLIP ViT-H/14 image encoder ({REPACKAGED}) "
        f"| `{FOLDERS['clip_vision']}/` |\n"
        if s.clip_vision
        else ""
    )
    frames = f"{s.frames} frames (saved as an animated WEBP at {FPS} fps)" if s.frames > 1 else "1 frame"
    given = ""
    if s.first_frame:
        given = (
            f"The clip's first frame is your image: pick it in the workflow's Load Image node (`{FIRST_FRAME}` is a "
            f"placeholder); {s.image_node} resizes it to {s.width}x{s.height} and gives it as the teacher's own "
            "pipeline does" + (", its CLIP image tokens through CLIPVisionEncode" if s.clip_vision else "") + ".\n"
        )
    elif s.image_node is not None:
        given = f"No first frame: {s.image_node} without a start image makes the clip from the prompt alone.\n"
    return f"""## In ComfyUI
{caution}
Put the files where ComfyUI looks for them, then drop `{workflow_file}` on ComfyUI's canvas:

| file | from | into |
|---|---|---|
{where}
| `{TEXT_ENCODER}` (or `umt5_xxl_fp16`) | the teacher's umT5-XXL text encoder ({REPACKAGED}) | `{text_dir}/` |
| `{s.vae}` | the teacher's Wan VAE ({REPACKAGED}) | `{vae_dir}/` |
{vision}
{intro}{given}Sampler settings: **{s.steps} steps, cfg 1** (the student was distilled from guided targets: no CFG),
sampler `{s.sampler}`, {schedule}, {s.width}x{s.height}, {frames}.
{exact}
{pair}"""
