"""wandistiller/student/lora.py: `student=lora`, the placed teacher plus trainable adapters (one set per expert): its
config is the teacher's; it holds the adapters alone, starts as the teacher and routes each sample to the expert of
its t; what it saves loads through diffusers' `WanPipeline.load_lora_weights` and gives the student's output, and so
do the merged experts eval/generate sample; every method trains it (slow lane: whole runs) with the teacher bit for
bit as loaded, resumes bit for bit; its bad inputs are one line each, before the run folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import FP32, metrics_steps, refused, run_cli, unavailable_compile
from wandistiller.core.distributed import Topology
from wandistiller.core.errors import UserError
from wandistiller.job.preflight import check_lora_placement
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.state.checkpoint import load_checkpoint
from wandistiller.student.lora import (
    WEIGHTS,
    LoraStudent,
    build_lora_student,
    merged_experts,
    read_adapters,
)
from wandistiller.student.model import student_config
from wandistiller.teacher.lora import ATTENTION, FFN, TARGETS, narrowest
from wandistiller.teacher.spec import inspect_teacher

LORA = {
    "builder": "lora",
    "init": "auto",
    "config_path": None,
    "keep_blocks": "auto",
    "rank": 4,
    "alpha": None,
    "layers": "all",
}


def teacher_of(path):
    """A teacher as teacher_placement=cpu loads it (fp32), guidance 1."""
    teacher_cfg = OmegaConf.create({"guidance_scale": 1.0, "guidance_scale_2": None})
    return CpuPlacement().load(inspect_teacher(path), teacher_cfg, FP32, Topology())


def trained(student: LoraStudent, seed: int = 0) -> LoraStudent:
    """Adapters away from their start (B = 0 is the teacher exactly: nothing to tell apart)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return student


def inputs(n: int = 4):
    g = torch.Generator().manual_seed(0)
    t = torch.tensor([950.0, 100.0, 880.0, 300.0])[:n]  # both experts' of a pair (the tiny pair's boundary: 875)
    return torch.randn(n, 16, 1, 8, 8, generator=g), t, torch.randn(n, 512, 32, generator=g)


def lora_run(make_cfg, folder: Path, teacher: str, *overrides: str) -> LoraStudent:
    """A run folder as a LoRA run leaves it, without training: its saved config, and a student/ of trained adapters
    saved as the run's end saves them (the student returned)."""
    cfg = make_cfg(f"teacher={teacher}", "student=lora", "student.rank=2", *overrides, run_dir=folder)
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    spec = inspect_teacher(Path(cfg.teacher.path))
    torch.manual_seed(0)
    lora = cfg.student
    student = trained(
        build_lora_student(spec, teacher=teacher_of(spec.path), rank=lora.rank, alpha=lora.alpha, layers=lora.layers)
    )
    student.save(folder / "student")
    return student


def test_a_lora_students_config_is_the_teachers_and_its_bad_keys_are_one_line_each(tiny_path):
    teacher = inspect_teacher(tiny_path).transformer_config
    config = student_config(OmegaConf.create(LORA), teacher)
    assert config == {k: v for k, v in teacher.items() if not k.startswith("_")}
    widest = narrowest(teacher)  # 32: the tiny teacher's width
    assert widest == 32 and student_config(OmegaConf.create(LORA | {"rank": widest}), teacher) == config
    bad = {
        "rank": (0, "student.rank=0 must be a positive integer"),
        "init": ("teacher", "student.init=teacher with student=lora: a LoRA student is the teacher itself"),
        "config_path": ("x.json", "student.config_path=x.json with student=lora"),
        "keep_blocks": ([0, 1], "student.keep_blocks=[0, 1] with student=lora"),
        "layers": ("mlp", "student.layers=mlp: 'mlp' is not one of all, attention, ffn"),
        "alpha": (-1.0, "student.alpha=-1.0 must be a positive finite number"),
    }
    for key, (value, said) in bad.items():
        with refused(said):
            student_config(OmegaConf.create(LORA | {key: value}), teacher)
    with refused("student.alpha=inf must be a positive finite number"):  # an audit's: it reached the first step
        student_config(OmegaConf.create(LORA | {"alpha": float("inf")}), teacher)
    with refused("student.rank=-2 must be a positive integer"):
        student_config(OmegaConf.create(LORA | {"rank": -2}), teacher)
    with refused(
        "student.rank=33 is wider than the narrowest adapted layer of the teacher (32 features); use student.rank<=32"
    ):
        student_config(OmegaConf.create(LORA | {"rank": 33}), teacher)
    with refused("student.rank=4 is a LoRA student's setting, and student.builder=half; use student=lora"):
        student_config(OmegaConf.create({"builder": "half", "config_path": None, "rank": 4}), teacher)


