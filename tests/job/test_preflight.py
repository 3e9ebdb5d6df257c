"""Tests wandistiller/job/preflight.py: what `prepare` refuses after the config's own values, in one line before the
run folder is claimed (student and teacher configs and files, the student's room and rope table), through
`train.run` and the functions it calls, on real Hydra compose and the tiny teacher."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from tests.conftest import refused
from tests.student.test_model import TINY_STUDENT
from tests.teacher.test_spec import _edit_json
from wandistiller.core.errors import UserError
from wandistiller.train import run


def test_a_student_config_with_negative_layers_is_refused_before_the_run_folder(make_cfg, tmp_path):
    path = tmp_path / "student.json"
    path.write_text(json.dumps(TINY_STUDENT | {"num_layers": -1}))
    with refused("num_layers=-1 must be a positive integer"):
        run(make_cfg("student=from_json", f"student.config_path={path}", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_a_local_teachers_files_are_checked_before_the_planner_reads_its_config(make_cfg, tmp_path, tiny_path):
    folder = tmp_path / "teacher"
    shutil.copytree(tiny_path, folder)
    _edit_json("transformer/config.json", lambda j: j | {"num_layers": "four"})(folder)
    with refused('transformer/config.json: num_layers="four" must be a positive integer'):
        run(make_cfg(f"teacher.path={folder}", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def refused_run(make_cfg, tmp_path, *overrides):
    with pytest.raises(UserError) as e:
        run(make_cfg(*overrides, run_dir=tmp_path / "r"))
    assert "\n" not in str(e.value) and not (tmp_path / "r").exists()
    return str(e.value)


@pytest.mark.parametrize(
    "body,message",
    [
        (TINY_STUDENT | {"qk_norm": "layer_norm_typo"}, 'qk_norm="layer_norm_typo" is not one diffusers\' Wan applies'),
        (TINY_STUDENT | {"rope_max_seq_len": 10**9}, "rope_max_seq_len=1000000000 allocates"),
        (TINY_STUDENT | {"image_dim": 64}, "image_dim=64 but the teacher has image_dim=None"),
        (TINY_STUDENT | {"num_layers": 10**9}, "student num_layers=1000000000: ~"),
        (TINY_STUDENT | {"ffn_dim": 10**12}, "student ffn_dim=1000000000000: ~"),
        ("[" * 100000 + "]" * 100000, "is nested too deeply to read"),
        ('{"a": ' * 50000 + "1" + "}" * 50000, "is nested too deeply to read"),
    ],
)
def test_a_student_json_that_would_fail_late_is_one_line_first(make_cfg, tmp_path, body, message):
    path = tmp_path / "student.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    error = refused_run(make_cfg, tmp_path, "student=from_json", f"student.config_path={path}")
    assert message in error, error


def test_a_latent_grid_past_the_rope_table_is_refused_naming_the_data_key(make_cfg, tmp_path):
    # the tiny teacher's rope_max_seq_len is 32: 80 rows are 40 patches, which would fail inside the first forward
    error = refused_run(make_cfg, tmp_path, "data.latent_height=80")
    assert error.startswith("data.latent_height=80 is 40 patches") and "rope_max_seq_len=32" in error, error
    # The student shares the teacher's table: the line names the teacher's, which no student setting lifts.
    assert error.endswith("more than the teacher's rope_max_seq_len=32; use data.latent_height<=64"), error


def test_a_student_too_big_for_the_host_names_the_key(make_cfg, tmp_path):
    # hardware.host_memory_gib plans on paper: a base (1.4B) student's float32 weights need ~5 GiB
    error = refused_run(make_cfg, tmp_path, "student=base", "hardware.host_memory_gib=1", "data.latent_height=8")
    assert "student ffn_dim=8960: ~5.3 GiB" in error and "1.0 GiB of host memory" in error, error


def test_one_teacher_call_per_step_is_refused_where_an_owner_serves_the_targets(make_cfg, tmp_path):
    overrides = ["teacher_placement=gpu0", "teacher_placement.debug_cpu=true", "distributed.nproc_per_node=2"]
    with pytest.raises(UserError, match="trainer.teacher_whole_step=true .* teacher_placement=gpu0 .* drop"):
        run(make_cfg(*overrides, "trainer.teacher_whole_step=true", run_dir=tmp_path / "r"))


def test_the_plans_one_line_is_read_from_the_chosen_estimate_and_the_table_goes_to_the_log(caplog):
    from tests.placements.test_memory import machine
    from wandistiller.job.preflight import Plan, show_plan
    from wandistiller.placements.memory import Estimate, GiB

    hw = machine(2, gpu_bytes=40 * GiB, host_bytes=64 * GiB)
    gpu = Estimate.of("gpu", (int(11.7 * GiB),), 2 * GiB, hw, "resident")
    balanced = Estimate.of("balanced", (int(30.25 * GiB), int(30.25 * GiB)), 3 * GiB, hw, "split")
    estimates = [gpu, balanced, Estimate.of("cpu", (), 100 * GiB, hw, "on the host"), Estimate.refused("x", "no")]
    planned = lambda chosen: Plan(estimates, chosen, "the table", teacher_config={}, student_config={})
    with caplog.at_level(logging.INFO, logger="wandistiller"):
        show_plan(planned(balanced), in_full=False)
        show_plan(planned(estimates[2]), in_full=False)
        show_plan(planned(gpu), in_full=True)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("teacher placement: balanced (peak GPU 30.2, 30.2 GiB, host 3.0 GiB; 2 of 4 placements")
    assert lines[1].startswith("teacher placement: cpu (host 100.0 GiB; 2 of 4 placements fit here; the table is in")
    assert lines[2] == "teacher placement plan:\nthe table" and len(lines) == 3  # in full: the table itself


@pytest.mark.parametrize(
    "stages,told,message",
    [
        (
            [False, False, False],
            4,
            "does not compress time (temperal_downsample=[false, false, false]), a VAE for stills",
        ),
        ([False, True, False], 4, "says scale_factor_temporal=4 but compresses time 2x"),
    ],
)
def test_a_clip_the_teachers_vae_cannot_make_is_one_line(make_cfg, tmp_path, tiny_path, stages, told, message):
    folder = tmp_path / "teacher"
    shutil.copytree(tiny_path, folder)
    _edit_json("vae/config.json", lambda j: j | {"temperal_downsample": stages, "scale_factor_temporal": told})(folder)
    error = refused_run(make_cfg, tmp_path, f"teacher.path={folder}", "data.latent_frames=3")
    assert error.startswith("data.latent_frames=3: the teacher's VAE") and message in error, error
    assert "use data.latent_frames=1" in error


def test_a_resume_whose_teacher_folder_now_holds_another_model_says_so_before_any_check_against_it(
    make_cfg, tmp_path, tiny_path, tiny_moe_path
):
    """A clip run resumed after its teacher folder was filled with a model whose VAE makes stills: the line is the
    checkpoint's teacher check (put the teacher back), not "use data.latent_frames=1", which would change the run."""
    folder, run_dir = tmp_path / "teacher", tmp_path / "r"
    shutil.copytree(tiny_path, folder)
    clips = ["data.latent_frames=3", "trainer.max_steps=2", "trainer.checkpoint_every=2", f"teacher.path={folder}"]
    run(make_cfg(*clips, run_dir=run_dir))
    shutil.rmtree(folder)
    shutil.copytree(tiny_moe_path, folder)
    _edit_json("vae/config.json", lambda j: j | {"temperal_downsample": [False, False, False]})(folder)
    with pytest.raises(UserError) as e:
        run(make_cfg(*clips, "trainer.max_steps=4", "trainer.resume=auto", run_dir=run_dir))
    error = str(e.value)
    assert error.startswith("trainer.resume: the checkpoint") and "does not fit this teacher" in error, error
    assert "resume with the teacher the run was trained with" in error and "latent_frames" not in error
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002"]
    # Another teacher allowed on purpose: its VAE still cannot make the run's clips, which a resume keeps.
    with pytest.raises(UserError) as e:
        run(make_cfg(*clips, "trainer.max_steps=4", "trainer.resume=auto", "trainer.allow_other_teacher=true",
                     run_dir=run_dir))  # fmt: skip
    assert str(e.value).startswith("data.latent_frames=3: the teacher's VAE does not compress time"), e.value
    assert str(e.value).endswith("a resume keeps the run's data.latent_frames: resume with the video teacher it was "
                                 "trained with")  # fmt: skip


