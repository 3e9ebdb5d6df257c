"""`wandistiller.plan`: its `main()` called in-process on argv as a user types it: the planner's table and its
choice for hardware described on paper, the usage text, and a refusal as one line with exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, cli, fresh_runs, workload
from tests.placements.test_planner import FRAME, HARDWARE
from wandistiller import plan
from wandistiller.placements import memory


def plan_main(monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["python -m wandistiller.plan", *argv])
    plan.main()


def test_the_plan_of_a_14b_teacher_on_one_small_gpu_is_its_table_ending_with_the_choice(monkeypatch, capsys):
    hardware = ["hardware.gpus=1", "hardware.gpu_memory_gib=16", "hardware.host_memory_gib=8"]
    plan_main(monkeypatch, "teacher=wan2.1_t2v_14b", *hardware)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("teacher wan2.1_t2v_14b: 1 expert(s), 26.6 GiB of weights")  # bf16, as on the GPU
    assert lines[1] == "a step of method=kd: 1 teacher call(s) (cond + uncond), 1 student forward + backward"
    assert lines[2] == (
        "precision: bf16 (teacher torch.bfloat16, student torch.float32): precision=auto, as the planned hardware "
        "has GPUs (precision=<fp32|bf16|fp16> plans another)"
    )  # on a CPU-only machine too: the plan is for the GPU, not for this machine (it planned fp32, 2x the weights)
    assert lines[3].startswith("hardware: 1 GPU(s) of 16 GiB free, 8 GiB host RAM available")
    rows = {line.split()[0]: line.split()[1] for line in lines if line.split()[1:2] in (["yes"], ["no"])}
    assert (
        rows["gpu"] == "no" and rows["disk"] == "yes"
    )  # 27 GiB of bf16 weights stream from disk, never all in 8 GiB of RAM
    assert rows.keys() >= {"gpu", "gpu0", "balanced", "sequential", "sharded", "offload", "disk", "cpu"}
    assert lines[-1] == "auto would choose: disk"


def test_the_named_placement_is_planned_with_its_own_settings(monkeypatch, capsys):
    on_paper = [
        "teacher=wan2.1_t2v_14b",
        "hardware.gpus=1",
        "hardware.gpu_memory_gib=80",
        "hardware.host_memory_gib=256",
    ]
    offload = {}
    for resident in ("auto", "0", "3"):
        plan_main(monkeypatch, *on_paper, "teacher_placement=offload", f"teacher_placement.resident_blocks={resident}")
        offload[resident] = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("offload "))
    assert "40/40 blocks resident" in offload["auto"]  # the planner's count: the whole expert fits in 80 GiB
    assert "0/40 blocks resident" in offload["0"] and "3/40 blocks resident" in offload["3"]
    with pytest.raises(SystemExit) as stop:
        plan_main(monkeypatch, *on_paper, "teacher_placement=offload", "teacher_placement.resident_blocks=many")
    assert stop.value.code == 2 and "teacher_placement.resident_blocks='many'" in capsys.readouterr().err
    # The run's row and auto's are each marked as what they are: "<- chosen" was auto's, beside the one asked for.
    plan_main(monkeypatch, *on_paper, "teacher_placement=disk")
    marks = {line.split()[0]: line.split("<- ")[1] for line in capsys.readouterr().out.splitlines() if "<- " in line}
    assert marks == {"gpu": "auto would choose", "disk": "the run's"}, marks


def test_precision_auto_plans_for_the_planned_hardware_not_this_machine(monkeypatch, capsys):
    from wandistiller.core import precision

    monkeypatch.setattr(precision.torch.cuda, "is_available", lambda: True)  # this machine: a GPU one, either way
    plan_main(monkeypatch, "hardware.gpus=0", "hardware.host_memory_gib=64")
    assert "precision: fp32 (teacher torch.float32, student torch.float32): precision=auto, as the planned hardware " \
           "has no GPU" in capsys.readouterr().out  # fmt: skip
    plan_main(monkeypatch, "precision=fp16", "hardware.gpus=1", "hardware.gpu_memory_gib=24")
    out = capsys.readouterr().out.splitlines()
    assert "precision: fp16 (teacher torch.float16, student torch.float32)" in out  # named: as named, nothing added


@pytest.mark.parametrize(
    "override,line",
    [
        ("hardware.gpus=-1", "hardware.gpus=-1 must be in [0, 64] (GPUs per node)"),
        ("hardware.gpu_memory_gib=-40", "hardware.gpu_memory_gib=-40.0 must be in [0, 1024] (GiB of one GPU)"),
        ("hardware.host_memory_gib=0", "hardware.host_memory_gib=0.0 must be in [0.5, 65536]"),
        ("hardware.host_memory_gib=nan", "hardware.host_memory_gib=nan must be in [0.5, 65536]"),
        ("hardware.headroom_gib=-1", "hardware.headroom_gib=-1.0 must be in [0, 1024]"),
    ],
)
def test_every_hardware_number_out_of_its_range_is_one_line_naming_the_key(monkeypatch, capsys, override, line):
    with pytest.raises(SystemExit) as e:
        plan_main(monkeypatch, "hardware.gpus=1", "hardware.gpu_memory_gib=40", override)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: {line}") and err.count("\n") == 1


@pytest.mark.parametrize(
    "args,line",
    [  # issue 41: a traceback, and flags read as overrides whose fix was "a sweep as key=a,b with -m"
        (["~teacher"], "teacher has no value: an override removed it (~teacher?); drop the ~ override"),
        (["-m", "teacher_placement=cpu,gpu"], "-m is not a planner option: it takes train's overrides alone"),
        (["--cfg", "job"], "--cfg is not a planner option: it takes train's overrides alone (key=value), --rigs"),
        (["--write"], "--write is not a planner option"),
    ],
)
def test_a_removed_group_or_a_flag_of_trains_is_one_line(monkeypatch, capsys, args, line):
    with pytest.raises(SystemExit) as e:
        plan_main(monkeypatch, *args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: {line}") and err.count("\n") == 1


def test_a_teacher_given_by_path_is_named_by_its_folder_not_the_default_groups(monkeypatch, capsys):
    from wandistiller.core.hydra import shipped_asset

    plan_main(monkeypatch, f"teacher.path={shipped_asset('pocket/pocket-wan-t2v')}")
    assert capsys.readouterr().out.startswith("teacher pocket-wan-t2v: 1 expert(s)")  # was "teacher tiny"


def test_help_prints_the_usage_without_composing_anything(monkeypatch, capsys):
    plan_main(monkeypatch, "--help", "teacher_placement=nowhere")  # the override is never read
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m wandistiller.plan [OVERRIDE ...]") and "hardware.gpus=N" in out


def test_a_teacher_without_a_local_config_is_one_line_and_exit_code_2(monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        plan_main(monkeypatch, "teacher.builtin=null", f"teacher.path={tmp_path / 'none'}")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err == f"error: teacher.path='{tmp_path / 'none'}': no local config.json to plan from; download it first\n"


def planned(*overrides: str):
    """(workload, estimates by placement, auto's choice) for a 14B teacher and a `student=small` on one 40 GiB GPU."""

    from wandistiller.core.hydra import compose_config
    from wandistiller.job.checks import name_the_teacher
    from wandistiller.placements.planner import choose, plan

    hardware = ["hardware.gpus=1", "hardware.gpu_memory_gib=40", "hardware.host_memory_gib=256"]
    cfg = compose_config(["teacher=wan2.1_t2v_14b", *FRAME, *hardware, *overrides])
    name_the_teacher(cfg)
    found = workload(cfg)
    assert found is not None
    estimates = plan(*found)
    return found[0], {e.placement: e for e in estimates}, choose(estimates)


def test_dmd_plans_its_fake_score_beside_the_student_and_auto_chooses_with_it():
    kd_w, kd, kd_choice = planned()
    dmd_w, dmd, dmd_choice = planned("method=dmd")
    assert kd_w.networks == () and [(n.shape, n.trains) for n in dmd_w.networks] == [(memory.STUDENT_SHAPED, 5)]
    fake_states = memory.param_count(dmd_w.student_config) * 12  # fp32 weights + AdamW's two moments
    for name in ("gpu", "balanced", "sequential", "cpu"):  # the training rank's GPU, larger by the fake score's states
        grown = dmd[name].gpu_bytes[0] - kd[name].gpu_bytes[0]
        assert grown == pytest.approx(fake_states * (1 + memory.FIT_MARGIN), rel=1e-6), name
    # A resident 14B teacher beside the student fits 40 GiB, not with the fake score too: auto streams it.
    assert kd["gpu"].fits and not dmd["gpu"].fits
    assert kd_choice is not None and dmd_choice is not None
    assert (kd_choice.placement, dmd_choice.placement) == ("gpu", "offload")
    teacher_shaped, estimates, choice = planned("method=dmd", "method.fake_score=teacher")
    assert memory.training_bytes(teacher_shaped) > memory.training_bytes(dmd_w) + memory.param_count(
        teacher_shaped.teacher_config) * 12  # fmt: skip
    # Only a whole teacher on the training GPU can start one (DMD.check), and a 14B one does not fit 40 GiB.
    assert [e.placement for e in estimates.values() if e.gpu_bytes] == ["gpu"] and choice is None
    assert estimates["offload"].note == "keeps the teacher off the training device (method.fake_score=teacher)"


def test_the_plan_of_dmd_says_what_it_counts_of_the_fake_score_and_the_passes_of_a_step(monkeypatch, capsys):
    plan_main(monkeypatch, "teacher=wan2.1_t2v_14b", *FRAME, *HARDWARE["1x80GiB"], "method=dmd")
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[1]
        == "fake score (method.fake_score=student: student-shaped, 215M params): its weights, optimizer states "
        "and grads counted on every training rank"
    )
    # K=4 and 5 fake-score updates: 1.5 generation calls per micro-batch + 2.5 per update without grad
    assert (
        lines[2] == "a step of method=dmd: 1 teacher call(s) (cond + uncond), 1 student forward + backward, 14 "
        "student forwards without grad (few-step generations), 5 fake score forward + backward, 1 without grad"
    )
    header = next(line for line in lines if line.startswith("placement"))
    assert "s/step samples/s note" in header