def test_a_lora_student_holds_the_adapters_alone_starts_as_the_teacher_and_routes_by_expert(tiny_moe_path):
    teacher = teacher_of(tiny_moe_path)
    loaded = [{k: v.clone() for k, v in e.state_dict().items()} for e in teacher.experts]
    student = build_lora_student(teacher.spec, teacher=teacher, rank=4)
    assert student.state_dict() and all(k.startswith("adapters.") for k in student.state_dict())  # no teacher
    assert {k.split(".")[1] for k in student.state_dict()} == {"0", "1"}  # a set per expert
    x, t, cond = inputs()
    expert = lambda i, rows: teacher.experts[i](x[rows], t[rows], cond[rows], return_dict=False)[0]
    with torch.no_grad():
        first, second = expert(0, [0, 2]), expert(1, [1, 3])
    pred, hidden = student(x, t, cond)
    assert hidden is None and torch.equal(pred[[0, 2]], first) and torch.equal(pred[[1, 3]], second)  # B = 0
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    pred.square().mean().backward()
    assert all(p.grad is None for e in teacher.experts for p in e.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in student.named_parameters() if ".up." in n)
    optimizer.step()
    with torch.no_grad():
        moved, _ = student(x, t, cond)
    assert not torch.allclose(moved[[0, 2]], first) and not torch.allclose(moved[[1, 3]], second)
    after = [e.state_dict() for e in teacher.experts]  # the teacher, bit for bit as loaded
    assert all(torch.equal(v, a[k]) for b, a in zip(loaded, after) for k, v in b.items())
    with torch.no_grad():
        assert torch.equal(expert(0, [0, 2]), first)  # its own calls: adapters off


def test_which_layers_are_adapted(tiny_path):
    teacher = teacher_of(tiny_path)
    counts = {}
    for layers in ("all", "attention", "ffn", ["attn1.to_q", "ffn.net.2"]):
        student = build_lora_student(teacher.spec, teacher=teacher, rank=2, layers=layers)
        counts[str(layers)] = len(student.state_dict()) // 2
    assert counts == {
        "all": 4 * len(TARGETS),
        "attention": 4 * len(ATTENTION),
        "ffn": 4 * len(FFN),
        "['attn1.to_q', 'ffn.net.2']": 8,
    }


