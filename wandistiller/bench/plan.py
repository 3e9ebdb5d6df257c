"""`bench plan`: the planner's predictions beside measured peaks, each placement in a fresh process.

    python -m wandistiller.bench plan --arch tiny --student tiny,small --placements cpu,disk --device cpu
    python -m wandistiller.bench plan --arch 1.3b --student small --batch 16 --placements gpu,offload,disk --device cuda

Each point runs `python -m wandistiller.train … trainer.max_steps=3` as a child process, as a user would.
Host: the child's own VmHWM, read from /proc while it runs (its peak RSS over the whole job: pinned and
/dev/shm pages it touched and mapped safetensors pages included; not ru_maxrss, see `measure`). GPU: the
job's own `gpu*_peak_gib_max` (peak allocated by torch), plus, where nvidia-smi answers, the most the
process held on the card (context and allocator cache included). A benchmark run on purpose, never a timed test.

For 1.3b/14b shapes a diffusers folder with random bf16 weights is written once to --folder (the tiny
teacher's tokenizer, VAE and scheduler; a one-layer text encoder of Wan's width 4096).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from PIL import Image

from wandistiller.bench import CACHE, check_latent, out_path
from wandistiller.compose import register_configs
from wandistiller.core.arch import BENCH_ARCHS, TINY_TEXT_ENCODER, WAN_A14B_I2V, Layout
from wandistiller.core.errors import UserError
from wandistiller.core.hydra import auto_precision, compose_config
from wandistiller.core.plugins import conf_options
from wandistiller.core.precision import Precision
from wandistiller.job.checks import method_passes
from wandistiller.placements import planner as plan
from wandistiller.placements.memory import Hardware
from wandistiller.placements.streaming import replace_tensor
from wandistiller.teacher.tiny import build_tiny_pipeline, tiny_i2v_pipeline

GiB = 2**30
# Wan 2.2 I2V A14B's layout (two experts; noise, a first-frame mask and the image's latents in), and its tiny twin
# (the same code path on a CPU). Trained on a few random captioned images, each its clip's first frame.
I2V_ARCHS = {"a14b_i2v": WAN_A14B_I2V, "tiny_a14b_i2v": BENCH_ARCHS["tiny"] | dict(in_channels=36)}
ARCHS = BENCH_ARCHS | I2V_ARCHS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=sorted(ARCHS), default="tiny")
    parser.add_argument("--student", default="tiny", help="comma-separated: tiny, small, base")
    parser.add_argument("--batch", default="4", help="comma-separated batch sizes")
    parser.add_argument("--placements", default="cpu,disk", help="comma-separated teacher placements")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--latent", default=None, help="HxW latent size (default: 8x8 tiny, 60x104 otherwise)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="regional torch.compile of teacher and student")
    parser.add_argument("--folder", default=f"{CACHE}/bench_plan", help="random-weight teachers")
    parser.add_argument("--cache-dir", default=None, help="paths.cache_dir for the runs (default: the usual)")
    parser.add_argument("--set", action="append", default=[], help="one more override for every run")
    parser.add_argument("--out", default=out_path("plan"))


def check(args) -> None:
    """The options each point composes, named with their flag (not as a composition error of train's), before any
    teacher is built."""
    if args.latent is not None:  # `0x8` made every row "failed: see the JSON"
        height, _, width = args.latent.partition("x")
        if not (height.isdigit() and width.isdigit()):
            raise UserError(f"--latent={args.latent!r}: use HxW (e.g. 60x104)")
        for side in (height, width):
            check_latent(f"--latent={args.latent}: each side", int(side))
    for flag, group in (("--student", "student"), ("--placements", "teacher_placement")):
        options = conf_options(group)
        unknown = [g for g in getattr(args, flag[2:]).split(",") if g not in options]
        if unknown:
            raise UserError(f"{flag}={unknown[0]!r} is not a {group} option; pick from {', '.join(options)}")


def run(args) -> dict:
    """Every (student, batch, placement) point: prediction, measurement, error; a table last."""

    latent = args.latent or ("8x8" if args.arch.startswith("tiny") else "60x104")
    height, _, width = latent.partition("x")
    if not (height.isdigit() and width.isdigit()) or not all(b.strip().isdigit() for b in args.batch.split(",")):
        raise UserError(f"--latent={latent!r} / --batch={args.batch!r}: use HxW (e.g. 60x104) and sizes like 1,8")
    teacher = _teacher_overrides(args)
    rows = []
    for student in args.student.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            for placement in args.placements.split(","):
                overrides = [
                    *teacher,
                    f"student={student}",
                    f"trainer.batch_size={batch}",
                    f"teacher_placement={placement}",
                    f"data.latent_height={height}",
                    f"data.latent_width={width}",
                    *(compiled(student) if args.compile else []),
                    *(["paths.cache_dir=" + args.cache_dir] if args.cache_dir else []),
                    *args.set,
                ]
                planned = overrides + pinned(overrides)  # the job runs as detected; its plan records what was
                row = {"student": student, "batch": batch, "placement": placement, "overrides": recorded(planned)}
                row |= predict(planned)
                cache_embeddings(overrides)
                row |= measure(overrides, args.steps, args.device)
                rows.append(row | errors(row))
                print(_row_line(row), flush=True)
    result = {"benchmark": "plan", "arch": args.arch, "device": args.device, "compile": args.compile}
    result |= {"date": time.strftime("%Y-%m-%d"), "card": _card(args.device), "rows": rows}
    print(format_rows(result))
    return result


def compiled(student: str) -> list[str]:
    """Regional compile of both models; a LoRA student is the teacher's own blocks, which teacher.compile compiles."""
    return ["teacher.compile=true"] + ([] if student == "lora" else ["trainer.compile_student=true"])


# Overrides that name this machine's folders: a result records the run without them (`recorded`); its random
# teacher's shape comes back from its name (`teacher.name=random_<arch>`: `recorded_teacher`), so a record plans
# again on any machine, no folder at hand.
MACHINE_PATHS = ("teacher.path", "paths.cache_dir", "data.root")
RANDOM = "random_"  # the random-weight teachers' names: random_<arch>


def recorded(overrides: list[str]) -> list[str]:
    """The overrides as a result records them: without this machine's folders (however added: +, ++)."""
    return [o for o in overrides if o.lstrip("+").partition("=")[0] not in MACHINE_PATHS]


def recorded_teacher(overrides: list[str]) -> tuple[dict, int] | None:
    """(transformer config, experts) of the random teacher the overrides name (`teacher.name=random_<arch>`), else
    None (a teacher its config names, or a folder the planner reads)."""
    names = [o.partition("=")[2] for o in overrides if o.lstrip("+").startswith("teacher.name=")]
    arch = names[-1].removeprefix(RANDOM) if names and names[-1].startswith(RANDOM) else None
    return shape_of(arch) if arch in ARCHS else None


def pinned(overrides: list[str]) -> list[str]:
    """What precision=auto and the hardware detection chose here, as overrides: a record plans as it ran, anywhere."""
    register_configs()
    cfg = compose_config(overrides)
    facts = [f"precision={auto_precision(cfg.precision).name}"] if cfg.precision.name == "auto" else []
    if cfg.hardware.gpus is None or cfg.hardware.host_memory_gib is None:
        hw = Hardware.detect(cfg.hardware)
        if cfg.hardware.gpus is None:
            facts.append(f"hardware.gpus={len(hw.gpu_bytes)}")
            facts += [f"hardware.gpu_memory_gib={min(hw.gpu_bytes) / GiB:.4g}"] if hw.gpu_bytes else []
        if cfg.hardware.host_memory_gib is None:  # the planner's floor (0.5 GiB): a busy host's figure may be below
            facts.append(f"hardware.host_memory_gib={max(hw.host_bytes / GiB, 0.5):.4g}")
    return facts


def shape_of(arch: str) -> tuple[dict, int]:
    """(transformer config, experts) of `arch`'s random-weight teacher, as its folder's config.json holds them."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights():
        config = dict(WanTransformer3DModel(**ARCHS[arch]).config)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items() if not k.startswith("_")}, (
        2 if arch in I2V_ARCHS else 1
    )


def predict(overrides: list[str]) -> dict:
    """The planner's per-device prediction for the placement these overrides name, on this machine (a random
    teacher planned from its name's shape: the same as its folder's, and a record has no folder)."""

    register_configs()
    cfg = compose_config(overrides)
    networks = method_passes(cfg).networks
    dtype = Precision.from_config(auto_precision(cfg.precision)).teacher_dtype
    inputs = plan.workload_of(cfg, dtype, networks, ranks=1, teacher=recorded_teacher(overrides))
    assert inputs is not None, "the benchmarks' teachers are built in or known: their configs are at hand"
    w, hw = inputs

    estimate = instantiate(cfg.teacher_placement).estimate(w, hw)
    return {
        "predicted_host_gib": estimate.host_bytes / GiB,
        "predicted_gpu_gib": [b / GiB for b in estimate.gpu_bytes],
        "predicted_fits": estimate.fits,
        "extrapolated": plan.extrapolated(w, hw, estimate.placement),
    }


def cache_embeddings(overrides: list[str]) -> None:
    """Encode the prompts once, in a process of its own, so each measured job reads them from the cache.

    The planner plans the training job; the first run's one-time text encoding (the text encoder loaded,
    then freed) is not what it predicts, and would otherwise count in the first point's peak."""
    code = (
        "import sys, torch\n"
        "from wandistiller.compose import register_configs\n"
        "from wandistiller.core.hydra import auto_precision, compose_config\n"
        "from wandistiller.data.prompts import encode_prompts, read_prompts\n"
        "from wandistiller.core.precision import Precision\n"
        "from wandistiller.teacher.spec import inspect_teacher, resolve_teacher_path\n"
        "from wandistiller.data.validation import split_prompts\n"
        "register_configs()\n"
        "cfg = compose_config(sys.argv[1:])\n"
        "spec = inspect_teacher(resolve_teacher_path(cfg.teacher, cfg.paths.cache_dir))\n"
        "d = cfg.data\n"
        "for prompts in split_prompts(read_prompts(d.prompts_path), d.val_prompts_path, d.val_fraction):\n"
        "    encode_prompts(spec, prompts, cfg.teacher.negative_prompt, cfg.teacher.max_sequence_length,\n"
        "        Precision.from_config(auto_precision(cfg.precision)).teacher_dtype, torch.device('cpu'),\n"
        "        cfg.paths.cache_dir)\n"
    )
    subprocess.run([sys.executable, "-c", code, *overrides], check=True, capture_output=True)