def test_a_lora_fake_score_is_planned_as_its_adapters_and_a_teacher_backward_where_the_teacher_is_here():
    _, teacher_shaped, _ = planned("method=dmd", "method.fake_score=teacher")
    w, estimates, choice = planned("method=dmd", "method.fake_score=lora")
    (fake,) = w.networks
    assert (fake.shape, fake.rank, fake.key) == (memory.ADAPTERS, 16, "method.fake_score=lora")
    # rank 16 x (16 + 2) x 5120 + 2 x 13824 per block, 40 blocks: 76.7M adapters beside 14.3B frozen weights
    assert memory.network_params(w, fake) == 16 * (18 * 5120 + 2 * 13824) * 40
    assert memory.method_state_bytes(w) == memory.network_params(w, fake) * 12
    # Only placements that backpropagate through the teacher on the training GPU: gpu, which on 40 GiB does not fit
    # (a 14B teacher's backward; smaller than a teacher-shaped copy's), and the streamed ones, which recompute each
    # block in backward: auto streams it from RAM.
    assert [e.placement for e in estimates.values() if e.gpu_bytes] == ["gpu", "offload", "disk"]
    assert not estimates["gpu"].fits and choice is not None and choice.placement == "offload"
    assert estimates["gpu"].gpu_bytes[0] < teacher_shaped["gpu"].gpu_bytes[0]
    assert estimates["balanced"].note == (
        "cannot backpropagate through its teacher on the training device (method.fake_score=lora)"
    )


