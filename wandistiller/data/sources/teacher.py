"""`data.latents=teacher` (`data=teacher_latents`): x0 = clean latents the teacher samples itself from the
training prompts (its own scheduler, guidance and experts), made once before training by the rank(s) that
hold a teacher, cached under `paths.cache_dir/teacher_latents/<key>/` in chunks, read back by the others."""

from __future__ import annotations

from dataclasses import dataclass

from wandistiller.config import DataCommon
from wandistiller.core.distributed import made_once
from wandistiller.core.registry import Option
from wandistiller.data.latents import SamplerSettings, latents_folder, load_latent_bank, teacher_latents
from wandistiller.data.sources.base import DataSource, Made, own_name
from wandistiller.teacher.model import guidance_scales
from wandistiller.teacher.spec import NUM_TRAIN_TIMESTEPS

OwnName = own_name("teacher", __name__)


@dataclass
class TeacherLatentsConfig(DataCommon):
    latents: OwnName = OwnName.teacher  # type: ignore[valid-type,attr-defined]  # an Enum made at import: its members are unseen by mypy
    # Samples the teacher makes per training prompt (distinct noise each), and its sampling steps for them.
    latents_per_prompt: int = 1
    sample_steps: int = 20
    # Latents made per cache chunk: an interrupted run keeps its finished chunks.
    latent_chunk: int = 16


class TeacherLatents(DataSource):
    name = "teacher"
    description = "the teacher's own samples"  # what the model card says the data was
    samples_teacher = True
    ranges = (
        # more than a Wan scheduler's training timesteps only repeats them (and 100000 was hours of sampling)
        (
            "data.sample_steps",
            lambda v: 0 < v <= NUM_TRAIN_TIMESTEPS,
            f"in [1, {NUM_TRAIN_TIMESTEPS}], a Wan scheduler's training timesteps (e.g. 20)",
        ),
        ("data.latents_per_prompt", lambda v: v > 0, "a positive integer"),
        ("data.latent_chunk", lambda v: v > 0, "a positive integer"),
    )

    @classmethod
    def make(cls, ctx, teacher, embeddings, val_embeddings) -> Made:

        d = ctx.data_cfg
        scales = tuple(guidance_scales(ctx.spec, ctx.teacher_cfg))
        settings = SamplerSettings(d.sample_steps, scales, ctx.latent_shape, d.latents_per_prompt)

        def make() -> object:
            return teacher_latents(
                teacher, embeddings, ctx.seed, settings, ctx.cache_dir, d.latent_chunk, progress=ctx.topo.rank == 0
            )

        def read() -> object:
            dtype = ctx.precision.teacher_dtype
            return load_latent_bank(latents_folder(ctx.spec, embeddings, ctx.seed, settings, dtype, ctx.cache_dir))

        return Made(made_once(ctx.topo, make, read, makes=ctx.makes_teacher_data), embeddings, val_embeddings)


OPTION = Option("teacher", TeacherLatentsConfig, TeacherLatents)
