"""Shared fixtures: the tiny teachers built once per session in a private cache, and Hydra composition."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from wandistiller.compose import register_configs
from wandistiller.config import CONF_DIR
from wandistiller.core.atomic import atomic_write
from wandistiller.core.hydra import auto_precision, experiment_in_place
from wandistiller.core.precision import Precision

ROOT = Path(__file__).resolve().parents[1]
CONF = CONF_DIR
FP32 = Precision("fp32", torch.float32, torch.float32, None)
BF16 = Precision("bf16", torch.bfloat16, torch.float32, torch.bfloat16)
os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
os.environ.setdefault("WANDB_SILENT", "true")
register_configs()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def shared_folder(request) -> Path | None:
    """The folder the xdist workers of this session share (None outside xdist: one process, nothing to share)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return None
    return request.getfixturevalue("tmp_path_factory").getbasetemp().parent


class SharedResult:
    """What another xdist worker of this session computes for all of them, read once it has written it."""

    def __init__(self, path: Path):
        self.path = path

    def result(self, timeout: float = 1200):
        deadline = time.monotonic() + timeout
        while not self.path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path} was never written: the worker computing it stopped")
            time.sleep(0.2)
        ok, value = pickle.loads(self.path.read_bytes())
        if not ok:
            raise RuntimeError(f"the worker computing it failed:\n{value}")
        return value


def once_per_session(request, name: str, submit: Callable[..., Future]) -> Callable[..., Future | SharedResult]:
    """`submit(fn, *args)` for work the whole session needs once (a 2-rank launch): under xdist the first worker to
    ask runs it and leaves its result (pickled, paths and all) for the others, which read it, instead of every
    worker running it again. The result must hold nothing of the worker that made it but files on this machine."""

    def submit_once(fn: Callable, *args) -> Future | SharedResult:
        shared = shared_folder(request)
        if shared is None:
            return submit(fn, *args)
        result = shared / f"{name}.pickle"
        try:
            os.close(os.open(shared / f"{name}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return SharedResult(result)

        def run_and_share():
            try:
                value = fn(*args)
            except BaseException as e:
                atomic_write(result, pickle.dumps((False, "".join(traceback.format_exception(e)))))
                raise
            atomic_write(result, pickle.dumps((True, value)))
            return value

        return submit(run_and_share)

    return submit_once


def _now(fn: Callable, *args) -> Future:
    """`fn(*args)` run here and now, as a done Future."""
    done: Future = Future()
    done.set_result(fn(*args))
    return done


# Long multi-process jobs a test module registers (`@background_job("<fixture name>")`), by that fixture's name.
BACKGROUND_JOBS: dict[str, Callable] = {}


def background_job(fixture: str):
    """Registers `start(request, submit) -> Future` as the background job behind the fixture named `fixture`: it
    starts with the session when a selected test uses that fixture (directly or through another), and the
    fixture returns its result (`job_result`). `start` runs its job with `submit(fn, *args)`: once per session,
    however many xdist workers there are."""

    def register(start: Callable) -> Callable:
        BACKGROUND_JOBS[fixture] = start
        return start

    return register


@pytest.fixture(scope="session", autouse=True)
def session_jobs(request) -> dict[str, Future | SharedResult]:
    """Long multi-process jobs, started in the background as the session starts, that a module's tests wait
    for: they overlap the in-process tests (one pytest thread, one core) instead of holding that thread. A job
    starts only where a selected test uses its fixture; it copies the environment when it starts."""
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="session-job")
    request.addfinalizer(pool.shutdown)  # the session's end waits for every one: none is left running
    wanted = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    return {
        name: start(request, once_per_session(request, name, pool.submit))
        for name, start in BACKGROUND_JOBS.items()
        if name in wanted
    }


def job_result(session_jobs: dict[str, Future | SharedResult], fixture: str):
    """What the background job behind `fixture` returned (waiting for it)."""
    return session_jobs[fixture].result()


@pytest.fixture(autouse=True)
def local_cache(cache_dir, monkeypatch):
    """This machine's cache (what a received run folder uses in place of its sender's) is the session's."""
    monkeypatch.setenv("WANDISTILLER_CACHE", str(cache_dir))


@pytest.fixture(scope="session")
def tiny_path(cache_dir) -> Path:
    from wandistiller.teacher.tiny import ensure_tiny_teacher

    return ensure_tiny_teacher(cache_dir / "teachers" / "tiny-wan-t2v")


@pytest.fixture(scope="session")
def tiny_moe_path(cache_dir) -> Path:
    from wandistiller.teacher.tiny import ensure_tiny_teacher

    return ensure_tiny_teacher(cache_dir / "teachers" / "tiny-wan-t2v-moe", two_experts=True)


def _tiny_twin(cache_dir: Path, builtin: str) -> Path:
    from wandistiller.teacher.tiny import BUILTINS, ensure_tiny_teacher

    return ensure_tiny_teacher(cache_dir / "teachers" / builtin.replace("_", "-"), **BUILTINS[builtin])


@pytest.fixture(scope="session")
def tiny_i2v_path(cache_dir) -> Path:
    """Wan 2.1 I2V's layout: mask + image latents concatenated, CLIP image tokens."""
    return _tiny_twin(cache_dir, "tiny_i2v")


@pytest.fixture(scope="session")
def tiny_i2v_moe_path(cache_dir) -> Path:
    """Wan 2.2 I2V A14B's layout: mask + image latents concatenated, two experts, no image encoder."""
    return _tiny_twin(cache_dir, "tiny_i2v_moe")


@pytest.fixture(scope="session")
def tiny_ti2v_path(cache_dir) -> Path:
    """Wan 2.2 TI2V 5B's layout: a 48-channel VAE, the image's latent in place of the first latent frame."""
    return _tiny_twin(cache_dir, "tiny_ti2v")


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory) -> Path:
    """A random-weight CLIP folder (model, processor, a character vocabulary) as `hf download` of a real one lays it
    out: what `--clip-model DIR` reads."""
    import json

    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    folder = tmp_path_factory.mktemp("clip-vit-tiny")
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in "abcdefghijklmnopqrstuvwxyz0123456789":
        vocab |= {c: len(vocab)} | {f"{c}</w>": len(vocab) + 1}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    size = {"shortest_edge": 32}, {"height": 32, "width": 32}
    tokenizer = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    CLIPProcessor(CLIPImageProcessor(size=size[0], crop_size=size[1]), tokenizer).save_pretrained(folder)
    layers = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    config = CLIPConfig(text_config=dict(vocab_size=len(vocab), **layers),
                        vision_config=dict(image_size=32, patch_size=8, **layers), projection_dim=8)  # fmt: skip
    CLIPModel(config).save_pretrained(folder)
    return folder


