"""Does distilling on the teacher's own latents give a student closer to its teacher than Gaussian x0?

Two students, same seed, steps and batches, differing only in where x0 comes from, are distilled on the
tiny teacher with the training loop's own pieces (batch_source, LocalTargets, train_loop), then both
sample the held-out prompts from the same noise as the teacher; the eval latent MSE is reported.

    python scripts/compare_data_sources.py [--steps 200] [--json out.json]

The measurement behind docs/data_sources.md: `data=teacher_latents` against Gaussian x0.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf

from wandistiller.core.precision import Precision
from wandistiller.data.batches import BatchSettings, batch_source
from wandistiller.data.latents import SamplerSettings, teacher_latents
from wandistiller.data.prompts import encode_prompts, read_prompts
from wandistiller.data.validation import split_prompts
from wandistiller.recipe.loop import Run, train_loop
from wandistiller.recipe.targets import LocalTargets
from wandistiller.state.runs import as_sampler
from wandistiller.state.sampling import generate
from wandistiller.student.model import build_student
from wandistiller.teacher.model import Teacher, load_expert
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.teacher.tiny import ensure_tiny_teacher
from wandistiller.tracking.loggers import NullTracker

FP32 = Precision("fp32", torch.float32, torch.float32, None)
SHAPE = (16, 1, 8, 8)
STUDENT = OmegaConf.create({"builder": "tiny", "config_path": None, "init": "random"})


def distill(teacher: Teacher, embeddings, bank, steps: int, seed: int, run_dir: Path):
    """The training loop with the default trainer settings; only `bank` (None: Gaussian x0) differs."""
    from diffusers.optimization import get_scheduler

    trainer = OmegaConf.create(
        dict(grad_accum_steps=1, batch_size=4, max_steps=steps, max_grad_norm=1.0, progress_bar=False)
        | dict(log_every=10**9, checkpoint_every=10**9, keep_checkpoints=0)
    )
    torch.manual_seed(seed)
    student = build_student(teacher.spec, **STUDENT).train()
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)
    batches = batch_source(BatchSettings(seed, 4, SHAPE, teacher.spec.flow_shift, 1000, embeddings, latent_bank=bank))
    run = Run(
        model=student,
        targets=LocalTargets(teacher),
        batch_fn=batches,
        optimizer=optimizer,
        lr_scheduler=get_scheduler("cosine", optimizer, num_warmup_steps=10, num_training_steps=steps),
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        ema=None,
        tracker=NullTracker(),
        precision=FP32,
        device=torch.device("cpu"),
        run_dir=run_dir,
    )
    history = train_loop(run, trainer, 0)
    return student.transformer.eval(), history[-1]["loss"]


def compare(cache_dir: Path, steps: int = 200, seed: int = 0, sample_steps: int = 20, per_prompt: int = 4) -> dict:
    spec = inspect_teacher(ensure_tiny_teacher(cache_dir / "teachers" / "tiny-wan-t2v"))
    cpu = torch.device("cpu")
    teacher = Teacher(spec, [load_expert(spec, "transformer", torch.float32)], [5.0], cpu)
    train_prompts, held_out = split_prompts(read_prompts(None), None)
    train_emb = encode_prompts(spec, train_prompts, "", 512, torch.float32, cpu, cache_dir)
    val_emb = encode_prompts(spec, held_out, "", 512, torch.float32, cpu, cache_dir)
    settings = SamplerSettings(sample_steps, (5.0,), SHAPE, per_prompt)
    bank = teacher_latents(teacher, train_emb, seed, settings, cache_dir, progress=False)
    idx = list(range(len(held_out)))
    reference, _ = generate(teacher, val_emb, idx, seed, sample_steps, SHAPE)
    result = {"steps": steps, "seed": seed, "sample_steps": sample_steps, "latents_per_prompt": per_prompt}
    for name, source in (("gaussian", None), ("teacher_latents", bank)):
        with tempfile.TemporaryDirectory() as run_dir:
            student, last_loss = distill(teacher, train_emb, source, steps, seed, Path(run_dir))
        latents, _ = generate(as_sampler(spec, student, cpu), val_emb, idx, seed, sample_steps, SHAPE)
        mse = float(((latents - reference) ** 2).mean())
        result[name] = {"eval_latent_mse": mse, "train_loss_last": last_loss}
    result["ratio"] = result["teacher_latents"]["eval_latent_mse"] / result["gaussian"]["eval_latent_mse"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "wandistiller"))
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--threads", type=int, help="torch CPU threads (1: fastest for tiny models on a busy machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = compare(Path(args.cache_dir), args.steps, args.seed)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