def test_saved_adapters_load_through_wan_pipeline_and_merged_both_give_the_students_output(
    make_cfg, tmp_path, tiny_moe_path
):
    from diffusers import WanPipeline

    student = lora_run(make_cfg, tmp_path / "run", "tiny_moe", "student.alpha=4")
    folder = tmp_path / "run" / "student"
    assert sorted(p.name for p in folder.iterdir()) == sorted([*WEIGHTS, "adapters.json"])
    (state, meta), _ = read_adapters(folder, 2)
    assert "blocks.0.attn1.to_q.lora_A.weight" in state and meta["r"] == 2 and meta["lora_alpha"] == 4.0
    x, t, cond = inputs()
    with torch.no_grad():
        mine, _ = student(x, t, cond)
    pipe = WanPipeline.from_pretrained(tiny_moe_path)
    pipe.load_lora_weights(str(folder))
    pipe.load_lora_weights(str(folder), weight_name=WEIGHTS[1], load_into_transformer_2=True)
    spec = inspect_teacher(tiny_moe_path)
    merged = merged_experts(
        spec, folder, OmegaConf.create(LORA | {"rank": 2, "alpha": 4.0}), torch.float32, torch.device("cpu")
    )
    with torch.no_grad():
        for rows, i, theirs in (([0, 2], 0, pipe.transformer), ([1, 3], 1, pipe.transformer_2)):
            loaded = theirs(x[rows], t[rows], cond[rows], return_dict=False)[0]
            fused = merged[i](x[rows], t[rows], cond[rows], return_dict=False)[0]
            assert torch.allclose(loaded, mine[rows], atol=1e-5), (i, (loaded - mine[rows]).abs().max())
            assert torch.allclose(fused, mine[rows], atol=1e-5)
            assert not torch.allclose(
                mine[rows], student.teacher[0].experts[i](x[rows], t[rows], cond[rows], return_dict=False)[0]
            )
    # eval and generate read the adapters through the guard: a file linked out of the run folder is refused.
    elsewhere = tmp_path / "elsewhere.safetensors"
    (folder / WEIGHTS[1]).rename(elsewhere)
    (folder / WEIGHTS[1]).symlink_to(elsewhere)
    with pytest.raises(UserError, match=f"{WEIGHTS[1]} leads out of the run folder"):
        read_adapters(folder, 2)


def test_a_placement_that_cannot_backpropagate_and_a_compiled_teacher_are_refused_an_fp8_one_is_not():
    from wandistiller.placements import names_where
    from wandistiller.placements.gpu0 import Gpu0Placement

    cpu, plain = torch.device("cpu"), OmegaConf.create({"quantize": None, "compile": False})
    check_lora_placement(CpuPlacement(), 1, cpu, plain)
    able = " or ".join(names_where(lambda cls: cls.backprop))  # from the registry: whatever can today
    with refused(
        "student=lora backpropagates through the frozen teacher on the training device (cpu), and "
        f"teacher_placement=gpu0 cannot; use a student of its own (student=half), or teacher_placement={able}"
    ):
        check_lora_placement(Gpu0Placement(debug_cpu=True), 1, cpu, plain)
    check_lora_placement(CpuPlacement(), 1, cpu, OmegaConf.create({"quantize": "fp8", "compile": False}))
    compiled = OmegaConf.create({"quantize": None, "compile": True})
    check_lora_placement(CpuPlacement(), 1, cpu, compiled)  # the adapted blocks compile (teacher/lora.py)
    with unavailable_compile("torch.compile is not supported here (Python 3.99+ is not yet supported)"):
        with refused(
            "teacher.compile=true with student=lora compiles the adapted teacher's blocks on cpu, and torch.compile "
            "is not supported here (Python 3.99+ is not yet supported); drop teacher.compile"
        ):
            check_lora_placement(CpuPlacement(), 1, cpu, compiled)


# -- whole runs (slow lane) --------------------------------------------------------------------------------------
FAST = ["student=lora", "student.rank=2", "trainer.batch_size=2", "trainer.log_every=1"]
DMD = ["method=dmd", "method.steps=2", "method.fake_updates=2", "method.fake_score=lora", "method.lora_rank=2"]