@pytest.mark.parametrize("student", ["student=half", "student=lora"])
def test_a_resume_on_a_teacher_of_another_layout_is_refused_with_or_without_another_teacher_allowed(
    make_cfg, tmp_path, tiny_i2v_path, student
):
    """A text-to-video run resumed on an image-to-video teacher: no allowed other teacher bridges a layout (the
    student's inputs, the run's data source). The line offered trainer.allow_other_teacher, which then met the data
    source's refusal, whose fix (a source of image pairs) a resume cannot take."""
    run_dir = tmp_path / "r"
    run(make_cfg(student, "trainer.max_steps=2", "trainer.checkpoint_every=2", run_dir=run_dir))
    resume = (student, "trainer.max_steps=4", "trainer.resume=auto", f"teacher.path={tiny_i2v_path}")
    for allowed in ((), ("trainer.allow_other_teacher=true",)):
        with pytest.raises(UserError) as e:
            run(make_cfg(*resume, *allowed, run_dir=run_dir))
        error = str(e.value)
        assert error.startswith("trainer.resume: the checkpoint") and "cannot go on this teacher" in error, error
        assert f"the teacher at {tiny_i2v_path} is image-to-video (its experts take 36)" in error, error
        assert error.endswith("resume under the teacher it was trained with, or start a new run folder to distil "
                              "this one"), error  # fmt: skip
        assert "allow_other_teacher" not in error and "data.latents" not in error
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002"]