def measure(overrides: list[str], steps: int, device: str) -> dict:
    """One training job in a fresh process: its peak host RSS and its per-GPU peaks."""
    with tempfile.TemporaryDirectory(prefix="bench_plan_") as run_dir:
        cmd = [sys.executable, "-m", "wandistiller.train", *overrides, f"trainer.max_steps={steps}", "logger=none"]
        cmd += ["hooks.samples.prompts=0", "trainer.progress_bar=false", f"hydra.run.dir={run_dir}"]
        cmd += ["hooks.monitor.val_every=0", "~hooks.evaluate"]  # the planner plans training, not evaluation
        log = Path(run_dir) / "stdout.txt"
        with open(log, "w") as out:
            child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
            held = _GpuSampler(child.pid) if device == "cuda" else None
            anon = _AnonSampler(child.pid)
            samplers: list[_GpuSampler | _AnonSampler] = [s for s in (held, anon) if s is not None]
            for sampler in samplers:
                sampler.start()
            _, status, usage = os.wait4(child.pid, 0)
        for sampler in samplers:
            sampler.stop.set()
            sampler.join()
        metrics_file = Path(run_dir) / "metrics.json"
        if os.waitstatus_to_exitcode(status) != 0 or not metrics_file.is_file():
            return {"measured_host_gib": None, "failed": log.read_text()[-2000:]}
        metrics = json.loads(metrics_file.read_text())
    gpus = sorted(k for k in metrics if k.startswith("gpu") and k.endswith("_peak_gib_max"))
    return {
        # The child's own VmHWM, read from /proc until it exits. Not wait4's ru_maxrss: Linux carries the
        # parent's high-water mark over exec into it, so a bench or test process larger than the job shows.
        "measured_host_gib": anon.hwm / 2**20,
        "ru_maxrss_gib": usage.ru_maxrss / 2**20,
        # Without the mapped file pages (reclaimable page cache, e.g. disk's safetensors), sampled every 20 ms.
        "measured_host_anon_shmem_gib": anon.peak / 2**20,
        "measured_gpu_gib": [metrics[k] for k in gpus],
        "measured_gpu_held_gib": held.peak / 1024 if held is not None and held.peak else None,
        "samples_per_s": metrics.get("samples_per_s_median"),
    }


