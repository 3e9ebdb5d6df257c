"""Fit the planner's non-physical terms to measured peaks; write docs/planner_fit.json (data, fit, residuals).

    python scripts/fit_planner.py bench_plan_*.json [--out docs/planner_fit.json]

Inputs: `python -m wandistiller.bench plan` results (host RSS on the CPU grid) and the GPU figures listed in
GPU_DATA below (one H200 and one H100, recorded in docs/PERFORMANCE.md). What is fitted, and how (docs/PLANNER.md):

  - GPU: one factor on the student's physical saved activations, eager, with regional compile, and for a backward
    through the teacher to adapters on it (a LoRA student), each solved from its datum (peak allocated = weights +
    states + factor x activations; the CUDA context is not in it).
  - CPU: bytes per image token and per text token that glibc's heap keeps beyond the physical count (small
    tensors at tiny widths), least squares over the CPU points with the physical count at factor 1.

The printed constants go into wandistiller/placements/memory.py by hand (a test checks they match this file).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from wandistiller.bench.plan import predict, recorded_teacher  # noqa: E402
from wandistiller.placements import memory  # noqa: E402

H200 = ["hardware.gpus=1", "hardware.gpu_memory_gib=139", "hardware.host_memory_gib=1000"]
GPU_1_3B = ["teacher=wan2.1_t2v_1.3b", "student=small", "trainer.batch_size=16", "precision=bf16"]
GPU_1_3B += ["data.latent_height=60", "data.latent_width=104", "teacher_placement=gpu", *H200]
LORA_1_3B = ["teacher=wan2.1_t2v_1.3b", "student=lora", "method=dmd", "method.fake_score=lora", "method.steps=4"]
LORA_1_3B += ["trainer.batch_size=1", "precision=bf16", "data.latent_height=60", "data.latent_width=104"]
LORA_1_3B += ["teacher_placement=gpu", "hardware.gpus=1", "hardware.gpu_memory_gib=80", "hardware.host_memory_gib=114"]
# (ACT_FACTOR key, name, overrides, measured gpu0_peak_gib_max): one H200 (2026-11-26) and one H100 (2026-11-27),
# docs/PERFORMANCE.md; the H100's JSON is docs/planner_data/gpu/h100_lora_1.3b.json
GPU_DATA = [
    ("gpu", "h200 1.3b->small b16 gpu eager", GPU_1_3B, 24.3),
    (
        "gpu_compiled",
        "h200 1.3b->small b16 gpu compiled",
        [*GPU_1_3B, "teacher.compile=true", "trainer.compile_student=true"],
        16.7,
    ),
    ("gpu_adapted", "h100 1.3b lora dmd+lora fake score b1 gpu eager", LORA_1_3B, 8.25),
    # one H200 (2026-11-29): docs/planner_data/gpu/h200_lora_1.3b_compiled.json
    (
        "gpu_adapted_compiled",
        "h200 1.3b lora dmd+lora fake score b1 gpu compiled",
        [*LORA_1_3B, "teacher.compile=true"],
        7.43,
    ),
]


# What a CPU point's name says in its head (the student, batch, placement) or leaves out (the teacher, hardware): its
# other overrides name the rest.
SAID_IN_NAME = ("teacher=", "teacher.", "teacher_placement=", "student=", "trainer.batch_size=", "hardware.")


def cpu_points(files: list[str]) -> list[dict]:
    points = []
    for f in files:
        for r in json.loads(Path(f).read_text())["rows"]:
            if r.get("measured_host_gib"):
                rest = [o.partition("=") for o in r["overrides"] if not o.startswith(SAID_IN_NAME)]
                shape = " ".join(f"{key.rsplit('.', 1)[-1]}={value}" for key, _, value in rest)
                name = f"cpu {r['student']} b{r['batch']} {r['placement']} {shape}"
                points.append({"name": name, "overrides": r["overrides"], "measured_gib": r["measured_host_gib"]})
    return points


def workload(overrides: list[str]):
    import torch

    from wandistiller.compose import register_configs
    from wandistiller.core.hydra import compose_config
    from wandistiller.job.checks import method_passes
    from wandistiller.placements import planner as plan

    register_configs()
    cfg = compose_config(overrides)
    # the method's own networks (dmd's fake score) as it declares them: the gpu_adapted datum trains one
    networks = method_passes(cfg).networks
    return plan.workload_of(cfg, torch.bfloat16, networks, ranks=1, teacher=recorded_teacher(overrides))[0]


def tokens(overrides: list[str]) -> tuple[int, int]:
    """(image tokens, text tokens) per step of a point."""
    w = workload(overrides)
    return w.batch_size * w.tokens, w.batch_size * w.text_tokens


def fit_gpu() -> dict:
    """Each GPU factor from its datum: (measured - everything but the activations) / physical activations."""
    factors = {}
    for key, _, overrides, measured in GPU_DATA:
        w = workload(overrides)
        memory.ACT_FACTOR[key] = 1.0
        physical = memory.student_activation_bytes(w, "gpu")
        # the student's phase is the peak (with a fake score: its states beside, as training_bytes counts them)
        rest = memory.teacher_weight_bytes(w) + memory.student_state_bytes(w) + memory.method_state_bytes(w)
        factors[key] = round((measured * memory.GiB - rest) / physical, 2)
        memory.ACT_FACTOR[key] = factors[key]
    return factors


def fit_cpu(points: list[dict]) -> tuple[int, int]:
    memory.CPU_HEAP_PER_TOKEN = (0, 0)
    rows, residual = [], []
    for p in points:
        rows.append(tokens(p["overrides"]))
        residual.append((p["measured_gib"] - predict(p["overrides"])["predicted_host_gib"]) * memory.GiB)
    (img, txt), *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(residual), rcond=None)
    memory.CPU_HEAP_PER_TOKEN = (max(int(img), 0), max(int(txt), 0))
    return memory.CPU_HEAP_PER_TOKEN


def residuals(points: list[dict]) -> list[dict]:
    out = []
    for p in points:
        pred = predict(p["overrides"])
        got = max(pred["predicted_gpu_gib"]) if p.get("gpu") else pred["predicted_host_gib"]
        out.append(p | {"predicted_gib": round(got, 3), "error_pct": round(100 * (got / p["measured_gib"] - 1), 1)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench_json", nargs="+")
    parser.add_argument("--out", default=str(ROOT / "docs" / "planner_fit.json"))
    args = parser.parse_args()
    cpu = cpu_points(args.bench_json)
    margin, memory.FIT_MARGIN = memory.FIT_MARGIN, 0.0  # fit the terms to the measurements, then plan above them
    gpu = [{"name": n, "overrides": o, "measured_gib": m, "gpu": True} for _, n, o, m in GPU_DATA]
    fitted = {"ACT_FACTOR": {"cpu": 1.0} | fit_gpu(), "CPU_HEAP_PER_TOKEN": list(fit_cpu(cpu))}
    memory.FIT_MARGIN = margin
    table = residuals(gpu + cpu)
    errors = [r["error_pct"] for r in table]
    fitted["FIT_ERROR_PCT"] = int(np.ceil(max(abs(e) for e in errors)))
    fitted["FIT_MARGIN"] = margin
    for r in table:
        got = f"measured {r['measured_gib']:7.3f}  predicted {r['predicted_gib']:7.3f}"
        print(f"{r['name']:<60} {got}  {r['error_pct']:+6.1f}%")
    print("fitted:", json.dumps(fitted))
    result = {"date": time.strftime("%Y-%m-%d"), "method": "docs/PLANNER.md", "fitted": fitted, "points": table}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