def test_the_plan_of_a_lora_fake_score_says_what_it_counts(monkeypatch, capsys):
    plan_main(monkeypatch, "teacher=wan2.1_t2v_14b", *FRAME, *HARDWARE["1x80GiB"], "method=dmd",
              "method.fake_score=lora", "method.lora_rank=8")  # fmt: skip
    line, passes = capsys.readouterr().out.splitlines()[1:3]
    assert line.startswith(
        "fake score (method.fake_score=lora: LoRA of rank 8 on the teacher's 1 expert(s), 38.3M adapter params): their "
        "weights, optimizer states and grads, and the activations of a teacher-sized backward"
    )
    assert "5 fake score forward + backward, 1 without grad" in passes


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "wandistiller.plan", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module", autouse=True)  # autouse: they start with the module, beside its in-process tests
def plans(request):
    """This module's `python -m wandistiller.plan` runs, started together (each a fresh process)."""
    plan = lambda *args: cli(*args, module="wandistiller.plan")
    return fresh_runs(request, {
        "8x40": ("test_plan_cli_prints_the_table_for_hardware_described_on_paper",
                 plan("teacher=wan2.2_t2v_a14b", *FRAME, *HARDWARE["8x40GiB"])),
        "missing": ("test_plan_cli_names_a_missing_hardware_key_in_one_line",
                    plan("teacher=wan2.1_t2v_14b", "hardware.gpus=8")),
        "headroom": ("test_a_bad_headroom_is_one_line_naming_the_keys", plan("hardware.headroom_fraction=1.5")),
        "1x80": ("test_the_table_shows_its_error_bar_and_marks_extrapolated_figures",
                 plan("teacher=wan2.1_t2v_14b", *FRAME, *HARDWARE["1x80GiB"])),
    })  # fmt: skip