def errors(row: dict) -> dict:
    """(predicted - measured) / measured in percent: positive = the planner asks for more than was used."""
    out = {}
    if row.get("measured_host_gib"):
        out["host_error_pct"] = 100 * (row["predicted_host_gib"] / row["measured_host_gib"] - 1)
        # VmHWM counts mapped file pages (libraries; disk's safetensors pages, which the kernel reclaims as
        # page cache): for a streamed 14B teacher read this error instead.
        if row["measured_host_anon_shmem_gib"]:
            anon = row["measured_host_anon_shmem_gib"]
            out["host_anon_shmem_error_pct"] = 100 * (row["predicted_host_gib"] / anon - 1)
    measured = row.get("measured_gpu_gib") or []
    if measured and row["predicted_gpu_gib"]:
        out["gpu_error_pct"] = 100 * (max(row["predicted_gpu_gib"]) / max(measured) - 1)
    return out


class _GpuSampler(threading.Thread):
    """The most memory nvidia-smi shows a process holding (MiB), sampled every 0.2 s."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, threading.Event()

    def run(self) -> None:
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        while not self.stop.wait(0.2):
            try:
                lines = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.splitlines()
            except (OSError, subprocess.SubprocessError):
                return
            for line in lines:
                pid, _, used = line.partition(",")
                if pid.strip() == str(self.pid) and used.strip().isdigit():
                    self.peak = max(self.peak, int(used))


class _AnonSampler(threading.Thread):
    """A process's VmHWM (KiB, its own peak RSS), and the most anonymous + shared memory it held (pinned and
    /dev/shm buffers, not file pages), read every 20 ms."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.hwm, self.stop = pid, 0, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            try:
                fields = dict(line.split(":", 1) for line in Path(f"/proc/{self.pid}/status").read_text().splitlines())
            except (OSError, ValueError):
                return
            kib = [int(fields[k].split()[0]) for k in ("RssAnon", "RssShmem") if k in fields]
            self.peak = max(self.peak, sum(kib))
            self.hwm = max(self.hwm, int(fields.get("VmHWM", "0 kB").split()[0]))