def test_one_frame_on_a_pocket_video_teacher_is_refused_before_training_not_after(make_cfg, tmp_path):
    """It trained every step, then its end-of-run evaluation refused it (naming a --teacher-path train has not), and
    eval and generate refused the run for good."""
    for teacher in ("pocket_video", "pocket_i2v"):
        error = refused_run(make_cfg, tmp_path, f"teacher={teacher}", "data.latent_height=4", "data.latent_width=4")
        assert error.startswith("data.latent_frames=1 makes single frames, but the teacher at "), error
        fix = "set data.latent_frames=5 (as its experiments do: +experiment=pocket_video, pocket_i2v_lora, …)"
        assert error.endswith(f"is a pocket video teacher, trained and judged on clips of 9 frames: {fix}"), error


def test_the_image_pocket_teacher_is_refused_clips_and_trains_stills(make_cfg, tmp_path):
    # its VAE says scale_factor_temporal=4 but compresses time 2x (temperal_downsample [false, true]): trained on stills
    error = refused_run(make_cfg, tmp_path, "teacher=pocket", "data=pocket_digits", "data.latent_frames=2")
    assert "says scale_factor_temporal=4 but compresses time 2x" in error, error


def test_more_frames_than_fit_is_one_line_naming_the_largest_that_does(make_cfg, tmp_path):
    # the tiny teacher on paper: 2 GiB of host RAM, batch 64 of 16x16 latents; 32 latent frames need 2.2 GiB
    hardware = ("hardware.gpus=0", "hardware.host_memory_gib=2", "trainer.batch_size=64")
    grid = ("data.latent_frames=32", "data.latent_height=16", "data.latent_width=16")
    error = refused_run(make_cfg, tmp_path, *hardware, *grid)
    assert error.startswith("data.latent_frames=32 is more frames than fit (no GPU, 2 GiB host RAM"), error
    assert "the largest latent_frames that fits: 25 (= 97 frames) at batch 64" in error, error
    assert "use data.latent_frames<=25" in error