@pytest.mark.slow  # three methods' runs
@pytest.mark.parametrize(
    "method",
    [
        ["method=kd"],
        ["method=trajectory", "method.steps=2", "method.teacher_steps=4", "method.noises_per_prompt=1"],
        DMD,
    ],
    ids=["kd", "trajectory", "dmd"],
)
def test_every_method_trains_a_lora_student_and_leaves_the_teacher_bit_for_bit(make_cfg, tmp_path, monkeypatch, method):
    from wandistiller.recipe.distillation import DistillationRecipe
    from wandistiller.train import run

    seen = {}
    setup = DistillationRecipe._setup_student

    def keeping(self):
        student = setup(self)
        seen["teacher"], seen["loaded"] = (
            self.teacher,
            [{k: v.clone() for k, v in e.state_dict().items()} for e in self.teacher.experts],
        )
        return student

    monkeypatch.setattr(DistillationRecipe, "_setup_student", keeping)
    folder = tmp_path / "r"
    # dmd's run also draws its sample grid and evaluates at the end: the teacher with the adapters on (merged, eval).
    hooks = ["hooks=[monitor,progress,samples,evaluate]", "hooks.samples.prompts=1", "hooks.evaluate.limit=1"]
    extra = hooks if method is DMD else []
    summary = run(make_cfg("teacher=tiny_moe", *FAST, *method, *extra, "trainer.max_steps=2", run_dir=folder))
    assert summary["status"] == "completed"
    if extra:
        assert (folder / "samples.png").is_file() and summary["eval_latent_mse"] > 0
    after = [e.state_dict() for e in seen["teacher"].experts]
    assert all(torch.equal(v, a[k]) for b, a in zip(seen["loaded"], after) for k, v in b.items())
    saved = load_checkpoint(folder / "checkpoints" / "step_00000002")
    assert all(k.startswith("adapters.") for k in saved["student"]) and saved["student_identity"]["rank"] == 2
    assert any(v.abs().sum() > 0 for k, v in saved["student"].items() if ".up." in k)  # B trained from zero
    assert (folder / "student" / WEIGHTS[1]).is_file() and (folder / "pipeline" / WEIGHTS[1]).is_file()
    assert all(r["loss"] > 0 for r in metrics_steps(folder))


@pytest.mark.slow  # three runs
def test_a_resumed_lora_student_repeats_an_uninterrupted_run_bit_for_bit(make_cfg, tmp_path):
    from wandistiller.train import run

    args = ["teacher=tiny_moe", *FAST, *DMD, "trainer.checkpoint_every=2"]
    run(make_cfg(*args, "trainer.max_steps=4", run_dir=tmp_path / "whole"))
    run(make_cfg(*args, "trainer.max_steps=2", "trainer.schedule_steps=4", run_dir=tmp_path / "split"))  # cut at 2 of 4
    run(make_cfg(*args, "trainer.max_steps=4", "trainer.resume=auto", run_dir=tmp_path / "split"))
    whole = load_checkpoint(tmp_path / "whole" / "checkpoints" / "step_00000004")
    split = load_checkpoint(tmp_path / "split" / "checkpoints" / "step_00000004")
    for key in whole["student"]:
        assert torch.equal(whole["student"][key], split["student"][key]), key
    fake, fake2 = whole["method"]["fake_score"]["module"], split["method"]["fake_score"]["module"]
    assert all(torch.equal(fake[k], fake2[k]) for k in fake)
    # Another rank or set of layers: one line, before any run folder is touched. In the run's own folder its saved
    # config says so; from its checkpoint into a new folder, the checkpoint's record of the student does.
    before = sorted(p.name for p in (tmp_path / "split").rglob("*"))
    with refused("student.rank=3 (saved 2) disagree"):
        run(make_cfg(*args, "student.rank=3", "trainer.max_steps=6", "trainer.resume=auto", run_dir=tmp_path / "split"))
    checkpoint = tmp_path / "split" / "checkpoints" / "step_00000004"
    for other, said in (
        ("student.rank=3", "this run's is student=lora student.rank=3"),
        ("student.layers=ffn", "student.layers=['ffn.net"),
        ("student=half", "this run's is a student of its own (not student=lora)"),
    ):
        new = tmp_path / other.replace("=", "-")
        with pytest.raises(UserError) as e:
            mine = [a for a in args if not a.startswith("student")] if other == "student=half" else args
            run(make_cfg(*mine, other, "trainer.max_steps=6", f"trainer.resume={checkpoint}", run_dir=new))
        assert str(e.value).startswith(
            f"trainer.resume={checkpoint}: the checkpoint holds student=lora "
            "student.rank=2, student.alpha=None, student.layers=['attn1.to_q'"
        ), str(e.value)
        assert said in str(e.value) and not new.exists(), str(e.value)
    assert sorted(p.name for p in (tmp_path / "split").rglob("*")) == before