@pytest.fixture
def make_cfg(cache_dir, tmp_path, tiny_path, tiny_moe_path):
    """Compose the real config tree as `python -m wandistiller.train` would, with test-sized defaults."""

    def _make(*overrides: str, run_dir: Path | None = None):
        base = [
            f"paths.cache_dir={cache_dir}",
            f"paths.output_dir={run_dir or tmp_path / 'run'}",
            "logger=none",
            "trainer.progress_bar=false",
            "hooks=[monitor,progress]",  # no sample grids, no end-of-run evaluation: a test asks for them by name
            "hooks.monitor.val_every=0",
            "precision=fp32",
        ]
        given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
        key = lambda b: b.split("=", 1)[0]
        # A test's own value wins, and its own list of hooks drops the base's settings of them.
        base = [b for b in base if key(b) not in given and not any(key(b).startswith(f"{g}.") for g in given)]
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            return compose("train", overrides=experiment_in_place(base + list(overrides)))

    return _make


@pytest.fixture
def run_dir(make_cfg, tmp_path) -> Path:
    """Two training steps with a checkpoint at each: a real run folder with `.hydra/`, checkpoints, student/
    (what eval, generate and the run-folder readers are tested on)."""
    from wandistiller.train import run

    folder = tmp_path / "run"
    run(make_cfg("trainer.max_steps=2", "trainer.checkpoint_every=1", run_dir=folder))
    return folder