def _teacher_overrides(args) -> list[str]:
    if args.arch == "tiny":
        return ["teacher=tiny"]
    folder = Path(args.folder).expanduser() / args.arch
    if args.device == "cuda" and not (folder / "model_index.json").is_file():  # drawn on the GPU, in a child: this
        code = "import sys; from pathlib import Path; from wandistiller.bench.plan import ensure_random_teacher as e; "
        code += "e(sys.argv[1], Path(sys.argv[2]), 'cuda')"  # process holds no CUDA context while the jobs plan
        subprocess.run([sys.executable, "-c", code, args.arch, str(folder)], check=True)
    folder = ensure_random_teacher(args.arch, folder)
    named = [f"teacher.path={folder}", f"teacher.name={RANDOM}{args.arch}"]
    if args.arch not in I2V_ARCHS:
        return ["teacher=wan2.1_t2v_1.3b", *named]
    images = given_images(folder.with_name(folder.name + "_images"))
    return ["teacher=wan2.2_i2v_a14b", *named, "data=image_folder", f"data.root={images}"]


def given_images(folder: Path, count: int = 4) -> Path:
    """`count` captioned 832x480 images (smooth random colours), written once: an image-to-video teacher's data."""
    if folder.is_dir():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for i in range(count):
        corners = torch.rand(1, 3, 2, 2, generator=g)
        pixels = torch.nn.functional.interpolate(corners, size=(480, 832), mode="bilinear", align_corners=True)
        Image.fromarray((pixels[0].permute(1, 2, 0) * 255).byte().numpy()).save(partial / f"image{i}.png")
        (partial / f"image{i}.txt").write_text(f"a scene, colours number {i}, slowly moving")
    partial.rename(folder)
    return folder