@pytest.mark.slow  # fresh processes, as a user runs them
def test_bad_lora_input_is_one_line_exit_2_and_writes_nothing(tmp_path, cache_dir):
    base = [f"paths.cache_dir={cache_dir}", "logger=none", "precision=fp32", "student=lora"]
    cases = {
        "rank": (["student.rank=0"], "student.rank=0 must be a positive integer"),
        "wide": (["student.rank=64"], "student.rank=64 is wider than the narrowest adapted layer"),
        "init": (["student.init=teacher"], "student.init=teacher with student=lora"),
        "served": (
            ["teacher_placement=gpu0", "teacher_placement.debug_cpu=true", "distributed.nproc_per_node=2"],
            "student=lora backpropagates through the frozen teacher",
        ),
        "fp8": (["teacher.quantize=fp8"], "teacher.quantize=fp8 computes with a bf16 teacher"),  # precision=fp32
        "fake": (["method=dmd", "method.fake_score=lora", "method.lora_rank=500"], "method.lora_rank=500 is wider"),
        "compile": (["teacher.compile=true"], "its CPU backend finds no working C++ compiler (install g++"),
    }
    no_compiler = {"CXX": str(tmp_path / "no-such-c++")}  # a machine where inductor cannot build for the CPU
    for name, (args, said) in cases.items():
        folder = tmp_path / name
        result = run_cli(f"hydra.run.dir={folder}", *base, *args, env=no_compiler if name == "compile" else None)
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        assert result.returncode == 2 and said in lines[-1] and "Traceback" not in result.stderr, (name, result.stderr)
        assert not folder.exists() or not any(folder.iterdir()), name


def _ddp_check(moe: str) -> list:
    """One rank of two: a LoRA student of the two-expert teacher under the recipe's DDP, rank 0's samples all at the
    first expert (the second's adapters unused there), rank 1's at both. Gradients equal on both ranks, none zero,
    the teacher's none; DDP's parameters the adapters alone."""
    import torch.distributed as dist

    from wandistiller.core.distributed import Topology, destroy_process_group, init_process_group
    from wandistiller.recipe.distillation import wrap_ddp

    init_process_group(Topology.from_env(), 1.0)
    teacher = teacher_of(Path(moe))
    torch.manual_seed(0)
    student = build_lora_student(teacher.spec, teacher=teacher, rank=2)
    model = wrap_ddp(student, torch.device("cpu"), dist.group.WORLD)
    only_adapters = {id(p) for p in model.parameters()} == {id(p) for p in student.adapters.parameters()}
    g = torch.Generator().manual_seed(dist.get_rank())
    t = torch.tensor([950.0, 900.0] if dist.get_rank() == 0 else [950.0, 100.0])
    found = []
    for _ in range(2):
        student.zero_grad(set_to_none=True)
        x, cond = torch.randn(2, 16, 1, 8, 8, generator=g), torch.randn(2, 8, 32, generator=g)
        model(x, t, cond)[0].square().mean().backward()
        grads = torch.cat(
            [p.grad.flatten() for n, p in student.named_parameters() if ".up." in n and p.grad is not None]
        )
        gathered = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, grads)
        found += [bool(torch.equal(gathered[0], x)) and bool(x.abs().sum() > 0) for x in gathered]
    frozen = all(p.grad is None for e in teacher.experts for p in e.parameters())
    del model
    destroy_process_group()
    return [only_adapters, all(found), frozen]


@pytest.mark.slow  # two fresh processes over gloo
def test_ddp_averages_a_lora_students_adapters_alone_over_ranks(tiny_moe_path):
    from tests.conftest import spawn

    assert list(spawn(_ddp_check, 2, str(tiny_moe_path)).values()) == [[True, True, True]] * 2