def test_a_teacher_with_image_tokens_and_text_not_padded_to_512_is_refused_naming_the_key(make_cfg, tmp_path):
    error = refused_run(make_cfg, tmp_path, "teacher=tiny_i2v", "teacher.max_sequence_length=16")
    assert error.startswith("teacher.max_sequence_length=16: teacher=tiny_i2v attends to image tokens"), error
    assert error.endswith("use teacher.max_sequence_length=512"), error


def test_a_lora_student_is_not_weighed_as_a_copy_of_the_teacher_but_a_cut_student_is(make_cfg, tiny_path):
    """A LoRA student holds adapters on the teacher, no weights of its own: on a machine too small for a float32
    copy of the teacher (a 14B teacher's 53 GiB on a 24 GiB GPU, found on an H200) it is not refused here (the
    planner counts its adapters); a cut student of the same size is."""
    from wandistiller.job.preflight import check_student_room
    from wandistiller.placements.memory import Hardware
    from wandistiller.student.model import check_student
    from wandistiller.teacher.spec import inspect_teacher

    teacher = inspect_teacher(tiny_path).transformer_config
    small = Hardware(gpu_bytes=(64 * 1024,), host_bytes=64 * 1024)  # 64 KiB: less than the tiny teacher's weights
    cfg = make_cfg("student=lora")
    check_student_room(cfg, check_student(cfg.student, teacher), teacher, small)
    cfg = make_cfg()  # the default student, cut from the teacher
    with refused("float32 weights, more than the 0.0 GiB of host memory here"):
        check_student_room(cfg, check_student(cfg.student, teacher), teacher, small)


def test_an_absurd_fake_score_rank_is_named_before_the_planner_sizes_it(make_cfg, tmp_path):
    """method.lora_rank=10^9 once met the planner first ("teacher_placement=cpu will not fit: it needs 44060 GiB"):
    a local teacher's shape checks the method's own networks before any plan."""
    with refused("method.lora_rank=1000000000 is wider than the narrowest adapted layer"):
        run(make_cfg("student=lora", "method=dmd", "method.fake_score=lora", "method.lora_rank=1000000000",
                     run_dir=tmp_path / "r"))  # fmt: skip
    assert not (tmp_path / "r").exists()


def test_a_missing_teacher_folder_is_said_before_the_checks_that_import_diffusers_and_the_loggers(
    make_cfg, tmp_path, monkeypatch
):
    # The CLI's refusal took 4.2 s, 2 of them the imports of the optimizer, LR schedule and logger checks that a
    # missing folder makes moot; said before them, it takes 2.2 s (the first line a real model's user may see).
    def too_late(*_):
        raise AssertionError("the training parts were checked before the teacher's folder")

    monkeypatch.setattr("wandistiller.job.preflight.check_training_parts", too_late)
    missing = tmp_path / "models" / "Wan2.1"
    with pytest.raises(UserError, match=r"^teacher.path='.*Wan2.1' does not exist; point it at a diffusers-format"):
        run(make_cfg(f"teacher.path={missing}", "teacher.builtin=null", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_a_resume_asked_to_stop_before_its_checkpoint_is_refused_not_done_without_a_step(make_cfg, tmp_path):
    """trainer.max_steps below the checkpoint's step ran no step and saved the checkpoint's student as the final
    one, saying "done"; refused, nothing written."""
    run_dir = tmp_path / "r"
    run(make_cfg("trainer.max_steps=4", "trainer.checkpoint_every=2", run_dir=run_dir))
    before = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    with refused("trainer.max_steps=3 is below step 4, where trainer.resume=auto continues (step_00000004): nothing"):
        run(make_cfg("trainer.max_steps=3", "trainer.resume=auto", run_dir=run_dir))
    assert sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before
