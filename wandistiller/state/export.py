"""A run folder's `pipeline/`: the student transformer beside the teacher's tokenizer, text encoder, VAE and
scheduler, with a model card, which `WanPipeline.from_pretrained` loads in one call. Written at the end of
every run (recipe/outputs.py) and by `python -m wandistiller.pipeline` (its export to a folder of real files).
Files are hard links where the filesystem allows (no extra disk, even for a 14B teacher's 11 GB text encoder);
on another filesystem small files are copied and large ones symlinked (a documented reference).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from wandistiller.core.errors import UserError, human_count

log = logging.getLogger("wandistiller.pipeline")

PIPELINE = "pipeline"
TEACHER_PARTS = ("tokenizer", "text_encoder", "vae", "scheduler")


COPY_LIMIT = 2**30  # larger files that cannot be hard-linked are referenced (symlinked), not copied


def place(src: Path, dst: Path) -> str:
    """`dst` as a hard link to `src` (a Hub cache's symlink followed to its blob); on another filesystem a
    copy, or for a file over COPY_LIMIT (a 14B teacher's text encoder) a symlink: every run would otherwise
    hold its own 11+ GB. The export (`--out`) always writes real files."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.unlink(missing_ok=True)
    real = src.resolve()
    try:
        os.link(real, dst)
        return "linked"
    except OSError:  # another filesystem, or one without hard links
        if real.stat().st_size > COPY_LIMIT:
            os.symlink(real, dst)
            return "referenced"
        shutil.copy2(real, dst)
        return "copied"


def run_pipeline(run_dir: Path, teacher_path: Path) -> Path:
    """`<run>/pipeline/`: the run's final student in the teacher's WanPipeline, with its model card."""
    from wandistiller.core.files import in_run, replace_folder

    student, card = in_run(run_dir, "student"), model_card(run_dir)
    # Written whole into a new folder that takes the old one's place: a received run's `pipeline/` that is a link
    # (or holds links) is replaced, never written through.
    out = replace_folder(run_dir, PIPELINE, lambda tmp: write_pipeline(tmp, teacher_path, student, card))
    log.info("student pipeline: %s (WanPipeline.from_pretrained loads it in one call)", out)
    return out


def write_pipeline(out: Path, teacher_path: Path, student_dir: Path, card: str) -> Path:
    """A WanPipeline folder: `student_dir` as its transformer, the teacher's other parts, `card` as README.md."""
    how = set()
    for part, src in [("transformer", student_dir)] + [(p, teacher_path / p) for p in TEACHER_PARTS]:
        if not src.is_dir():
            raise UserError(f"{src} is missing: the teacher folder has no {part}/; a WanPipeline needs one")
        for file in sorted(f for f in src.rglob("*") if f.is_file()):
            how.add(place(file, out / part / file.relative_to(src)))
    (out / "model_index.json").write_text(json.dumps(model_index(teacher_path), indent=2))
    (out / "README.md").write_text(card)
    if "referenced" in how:  # the folder then depends on the teacher's files staying where they are
        log.info("pipeline %s: the teacher's large files are symlinks to %s (another filesystem); "
                 "python -m wandistiller.pipeline RUN --out DIR writes a self-contained copy", out,
                 teacher_path)  # fmt: skip
    return out


def model_index(teacher_path: Path) -> dict:
    """The teacher's model_index.json, one expert and no boundary: the student is a single transformer."""
    index = json.loads((teacher_path / "model_index.json").read_text())
    return index | {"transformer": ["diffusers", "WanTransformer3DModel"], "transformer_2": [None, None],
                    "boundary_ratio": None}  # fmt: skip


def model_card(run_dir: Path) -> str:
    """README.md for the pipeline: the teacher, the data, the training, the quality figures (metrics.json)."""
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    m = json.loads((run_dir / "metrics.json").read_text()) if (run_dir / "metrics.json").is_file() else {}
    teacher = str(m.get("teacher") or cfg.teacher.path)
    hub_teacher = not Path(teacher).expanduser().exists() and teacher.count("/") == 1
    d, t = cfg.data, cfg.trainer
    data = {"gaussian": "Gaussian x0 (data-free)", "teacher": "the teacher's own samples", "images": "images"}
    source = data.get(str(d.get("latents", "gaussian")), str(d.get("latents")))
    prompts = d.get("prompts_path") or d.get("root") or d.get("dataset") or "the 70 shipped prompts"
    height, width = d.latent_height * 8, d.latent_width * 8  # Wan's VAE: 8x spatial
    figures = [(k, m[k]) for k in ("eval_latent_mse", "eval_psnr", "eval_ssim", "eval_speedup", "val_loss_best")
               if m.get(k) is not None]  # fmt: skip
    rows = "\n".join(f"| `{k}` | {v:.4g} |" for k, v in figures) or "| (no evaluation in this run) | |"
    params = human_count(round(m["student_params_m"] * 1e6)) if "student_params_m" in m else "?"
    front = ["---", "library_name: diffusers", "pipeline_tag: text-to-image", "tags: [wan, distillation]"]
    front += [f"base_model: {teacher}"] if hub_teacher else []
    title = f"# A {params}-parameter text-to-image student of {teacher}"
    return (
        "\n".join([*front, "---", "", title, "", ""])
        + f"""\
Distilled with WanDistiller from the Wan teacher `{teacher}` ({m.get("teacher_experts", "?")} expert(s)): the
student transformer learned the teacher's classifier-free-guided velocity (guidance scale
{cfg.teacher.guidance_scale}), so it samples without CFG. The tokenizer, text encoder, VAE and scheduler
are the teacher's.

| | |
|---|---|
| data | {source}; prompts: {prompts} |
| training | {m.get("steps_run", t.max_steps)} steps, batch {m.get("batch_size", t.batch_size)}, \
precision {m.get("precision", cfg.precision.name)}, seed {cfg.seed} |
| image size | {height}x{width} (latent {d.latent_height}x{d.latent_width}) |

Quality against the teacher (same noise, prompts and sampler; `python -m wandistiller.eval`):

| figure | value |
|---|---|
{rows}

```python
import torch
from diffusers import WanPipeline

pipe = WanPipeline.from_pretrained("PATH_OR_REPO", torch_dtype=torch.float32)
image = pipe("a fox in the snow", guidance_scale=1.0, num_frames=1, height={height}, width={width},
             output_type="pil").frames[0][0]
```
"""
    )