def test_plan_cli_prints_the_table_for_hardware_described_on_paper(plans):
    result = plans["8x40"].result()
    assert result.returncode == 0, result.stderr
    assert "auto would choose: sharded" in result.stdout and "8 GPU(s) of 40 GiB" in result.stdout


def test_plan_cli_names_a_missing_hardware_key_in_one_line(plans):
    # Regression: hardware.gpus without hardware.gpu_memory_gib ended in a TypeError traceback.
    result = plans["missing"].result()
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "hardware.gpu_memory_gib" in result.stderr


@pytest.mark.slow  # several fresh-process CLI runs
def test_plan_cli_has_help_and_refuses_a_bad_override_listing_the_options():
    assert plan_cli("--help").returncode == 0
    result = plan_cli("teacher_placement=nowhere")
    assert result.returncode == 2 and "Traceback" not in result.stderr and "offload" in result.stderr


def test_a_bad_headroom_is_one_line_naming_the_keys(plans):
    result = plans["headroom"].result()
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "hardware.headroom_fraction=1.5" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_rig_short_by_its_own_headroom_is_told_to_lower_it(monkeypatch, capsys):
    # An audit's: hardware.headroom_gib=100 on an 80 GiB GPU was told only to use a GPU with more memory.
    with pytest.raises(SystemExit) as e:
        plan_main(monkeypatch, *HARDWARE["1x80GiB"], "hardware.headroom_gib=100")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "; lower hardware.headroom_gib=100 (memory left free), or use a GPU" in err, err


@pytest.mark.slow  # a whole run: the default lane keeps its 4 minutes
def test_the_table_shows_its_error_bar_and_marks_extrapolated_figures(plans):
    result = plans["1x80"].result()
    assert result.returncode == 0, result.stderr
    assert f"0 to +{memory.FIT_ERROR_PCT}% over the measured peaks" in result.stdout
    gpu_row = next(line for line in result.stdout.splitlines() if line.startswith("gpu "))
    assert "*" in gpu_row  # a 14B teacher is beyond the fitted shapes (a 1.3B-shaped teacher on one GPU)


