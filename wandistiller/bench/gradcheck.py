"""`grad-check`: on this machine, a few LoRA steps through the teacher held whole on the device and through the same
teacher streamed block by block (`offload`'s host copy, `disk`'s files), comparing the adapters' gradients step by
step. One verdict line: PASS (bit for bit), CLOSE (not bit for bit, but every adapter's gradient within a cosine of
0.9999) or FAIL (exit 1). A block swap that silently corrupts gradients has happened in another trainer unnoticed;
this says, where the user trains, that the streamed backward (placements/streaming.py: each block streamed in again
and recomputed) gives the gradients the resident teacher does.

    python -m wandistiller.bench grad-check [OVERRIDES...] [--steps 3] [--resident-blocks 1] [--rank 4]

OVERRIDES are the train job's (`teacher=wan2.1_t2v_14b`, `teacher.path=...`, `teacher.quantize=fp8`,
`precision=bf16`): the teacher and its settings as a run would load them. Each placement loads, runs its steps and
is freed before the next, so the peak is one teacher; the resident one must fit the device (a GPU's `gpu`
placement, else the CPU's `cpu`): a 14B in bf16 needs a 40+ GiB GPU, in fp8 a 24 GiB one; any teacher fits the
CPU's RAM if it fits at all (slow, but a step at 8x8 latents is ~3 forwards).

The same steps everywhere: adapters of rank `--rank` on every adapted Linear of every expert (teacher/lora.py), B
drawn at random (so A gets a gradient too), a seeded latent and prompt per step with one sample per expert, loss =
mean square of the adapted velocity, then an AdamW step of the adapters on their own gradients.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from wandistiller.bench import out_path
from wandistiller.compose import register_configs
from wandistiller.core.arch import Layout
from wandistiller.core.distributed import Topology, local_device
from wandistiller.core.errors import UserError
from wandistiller.core.hydra import auto_precision, compose_config
from wandistiller.core.precision import Precision
from wandistiller.job.checks import name_the_teacher
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.placements.disk import DiskPlacement
from wandistiller.placements.gpu import GpuPlacement
from wandistiller.placements.offload import OffloadPlacement
from wandistiller.teacher.fastpaths import check_quantize
from wandistiller.teacher.lora import Adapters
from wandistiller.teacher.spec import inspect_teacher, resolve_teacher_path

CLOSE = 0.9999  # the smallest cosine per adapter tensor a CLOSE verdict allows (bf16 reductions in another order)
# The largest relative difference of a gradient's norm a CLOSE verdict allows: a cosine ignores scale, so a gradient
# accumulated twice, or one that lost its alpha/rank factor, would otherwise read as CLOSE.
NORM = 1e-3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="the train job's overrides: teacher=..., teacher.quantize=fp8")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--resident-blocks", type=int, default=1, help="blocks the streamed teachers keep resident")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--latent-height", type=int, default=8)
    parser.add_argument("--latent-width", type=int, default=8)
    parser.add_argument("--out", default=out_path("grad-check"))


def adapted_steps(teacher, steps: int, rank: int, latent: tuple[int, int]) -> list[dict[str, torch.Tensor]]:
    """The adapters' gradients (name -> float32 on the CPU) of each of `steps` LoRA steps through `teacher`."""
    device, config = teacher.device, teacher.spec.transformer_config
    adapters = [Adapters(e, rank, torch.float32, seed=k) for k, e in enumerate(teacher.experts)]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for a in adapters:
            for p in a.up.values():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    params = [p for a in adapters for p in a.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    experts = len(teacher.experts)
    grads = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(experts, config["in_channels"], 1, *latent, generator=g).to(device, teacher.dtype)
        cond = torch.randn(experts, 16, config["text_dim"], generator=g).to(device, teacher.dtype)
        # one sample per expert, each in the middle of the timesteps its expert serves (WanPipeline's boundary)
        boundary = teacher.spec.boundary_timestep if experts > 1 else None
        middles = [(boundary + 999.0) / 2, boundary / 2] if boundary is not None else [500.0]
        t = torch.tensor([m + step for m in middles], device=device)
        which, loss = teacher.expert_index(t), torch.zeros((), device=device)
        for k, expert in enumerate(teacher.experts):
            rows = (which == k).nonzero().flatten()
            if not rows.numel():
                continue
            with adapters[k].active():
                v = expert(hidden_states=x[rows], timestep=t[rows], encoder_hidden_states=cond[rows],
                           return_dict=False)[0]  # fmt: skip
            loss = loss + v.float().square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grads.append({f"{k}.{n}": p.grad.float().cpu() for k, a in enumerate(adapters) for n, p in a.named_parameters()
                      if p.grad is not None})  # fmt: skip
        optimizer.step()
    return grads


def agreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """`got`'s cosine to `want`, or -1 (a FAIL) where a cosine would hide the fault: a value that is not finite
    (NaN compares false against every threshold), or a norm more than NORM off `want`'s."""
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return -1.0
    norm_got, norm_want = float(got.norm()), float(want.norm())
    if abs(norm_got - norm_want) > NORM * max(norm_want, torch.finfo(torch.float32).tiny):
        return -1.0
    return float(F.cosine_similarity(got.flatten(), want.flatten(), dim=0))


def compare(reference: list[dict], streamed: list[dict]) -> dict:
    """How `streamed`'s gradients of each step differ from `reference`'s: identical (bit for bit), the largest
    absolute difference, the smallest cosine and where it is."""
    identical, worst, low, where = True, 0.0, 1.0, ""
    for step, (want, got) in enumerate(zip(reference, streamed, strict=True)):
        if got.keys() != want.keys():
            return {"identical": False, "max_abs_diff": float("inf"), "min_cosine": -1.0,
                    "where": f"step {step}: other adapters got a gradient"}  # fmt: skip
        for name, w in want.items():
            gr = got[name]
            worst = max(worst, float((gr - w).abs().max()))
            same = torch.equal(gr, w)  # (a cosine of a tensor with itself rounds below 1)
            cosine = 1.0 if same else agreement(gr, w)
            identical &= same
            if cosine < low:
                low, where = cosine, f"step {step}, {name}"
    return {"identical": identical, "max_abs_diff": worst, "min_cosine": low, "where": where}


def verdict(found: dict[str, dict], reference: str, tensors: int, steps: int, kept: int) -> tuple[bool, str]:
    """(ok, the one line) from `compare`'s result per streamed placement (`kept`: the blocks each kept resident)."""
    names = f"{' and '.join(found)} ({kept} block(s) resident, the rest streamed)"
    failed = {n: r for n, r in found.items() if not r["identical"] and r["min_cosine"] < CLOSE}
    if failed:
        detail = "; ".join(f"{n}: cosine {r['min_cosine']:.4f} at {r['where']}" for n, r in failed.items())
        return False, (
            f"grad-check: FAIL: the adapters' gradients through the streamed teacher ({', '.join(failed)}) are not "
            f"the resident teacher's ({reference}): {detail}"
        )
    what = f"{steps} LoRA steps, {tensors} adapter tensors: {names} vs the resident teacher ({reference})"
    if all(r["identical"] for r in found.values()):
        return True, f"grad-check: PASS: {what}: bit for bit"
    worst = min(r["min_cosine"] for r in found.values())
    return True, f"grad-check: CLOSE: {what}: not bit for bit, every gradient within cosine {worst:.6f} (>= {CLOSE})"


# The overrides grad-check reads (the teacher as a run loads it); the rest of a run's it sets by its own flags.
USED = ("teacher", "precision", "paths")
FLAGS = {
    "teacher_placement": "its placements are fixed (the resident teacher vs offload and disk: --resident-blocks N)",
    "student": "its adapters' rank is --rank N",
    "data": "its latents' size is --latent-height / --latent-width",
    "trainer": "its steps are --steps N",
}


def check_overrides(overrides: list[str]) -> None:
    """Only the overrides it reads, each other one refused in one line naming its flag: a `student.rank=16` or
    `teacher_placement.resident_blocks=0` was dropped without a word, and the verdict was of another check."""
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        group = key.split(".", 1)[0].split("@", 1)[0]
        if group not in USED:
            how = FLAGS.get(group, "it loads the teacher alone")
            raise UserError(
                f"grad-check: {override} is not read: it takes the teacher's overrides alone (teacher=..., "
                f"teacher.*, precision=..., paths.cache_dir=...), and {how}"
            )


def run(args: argparse.Namespace) -> dict:
    register_configs()
    check_overrides(list(args.overrides))
    cfg = compose_config(list(args.overrides))
    name_the_teacher(cfg)
    device = local_device(Topology())
    precision = Precision.from_config(auto_precision(cfg.precision))
    check_quantize(cfg.teacher.quantize, device, precision.teacher_dtype)  # before anything loads: one line
    spec = inspect_teacher(resolve_teacher_path(cfg.teacher, cfg.paths.cache_dir))
    if spec.layout == Layout.i2v:  # its inputs here are noise and text: no first-frame mask, image latents or tokens
        raise UserError(
            f"grad-check: teacher {cfg.teacher.name} is an image-to-video model, and grad-check feeds text-to-video "
            "inputs; check the streaming on a text-to-video teacher of the same size and placement instead"
        )
    blocks = int(spec.transformer_config["num_layers"])
    if args.resident_blocks >= blocks:  # nothing streamed: a PASS would check nothing
        raise UserError(
            f"grad-check: --resident-blocks={args.resident_blocks} keeps all {blocks} blocks of teacher "
            f"{cfg.teacher.name} resident, so nothing is streamed and nothing checked; give --resident-blocks below "
            f"{blocks} (0: every block streamed)"
        )
    resident = GpuPlacement() if device.type == "cuda" else CpuPlacement()
    reference_name = "gpu" if device.type == "cuda" else "cpu"
    cache = Path(cfg.paths.cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="grad-check-", dir=cache))  # disk's converted copy (if any), then gone
    try:
        placements = {
            reference_name: resident,
            "offload": OffloadPlacement(resident_blocks=args.resident_blocks),
            "disk": DiskPlacement(resident_blocks=args.resident_blocks, offload_dir=str(scratch)),
        }
        grads = {}
        for name, placement in placements.items():
            teacher = placement.load(spec, cfg.teacher, precision, Topology())
            grads[name] = adapted_steps(teacher, args.steps, args.rank, (args.latent_height, args.latent_width))
            del teacher
            gc.collect()  # one teacher at a time
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    reference = grads.pop(reference_name)
    found = {name: compare(reference, g) for name, g in grads.items()}
    ok, line = verdict(found, reference_name, len(reference[0]), args.steps, args.resident_blocks)
    print(line)
    return {
        "teacher": str(spec.path),
        "quantize": cfg.teacher.quantize,
        "device": str(device),
        "steps": args.steps,
        "resident_blocks": args.resident_blocks,
        "rank": args.rank,
        "placements": found,
        "ok": ok,
        "verdict": line,
    }


def check(args: argparse.Namespace) -> None:
    if args.resident_blocks < 0:
        raise UserError(f"--resident-blocks={args.resident_blocks} must be 0 or more (0: every block streamed)")
    if args.rank < 1:
        raise UserError(f"--rank={args.rank} must be 1 or more")