@pytest.fixture(scope="session")  # one run, whichever modules read it
def finished(tmp_path_factory, cache_dir, tiny_path):
    """One short real run (a checkpoint at each of 2 steps), copied by each test that alters it."""
    from wandistiller.train import run

    folder = tmp_path_factory.mktemp("finished") / "run"
    overrides = [f"paths.cache_dir={cache_dir}", f"paths.output_dir={folder}", "logger=none", "precision=fp32",
                 "trainer.progress_bar=false", "hooks.samples.prompts=0", "hooks.monitor.val_every=0",
                 "~hooks.evaluate", "trainer.max_steps=2", "trainer.checkpoint_every=1"]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        run(compose("train", overrides=overrides))
    return folder


def metrics_steps(run_dir: Path) -> list[dict]:
    """A run's per-step records (`metrics_steps.jsonl`), as the monitor appended them."""
    import json

    return [json.loads(line) for line in (run_dir / "metrics_steps.jsonl").read_text().splitlines()]


def old_shape_loss(pred, target, student_hidden, teacher_hidden, hidden_kd_weight: float = 0.0):
    """A user's loss of the shape before LossInputs (what trainer.loss._target_ may still name)."""
    import torch.nn.functional as F

    velocity = F.mse_loss(pred.float(), target)
    hidden = torch.zeros((), device=pred.device)
    if hidden_kd_weight > 0:
        hidden = F.mse_loss(student_hidden.float(), teacher_hidden.to(pred.device))
    return velocity + hidden_kd_weight * hidden, velocity, hidden


def refused(match: str):
    """`with refused("...")`: the block raises a UserError whose message holds this text, read literally."""
    import re

    from wandistiller.core.errors import UserError

    return pytest.raises(UserError, match=re.escape(match))