def ensure_random_teacher(arch: str, folder: Path, where: str = "cpu") -> Path:
    """A Wan folder of `arch`'s shape with random bf16 weights, written once (renamed into place when whole).

    Only the transformer is full-sized: the tiny teacher's tokenizer, VAE and scheduler, and a one-layer
    text encoder of Wan's width 4096 (so the transformer's text projection keeps its real shape). An image-to-video
    pair (`I2V_ARCHS`): the tiny twin's WanImageToVideoPipeline folder, its second expert hard links to the first's
    files (the same random weights: what is measured is memory and time; 28.6 GB written, not 57). `where`: the
    device that draws the weights (a 14B's draws take ~100 s on one CPU thread, a device call's budget)."""
    if (folder / "model_index.json").is_file():
        return folder
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    i2v = arch in I2V_ARCHS
    pipe = tiny_i2v_pipeline(two_experts=True, layout=Layout.i2v) if i2v else build_tiny_pipeline()
    text = TINY_TEXT_ENCODER | dict(d_model=ARCHS[arch]["text_dim"], num_layers=1)
    pipe.text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(pipe.tokenizer), **text)).eval()
    with init_empty_weights():  # parameters on meta, buffers (rope tables) real: no slow init
        pipe.transformer = WanTransformer3DModel(**ARCHS[arch])
    g = torch.Generator(where).manual_seed(0)
    for name, p in list(pipe.transformer.named_parameters()):
        drawn = torch.randn(p.shape, generator=g, device=where) * 0.02
        replace_tensor(pipe.transformer, name, drawn.to(torch.bfloat16).cpu())
    partial = folder.with_name(folder.name + ".partial")
    pipe.save_pretrained(partial, safe_serialization=True)  # an i2v pair's tiny second expert: replaced below
    if i2v:
        shutil.rmtree(partial / "transformer_2")
        shutil.copytree(partial / "transformer", partial / "transformer_2", copy_function=os.link)
    partial.rename(folder)
    return folder


def _card(device: str) -> str:
    if device != "cuda":
        return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"

    return torch.cuda.get_device_name(0)


def _row_line(r: dict) -> str:
    return f"{r['student']} b{r['batch']} {r['placement']}: " + (
        "failed" if r.get("failed") else f"host {r['measured_host_gib']:.2f} GiB, gpu {r.get('measured_gpu_gib')}"
    )


def format_rows(result: dict) -> str:
    head = f"{'student':<8}{'batch':>6} {'placement':<10}{'host pred':>10}{'meas':>8}{'err%':>7}"
    head += f"{'GPU pred':>10}{'meas':>8}{'err%':>7}{'s/step':>8}  note"
    lines = [f"bench plan: arch {result['arch']} on {result['card']}, compile={result['compile']}", head]
    for r in result["rows"]:
        if r.get("failed"):
            lines.append(f"{r['student']:<8}{r['batch']:>6} {r['placement']:<10} failed: see the JSON")
            continue
        gpu_pred = max(r["predicted_gpu_gib"], default=None)
        gpu_meas = max(r["measured_gpu_gib"], default=None)
        gpu = f"{'-':>10}{'-':>8}{'':7}"
        if gpu_meas:
            gpu = f"{gpu_pred:>10.2f}{gpu_meas:>8.2f}{r['gpu_error_pct']:>+7.1f}"
        rate = r.get("samples_per_s")  # the job's median step, in samples/s
        step = f"{r['batch'] / rate:>8.2f}" if rate else f"{'-':>8}"
        lines.append(
            f"{r['student']:<8}{r['batch']:>6} {r['placement']:<10}{r['predicted_host_gib']:>10.2f}"
            f"{r['measured_host_gib']:>8.2f}{r['host_error_pct']:>+7.1f}"
            + gpu
            + step
            + ("  extrapolated" if r["extrapolated"] else "")
        )
    return "\n".join(lines)