def test_the_plan_refuses_what_train_refuses_whatever_the_placement(monkeypatch, capsys):
    """A plan train would refuse is no plan: the method's loss, data and whole-step checks run here too."""
    for bad, line in [
        (["method=dmd", "loss=task"], "method=dmd trains with its own loss and ignores trainer.loss"),
        (["method=dmd", "trainer.teacher_whole_step=true"], "trainer.teacher_whole_step=true rebuilds"),
        (["method=trajectory", "data=teacher_latents"], "data.latents=teacher samples the teacher's own latents"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            plan_main(monkeypatch, "teacher=wan2.1_t2v_14b", *FRAME, *HARDWARE["1x80GiB"], *bad)
        assert exit_.value.code == 2 and line in capsys.readouterr().err


def test_the_plan_refuses_what_train_refuses_of_a_local_teacher_and_its_data(monkeypatch, capsys):
    """A plan of frames the teacher's VAE cannot make, past its rope table, or of data it cannot take once said
    "fits" (an audit's find): train's own lines now."""
    for bad, line in [
        (["teacher=pocket", "data.latent_frames=5"], "data.latent_frames=5: the teacher's VAE says"),
        (["teacher=pocket_video", "student=half", "data.latent_frames=33"], "more than the teacher's rope_max_seq_"),
        (["teacher=pocket_i2v", "data.latent_frames=5"], "data.latents=gaussian gives prompts alone, but teacher="),
    ]:
        with pytest.raises(SystemExit) as exit_:
            plan_main(monkeypatch, *bad)
        assert exit_.value.code == 2 and line in capsys.readouterr().err


WAN_81_FRAMES = ["data.latent_frames=21", "data.latent_height=60", "data.latent_width=104", "trainer.batch_size=1"]
LORA_DMD = ["teacher=wan2.1_t2v_14b", "student=lora", "method=dmd", "method.fake_score=lora", "precision=bf16"]


def test_a_clip_plan_says_the_largest_latent_frames_that_fits(monkeypatch, capsys):
    """Wan 2.1 14B, student=lora dmd with a LoRA fake score, one 24 GiB GPU: 81 frames of 480x832 (21 latent
    frames, 32,760 tokens) fit no placement; the plan says how many do (docs/PLANNER.md, "Frames")."""
    plan_main(monkeypatch, *LORA_DMD, "teacher_placement=offload", *HARDWARE["1x24GiB"], *WAN_81_FRAMES)
    lines = capsys.readouterr().out.splitlines()
    assert "batch 1 x 32760 tokens" in lines[0]
    assert lines[-2] == "nothing fits as asked: see the frames that would, below"
    assert lines[-1] == (
        "the largest latent_frames that fits: 18 (= 69 frames) at batch 1 and this frame size (offload, disk); "
        "data.latent_frames=21 does not: use data.latent_frames<=18"
    )
    plan_main(monkeypatch, *LORA_DMD, *HARDWARE["1x24GiB"], *WAN_81_FRAMES[:3], "trainer.batch_size=1",
              "data.latent_frames=5")  # fmt: skip
    last = capsys.readouterr().out.splitlines()[-1]  # the default placement (cpu) cannot train a LoRA: it says so
    assert last.startswith("the largest latent_frames that fits: 18 (= 69 frames)") and "latent_frames=5 fits" in last
    assert last.endswith("; teacher_placement=cpu: not even 1"), last


def test_a_clip_plan_names_no_more_frames_than_the_rope_table_covers(monkeypatch, capsys):
    """The pocket video teacher (and its student) hold 32 rope positions in time: 1024 latent frames of 8x8 fit
    memory, but train refuses past 32, so 32 is the largest the plan names, saying the rope table bounds it."""
    plan_main(monkeypatch, "teacher=pocket_video", "data.latent_frames=5")
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("the largest latent_frames that fits: 32 (= 63 frames) at batch 4"), last
    assert last.endswith(
        ", the limit of the teacher's rope table (rope_max_seq_len=32), not of memory; data.latent_frames=5 fits"
    ), last
    plan_main(monkeypatch, "teacher=pocket_video", "data.latent_frames=32")  # the count named: train takes it
    assert "data.latent_frames=32 fits" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # one more: refused, as train refuses it
        plan_main(monkeypatch, "teacher=pocket_video", "data.latent_frames=33")
    assert (
        e.value.code == 2
        and "more than the teacher's rope_max_seq_len=32; use data.latent_frames<=32" in capsys.readouterr().err
    )


def test_one_frame_plans_no_frames_line(monkeypatch, capsys):
    plan_main(monkeypatch, *LORA_DMD, "teacher_placement=offload", *HARDWARE["1x24GiB"], "trainer.batch_size=1")
    assert "latent_frames" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "override, line",
    [
        ("trainer.batch_size=0", "error: trainer.batch_size=0 must be a positive integer"),
        ("trainer..batch_size=2", "error: trainer..batch_size=2 is not an override Hydra can read"),
        ("hooks=[monitor", "error: hooks=[monitor is not an override Hydra can read"),
        # An audit's: a table was planned for each, where train refuses them
        ("teacher.quantize=int4", "error: teacher.quantize=int4 is unknown; use fp8 or null"),
        ("trainer.optimizer.lr=nan", "error: trainer.optimizer.lr=nan must be a finite number"),
    ],
)
def test_a_value_train_refuses_or_an_override_that_does_not_parse_is_one_line_from_plan(
    monkeypatch, capsys, override, line
):
    with pytest.raises(SystemExit) as e:
        plan_main(monkeypatch, override)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith(line) and "\n" not in err, err


def test_the_plan_holds_offloads_shared_copy_to_dev_shm_and_counts_the_text_encoder_pass(monkeypatch, capsys):
    """On paper /dev/shm is half the RAM (Linux's default): the A14B pair's 52 GiB shared pinned copy (every block
    streamed) does not fit 64 GiB's, and the first run's umT5-XXL pass is a line of its own, with the fix where the
    host cannot hold it."""
    paper = ["teacher=wan2.2_t2v_a14b", "hardware.gpus=2", "hardware.gpu_memory_gib=80", "distributed.nproc_per_node=2"]
    paper += ["teacher_placement=offload", "teacher_placement.resident_blocks=0"]
    plan_main(monkeypatch, *paper, "hardware.host_memory_gib=64")
    out = capsys.readouterr().out
    offload = next(line for line in out.splitlines() if line.startswith("offload"))
    assert "needs its shared pinned copy (52.4 GiB) in /dev/shm, which holds 32.0 GiB" in offload
    assert "teacher_placement.share_host_copy=false" in offload
    assert "text encoder: 10.6 GiB of host RAM while a first run encodes its prompts" in out
    plan_main(monkeypatch, *paper, "hardware.host_memory_gib=8")
    assert "more than this host's 7.4 GiB usable: encode them once on a machine with more RAM" in (
        capsys.readouterr().out
    )


def test_compile_lowers_only_the_activations_of_the_networks_it_compiles():
    """teacher.compile compiles the teacher's blocks and the adapters on them (a LoRA student, a LoRA fake score:
    `gpu_adapted_compiled`, fitted on an H200); trainer.compile_student a cut student's blocks. A network neither
    compiles (dmd's teacher-shaped fake score beside a LoRA student) keeps its eager estimate whatever is compiled."""

    def gpu_peak(*overrides: str) -> float:
        return planned("method=dmd", *overrides)[1]["gpu"].gpu_bytes[0]

    lora = ["student=lora", "method.fake_score=lora"]
    assert gpu_peak(*lora, "teacher.compile=true") < gpu_peak(*lora)  # the adapted blocks compiled
    own = ["student=lora", "method.fake_score=teacher"]
    (shaped,) = [n for n in planned("method=dmd", *own)[0].networks]
    w, _, _ = planned("method=dmd", *own, "teacher.compile=true")
    eager, _, _ = planned("method=dmd", *own)
    assert memory.network_activation_bytes(w, shaped) == memory.network_activation_bytes(eager, shaped)
    cut = ["student=half", "method.fake_score=lora"]  # the cut student compiled, the teacher and its adapters eager
    w, _, _ = planned("method=dmd", *cut, "trainer.compile_student=true")
    eager, _, _ = planned("method=dmd", *cut)
    (fake,) = w.networks
    assert memory.network_activation_bytes(w, fake) == memory.network_activation_bytes(eager, fake)


def test_the_lora_plans_measured_on_a_gpu_are_not_marked_extrapolated_and_the_rest_are():
    """The 14B under offload and the 1.3B resident, adapters on, batch 1 x 1560 tokens, were measured on an H200
    (docs/PERFORMANCE.md): no `*`. Longer clips, another placement or several ranks still get one."""
    from wandistiller.placements.memory import Hardware
    from wandistiller.placements.planner import extrapolated

    one_gpu = Hardware(gpu_bytes=(24 * memory.GiB,), host_bytes=128 * memory.GiB)

    def starred(placement: str, *overrides: str) -> bool:
        w = planned("student=lora", "method=dmd", "method.fake_score=lora", "trainer.batch_size=1", *overrides)[0]
        return extrapolated(w, one_gpu, placement)

    assert not starred("offload") and not starred("offload", "teacher.quantize=fp8")
    assert starred("offload", "data.latent_frames=21") and starred("disk") and starred("gpu")
    assert not starred("gpu", "teacher=wan2.1_t2v_1.3b") and starred("offload", "trainer.batch_size=2")
