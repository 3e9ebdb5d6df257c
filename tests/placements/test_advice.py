"""`wandistiller.placements.advice`: what the planner tells a user whose run does not fit -- each fix tried on paper
before it is said, the most frames that fit found by bisection, and one line where nothing fits at all."""

from __future__ import annotations

from tests.conftest import workload
from tests.placements.test_planner import FRAME, HARDWARE
from wandistiller.placements import advice
from wandistiller.placements.planner import plan


def test_a_run_that_fits_needs_no_fix_and_a_14b_teacher_on_24_gib_gets_fixes_that_each_fit(make_cfg):
    w, hw = workload(make_cfg("teacher=wan2.1_t2v_14b", *FRAME, *HARDWARE["1x80GiB"]))
    assert advice.fixes(w, hw) == [] and advice.nothing_fits(w, hw, 1) is None
    big = make_cfg("teacher=wan2.1_t2v_14b", *FRAME, *HARDWARE["1x24GiB"], "trainer.batch_size=64")
    w, hw = workload(big)
    assert not any(e.fits for e in plan(w, hw))  # batch 64 of a 14B teacher's student on one 24 GiB card
    found = advice.fixes(w, hw)
    assert found, "a run that does not fit is told what to change"
    for fix in found:  # each fix, applied alone, fits on paper
        fixed, _ = workload(make_cfg("teacher=wan2.1_t2v_14b", *FRAME, *HARDWARE["1x24GiB"], "trainer.batch_size=64",
                                     fix))  # fmt: skip
        assert any(e.fits for e in plan(fixed, hw)), fix


def test_the_most_frames_that_fit_is_the_edge_between_fitting_and_not(make_cfg):
    w, hw = workload(make_cfg("teacher=wan2.1_t2v_14b", *FRAME, *HARDWARE["1x80GiB"]))
    most = advice.largest_frames(w, hw, 1)
    assert 0 < most < advice.MOST_FRAMES
    assert any(e.fits for e in plan(advice._at_frames(w, 1, most), hw))
    assert not any(e.fits for e in plan(advice._at_frames(w, 1, most + 1), hw))


def test_the_largest_batch_that_fits_is_the_edge_between_fitting_and_not_found_by_bisection(make_cfg):
    # Counted down one by one, trainer.batch_size=100000 planned for 16 s and 1e8 for hours.
    w, hw = workload(make_cfg("teacher=wan2.1_t2v_14b", *FRAME, *HARDWARE["1x80GiB"], "trainer.batch_size=100000000"))
    most = advice.largest_batch(w, hw)
    assert most is not None and 1 < most < 100000000
    assert any(e.fits for e in plan(advice._at_batch(w, most), hw))
    assert not any(e.fits for e in plan(advice._at_batch(w, most + 1), hw))
    assert f"trainer.batch_size={most}" in advice.fixes(w, hw)


def test_hardware_nothing_fits_on_is_one_line_naming_the_closest_placement(make_cfg):
    w, hw = workload(make_cfg("teacher=wan2.1_t2v_14b", *FRAME, "hardware.gpus=1", "hardware.gpu_memory_gib=1",
                              "hardware.host_memory_gib=2"))  # fmt: skip
    line = advice.nothing_fits(w, hw, 1)
    assert line is not None and line.startswith("no setting fits") and "teacher_placement=" in line
    assert "\n" not in line