def unavailable_compile(why: str):
    """`with unavailable_compile("..."):` torch.compile reported unable to compile here, for this reason (the check
    the placements' adapter refusal reads): a machine without triton or a C++ compiler, on one that has them."""
    from unittest import mock

    return mock.patch("wandistiller.placements.base.compile_unavailable", lambda device: why)


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m wandistiller.train ARGS` in a fresh process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "wandistiller.train", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env={**os.environ, **(env or {})},
        timeout=600,
    )


def fresh_runs(request, commands: dict[str, tuple]) -> dict[str, Future]:
    """A module's fresh-process commands, all started at once in the background, as many together as this
    machine has cores: a test reads its own with `.result()` and asserts on it as if it had run it alone.

    Each is still its own process, as a user runs it; they overlap each other (and the module's in-process
    tests) instead of queueing, since each is one mostly single-threaded interpreter starting up.
    `commands` maps a key to (the test that reads it, argv[, extra environment]); only the selected tests'
    commands start. The environment is copied now, so a test's later monkeypatching never leaks into them.
    """
    wanted = {item.originalname for item in request.session.items if item.module is request.module}
    pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1), thread_name_prefix="fresh-run")
    request.addfinalizer(pool.shutdown)  # the module's end waits for every one: none is left running
    here = session_env(request)
    started = {}
    for key, (test, argv, *env) in commands.items():
        if test in wanted:
            started[key] = pool.submit(
                subprocess.run, argv, capture_output=True, text=True, cwd=ROOT, env=here | (env[0] if env else {}),
                timeout=600,
            )  # fmt: skip
    return started


def session_env(request) -> dict:
    """This environment now, with the session's cache as this machine's (what `local_cache` sets per test)."""
    return dict(os.environ) | {"WANDISTILLER_CACHE": str(request.getfixturevalue("cache_dir"))}


def cli(*args: str, module: str = "wandistiller.train") -> list[str]:
    """The argv of `python -m MODULE ARGS` (what `run_cli` runs), for `fresh_runs`."""
    return [sys.executable, "-m", module, *args]


def spawn(fn, nproc: int, *args):
    """Run `fn(*args)` in `nproc` fresh processes joined in one gloo group (torch's elastic launcher)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex[:8],
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    return elastic_launch(config, fn)(*args)


# Every default-lane check that needs two ranks, by (test module, function): each is called as
# function(paths) on both ranks of one launch (`two_ranks`), in this order, a barrier after each.
TWO_RANK_CHECKS = [
    ("tests.core.test_distributed", "_listening_check"),
    ("tests.core.test_distributed", "_ddp_check"),
    ("tests.core.test_distributed", "_sharded_check"),
    ("tests.recipe.test_targets", "_served_targets_check"),
    ("tests.recipe.test_targets", "_served_image_targets_check"),
    ("tests.recipe.methods.test_dmd", "_lora_ddp_check"),
    ("tests.core.test_stopping", "_agree_check"),
]


def _two_rank_checks(paths: dict) -> dict:
    import importlib

    import torch.distributed as dist

    from wandistiller.core.distributed import Topology, destroy_process_group, init_process_group

    init_process_group(Topology.from_env(), 1.0)  # a check that fails on one rank ends the others' wait in 1 min
    found = {}
    for module, name in TWO_RANK_CHECKS:
        found[name] = getattr(importlib.import_module(module), name)(paths)
        dist.barrier()
    destroy_process_group()
    return found


@pytest.fixture(scope="session")
def two_ranks(request, tiny_path, tiny_moe_path, tiny_i2v_path, cache_dir) -> list[dict]:
    """Each rank's results of every TWO_RANK_CHECKS function, from one launch of two workers (the launcher
    a run uses) that the tests of several modules read: each spawn costs two fresh processes' imports."""
    from omegaconf import OmegaConf

    from wandistiller.core.distributed import launch

    paths = {"tiny": str(tiny_path), "moe": str(tiny_moe_path), "i2v": str(tiny_i2v_path), "cache": str(cache_dir)}
    cfg = OmegaConf.create({"nnodes": 1, "nproc_per_node": 2, "rdzv_endpoint": None, "rdzv_id": None})
    return once_per_session(request, "two_ranks", _now)(launch, _two_rank_checks, (paths,), cfg).result()


def choose(cfg):
    """preflight's placement choice for a composed config, as a single-process job would make it: (placement, the
    planner's table, None before the teacher's config is on disk)."""
    from wandistiller.core.distributed import Topology, World
    from wandistiller.job.checks import built_quietly
    from wandistiller.job.preflight import choose_placement

    precision = Precision.from_config(auto_precision(cfg.precision))
    world = World.of(cfg.distributed, Topology())
    placement, plan = choose_placement(cfg, precision, world, built_quietly(cfg.method))
    return placement, plan and plan.table


def workload(cfg):
    """The planner's workload for a composed config (bf16 teacher): (Workload, Hardware), as a run plans it (the
    method's own networks as it declares them)."""
    from wandistiller.job.checks import method_passes
    from wandistiller.placements.planner import workload_of

    passes = method_passes(cfg)
    return workload_of(cfg, torch.bfloat16, passes.networks)


def workflow_sigmas(workflow: dict) -> list[float] | None:
    """The sigmas an exported workflow sets with ManualSigmas, parsed as ComfyUI's node parses its text (None: it
    samples with KSampler's scheduler): the oracle the export tests hold the trained sigmas to."""
    import re

    for node in workflow["nodes"]:
        if node["type"] == "ManualSigmas":
            return [float(v) for v in re.findall(r"[-+]?(?:\d*\.*\d+)", node["widgets_values"][0])]
    return None


def encode_condition(
    spec, vae, images: list, latent_frames: int, height: int, width: int, encoder=None, processor=None
):
    """The conditioning of `images` (one per sample) as `WanImageToVideoPipeline` computes it: teacher/image.py's
    VAE half (`condition_latents`) and, for a teacher with an image encoder, its CLIP half (`clip_embeds`)."""
    from wandistiller.teacher.image import ImageCondition, clip_embeds, condition_latents

    with torch.no_grad():
        latents = condition_latents(spec.layout, vae, images, latent_frames, height, width)
        embeds = clip_embeds(encoder, processor, images) if spec.image_encoder else None
    return ImageCondition(latents, embeds)
