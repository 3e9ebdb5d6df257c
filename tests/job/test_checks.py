"""Tests wandistiller/job/checks.py: the config's own values (ranges, sizes, seeds, rates, `+` keys, folders,
hooks), each refused in one line naming the key before the run folder is claimed; driven through `train.run` on
real Hydra compose and the tiny teacher."""

from __future__ import annotations

import logging

import pytest

from tests.conftest import refused
from tests.job.test_preflight import refused_run
from wandistiller.config import CONF_DIR
from wandistiller.core.errors import UserError
from wandistiller.core.files import folder_problem
from wandistiller.train import run


@pytest.mark.parametrize(
    "override,message",
    [
        ("teacher.max_sequence_length=100000000", "teacher.max_sequence_length=100000000 must be in [1, 4096]"),
        ("data.latent_width=1000000", "data.latent_width=1000000 must be at most 1024"),
        ("data.latent_frames=99999", "data.latent_frames=99999 must be at most 1024"),
        ("seed=99999999999999999999", "seed=99999999999999999999 must be in [0, 2**63)"),
        ("trainer.optimizer.lr=1e30", "trainer.optimizer.lr=1e+30 must be a finite number"),
    ],
)
def test_huge_sizes_seeds_and_rates_are_refused_before_the_run_folder(make_cfg, tmp_path, override, message):
    assert message in refused_run(make_cfg, tmp_path, override)


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.optimizer.lr=-1", "trainer.optimizer: Invalid learning rate: -1"),
        ("trainer.optimizer.betas=[2.0,0.9]", "trainer.optimizer: Invalid beta parameter"),
        ("trainer.optimizer.weight_decay=-1", "trainer.optimizer: Invalid weight_decay value"),
        ("trainer.ema_decay=1.0", "trainer.ema_decay=1.0 must be in [0, 1)"),
        ("trainer.ema_decay=-0.1", "trainer.ema_decay=-0.1 must be in [0, 1)"),
        ("trainer.warmup_steps=-1", "trainer.warmup_steps=-1 must be 0 or more"),
        ("teacher.max_sequence_length=0", "teacher.max_sequence_length=0 must be in [1, 4096]"),
        ("hooks=[monitor,samples,evaluate] hooks.samples.steps=0", "hooks.samples.steps=0 must be at least 1"),
        ("hooks=[monitor,samples,evaluate] hooks.evaluate.steps=0", "hooks.evaluate.steps=0 must be at least 1"),
        # issue 41: refused only after the training, by eval's --steps and data.prompts_path
        ("hooks=[monitor,evaluate] hooks.evaluate.steps=5000", "hooks.evaluate.steps=5000 is more than a Wan sched"),
        ("hooks=[evaluate] hooks.evaluate.prompts_path=/no/such.txt", "hooks.evaluate.prompts_path='/no/su"),
        ("hooks.monitor.val_every=-1", "hooks.monitor.val_every=-1 must be 0 or more"),
        ("hooks=[monitor,samples,evaluate] hooks.samples.every=-1", "hooks.samples.every=-1 must be 0 or more"),
        ("trainer.keep_checkpoints=-1", "trainer.keep_checkpoints=-1 must be 0 or more"),
        ("hooks=[monitor,samples,evaluate] hooks.samples.prompts=-1", "hooks.samples.prompts=-1 must be 0 or more"),
        ("trainer.max_grad_norm=0", "trainer.max_grad_norm=0.0 must be positive, or null"),
        ("data.val_fraction=1.5", "data.val_fraction=1.5 must be in [0, 1): the share of prompts held out, at least"),
        ("data=teacher_latents data.latents_per_prompt=0", "data.latents_per_prompt=0 must be a positive integer"),
        ("data=teacher_latents data.sample_steps=0", "data.sample_steps=0 must be in "),
        ("data=teacher_latents data.latent_chunk=0", "data.latent_chunk=0 must be a positive integer"),
        ("trainer.loss.hidden_kd_weight=-1", "trainer.loss.hidden_kd_weight=-1.0 must be 0 or more"),
        ("teacher.flow_shift=0", "teacher.flow_shift=0.0 must be positive"),
        ("teacher.guidance_scale=nan", "teacher.guidance_scale=nan must be a finite number"),
        # issue 41: accepted, then trained at the scale and sampled without it (WanPipeline: CFG above 1 alone)
        ("teacher.guidance_scale=0.5", "teacher.guidance_scale=0.5 must be a finite number of 1 or more (1: no CFG"),
        ("teacher=tiny_moe teacher.guidance_scale=1", "teacher.guidance_scale_2=3.0 with teacher.guidance_scale=1: "),
        # an audit's: accepted, and the low-noise expert's targets guided at -5 (inverted) or 0.5
        (
            "teacher=tiny_moe teacher.guidance_scale_2=-5",
            "teacher.guidance_scale_2=-5.0 must be a finite number of 1 o",
        ),
        ("teacher=tiny_moe teacher.guidance_scale_2=0.5", "teacher.guidance_scale_2=0.5 must be a finite number of 1"),
        # and on one expert, ignored without a word
        (
            "teacher.guidance_scale_2=3",
            "teacher.guidance_scale_2=3.0 is the low-noise (second) expert's CFG scale, and",
        ),
        # issue 41: 0 was read as unset, a negative length made a schedule whose LR grew without end
        ("trainer.schedule_steps=0", "trainer.schedule_steps=0 must be a positive integer (the LR schedule's length)"),
        ("trainer.schedule_steps=-10", "trainer.schedule_steps=-10 must be a positive integer"),
        # issue 41: importable, so accepted, then an internal error once the run folder was made
        ("recipe._target_=builtins.print", "recipe._target_='builtins.print' is not a recipe (a class with setup() an"),
        ("distributed.timeout_min=0", "distributed.timeout_min=0.0 must be at least 1"),
        ("distributed.timeout_min=0.0001", "distributed.timeout_min=0.0001 must be at least 1 (minutes)"),
        ("hardware.host_memory_gib=-5", "hardware.host_memory_gib=-5.0 must be in [0.5, 65536]"),
        ("hardware.gpus=-1", "hardware.gpus=-1 must be in [0, 64] (GPUs per node)"),
        # an optimizer key no schema types: named with its key and type, not torch's "'<=' not supported ..."
        ("trainer.optimizer.lr=1e-3x", "trainer.optimizer.lr='1e-3x' must be a number (torch.optim.AdamW's lr); e.g."),
        ("trainer.optimizer.betas=[0.9,x]", "trainer.optimizer.betas=[0.9, 'x'] must be a list of 2 numbers"),
        ("trainer.optimizer.weight_decay=true", "trainer.optimizer.weight_decay=True must be a number"),
    ],
)
def test_trainer_values_out_of_range_are_refused_before_the_run_folder(make_cfg, tmp_path, override, message):
    with refused(message) as e:
        run(make_cfg(*override.split(), run_dir=tmp_path / "r"))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


def test_no_share_held_out_is_said_to_hold_out_one_prompt_all_the_same(make_cfg, tmp_path, caplog):
    # An audit's: data.val_fraction=0 held out one prompt without a word; with prompts of the user's own, 0 is moot.
    from wandistiller.job.checks import check_values

    with caplog.at_level(logging.WARNING):
        check_values(make_cfg("data.val_fraction=0"))
        assert "data.val_fraction=0 holds out one prompt all the same" in caplog.text
        caplog.clear()
        (tmp_path / "val.txt").write_text("a red 3\n")
        check_values(make_cfg("data.val_fraction=0", f"data.val_prompts_path={tmp_path / 'val.txt'}"))
        assert "holds out one prompt" not in caplog.text


def test_folders_that_cannot_be_written_are_named(make_cfg, tmp_path):
    (tmp_path / "afile").write_text("x")
    assert "runs through" in folder_problem(tmp_path / "afile" / "run") and "which is a file" in folder_problem(
        tmp_path / "afile" / "run"
    )
    assert folder_problem(tmp_path / "new" / "deeper") is None
    with refused("hydra.run.dir:") as e:
        run(make_cfg(run_dir=tmp_path / "afile" / "run"))
    assert "runs through" in str(e.value)
    with refused("paths.cache_dir:"):
        run(make_cfg(f"paths.cache_dir={tmp_path / 'afile' / 'cache'}", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_a_cache_folder_from_the_environment_is_named_as_it_was_set(make_cfg, tmp_path, monkeypatch):
    # An audit's: WANDISTILLER_CACHE=<a file> was told to set paths.cache_dir, which the user never wrote.
    from wandistiller.job.checks import check_folders

    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("WANDISTILLER_CACHE", str(tmp_path / "afile"))
    with pytest.raises(UserError, match=r"^WANDISTILLER_CACHE \(paths.cache_dir\): .*afile is a file; choose another "
                       r"folder with WANDISTILLER_CACHE=… \(or paths.cache_dir=…\)$"):  # fmt: skip
        check_folders(make_cfg(f"paths.cache_dir={tmp_path / 'afile'}", run_dir=tmp_path / "r"))
    monkeypatch.setenv("WANDISTILLER_CACHE", "")  # set, and empty (a review's: named paths.cache_dir)
    with pytest.raises(UserError, match=r"^WANDISTILLER_CACHE \(paths.cache_dir\) is empty; give it a folder, e.g. "):
        check_folders(make_cfg("paths.cache_dir=''", run_dir=tmp_path / "r"))


@pytest.mark.parametrize("override", ["+trainer.bacth_size=2", "+foo=1", "+data.promts_path=x"])
def test_a_key_added_with_plus_that_no_schema_knows_is_refused(make_cfg, tmp_path, override):
    key = override[1:].split("=")[0]
    with refused(f"{key} is not a WanDistiller option"):
        run(make_cfg(override, run_dir=tmp_path / "r"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["+hooks.mine.every=5"], r"^hooks.mine=\{'every': 5\} is not a hook; `hooks` names hooks \(.*evaluate.*\)"),
        (["hooks=[progress,profile]", "hooks.profile.after=6", "trainer.max_steps=6"],
         r"^hooks.profile.after=6 leaves no step to profile in trainer.max_steps=6; give hooks.profile.after=5 or"
         r" less$"),
    ],
)  # fmt: skip
def test_a_hooks_list_that_would_fail_late_is_refused_before_the_run_folder(make_cfg, tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        run(make_cfg(*overrides, run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("teacher.flow_shift=inf", "teacher.flow_shift=inf must be positive"),
        ("trainer.optimizer.lr=inf", "trainer.optimizer.lr=inf must be a finite number"),
        ("trainer.optimizer.lr=1e6", r"trainer.optimizer.lr=1000000.0 must be a finite number in \[0, 10\]"),
        ("trainer.loss.hidden_kd_weight=nan", "trainer.loss.hidden_kd_weight=nan must be 0 or more and finite"),
        ("seed=-1", r"seed=-1 must be in \[0, 2\*\*63\)"),
    ],
)
def test_values_that_cannot_train_are_refused_first(make_cfg, tmp_path, override, message):
    with pytest.raises(UserError, match=message):
        run(make_cfg(override))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "name", "builtin"),
    [
        ((), "tiny", "tiny"),  # the group's own teacher
        (("teacher.path=/data/models/MyWan-Diffusers",), "MyWan-Diffusers", None),
        (("teacher.path=Wan-AI/Wan2.1-T2V-14B-Diffusers",), "Wan-AI/Wan2.1-T2V-14B-Diffusers", None),
        (("teacher=wan2.1_t2v_1.3b",), "wan2.1_t2v_1.3b", None),
        (("teacher=pocket", "teacher.path=/m/p"), "p", None),
        (("teacher.name=mine", "teacher.path=/m/p"), "mine", "tiny"),  # a name of the user's own is kept
    ],
)
def test_a_teacher_given_by_path_takes_that_folders_name_not_the_groups(overrides, name, builtin):
    from wandistiller.core.hydra import compose_config
    from wandistiller.job.checks import name_the_teacher

    cfg = compose_config(list(overrides))
    name_the_teacher(cfg)
    assert (cfg.teacher.name, cfg.teacher.builtin) == (name, builtin)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("~trainer", "trainer.batch_size has no value (and "),
        ("~seed", "seed has no value: an override removed it (~seed?)"),
        ("~teacher_placement", "teacher_placement has no value"),
    ],
)
def test_a_removed_group_or_key_is_one_line_before_the_run_folder(make_cfg, tmp_path, override, message):
    from wandistiller.compose import check_overrides

    with refused(message):
        check_overrides([override])  # the command line, before Hydra makes the run folder
    with refused(message):
        run(make_cfg(override, run_dir=tmp_path / "r"))  # in-process, before the folder is claimed
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")))
def test_a_hooks_list_drops_the_hooks_it_leaves_out_with_every_shipped_experiment(experiment):
    """USAGE: `hooks=[monitor,progress]` drops the others, whatever the experiment set for them."""
    from wandistiller.core.hydra import compose_tree
    from wandistiller.job.checks import check_hooks, drop_settings_of_unlisted_hooks

    cfg = drop_settings_of_unlisted_hooks(compose_tree("train", [f"+experiment={experiment}", "hooks=[progress]"]))
    check_hooks(cfg)
    assert list(cfg.hooks) == ["progress"]


def test_method_passes_reads_the_trainer_batching():
    """The planner sizes the step the trainer runs: two micro-batches make two teacher calls, unless the teacher
    takes the whole step's batch at once; dmd's fake score is declared in them."""
    from wandistiller.core.hydra import compose_config
    from wandistiller.job.checks import method_passes

    split = method_passes(compose_config(["trainer.grad_accum_steps=2", "trainer.teacher_whole_step=false"]))
    whole = method_passes(compose_config(["trainer.grad_accum_steps=2", "trainer.teacher_whole_step=true"]))
    assert (split.micro_batches, split.teacher_calls, whole.teacher_calls) == (2, 2, 1)
    dmd = method_passes(compose_config(["method=dmd"]))
    assert [n.key for n in dmd.networks] == ["method.fake_score=student"]


def test_a_cfg_scale_far_above_wans_is_warned_of_and_wans_own_are_not(make_cfg, caplog):
    # An audit's: teacher.guidance_scale=1e9 (a slip for 9) trained on saturated targets without a word.
    from wandistiller.job.checks import check_values

    with caplog.at_level(logging.WARNING):
        check_values(make_cfg("teacher.guidance_scale=1e9"))
        assert "teacher.guidance_scale=1000000000.0 is far above the 3-7" in caplog.text
        caplog.clear()
        check_values(make_cfg("teacher.guidance_scale=7.5"))
        assert "far above" not in caplog.text


def test_a_run_whose_student_cannot_move_is_warned_of(make_cfg, caplog):
    # An audit's: trainer.warmup_steps=1000000000 completed a run whose loss never moved, without a word.
    from wandistiller.job.checks import check_training_parts

    with caplog.at_level(logging.WARNING):
        check_training_parts(make_cfg("trainer.warmup_steps=1000000000", "trainer.max_steps=30"))
        assert "trainer.warmup_steps=1000000000 spans the whole 30-step schedule" in caplog.text
        caplog.clear()
        check_training_parts(make_cfg("trainer.optimizer.lr=0"))
        assert "trainer.optimizer.lr=0: the student's weights never change" in caplog.text
        caplog.clear()
        check_training_parts(make_cfg("trainer.warmup_steps=10", "trainer.max_steps=3"))  # a short try: 30% of it
        assert "never" not in caplog.text and "warmup" not in caplog.text
        check_training_parts(make_cfg("trainer.warmup_steps=40", "trainer.max_steps=40"))  # never past its warm-up
        assert "trainer.warmup_steps=40 is as long as the whole 40-step schedule: the LR only climbs, reaching 98%" in (
            caplog.text
        )
        caplog.clear()
        check_training_parts(
            make_cfg("trainer.warmup_steps=40", "trainer.max_steps=40", "trainer.lr_scheduler=constant")
        )
        assert "warmup" not in caplog.text
    # diffusers' polynomial decay divides by its 0 decay steps at the schedule's last step: refused before the run
    with refused("trainer.warmup_steps=4 equals the 4-step schedule, which diffusers' polynomial decay cannot take"):
        check_training_parts(
            make_cfg("trainer.warmup_steps=4", "trainer.max_steps=4", "trainer.lr_scheduler=polynomial")
        )


@pytest.mark.parametrize(
    "endpoint, said",
    [
        ("localhost:99999", "the port '99999' is not a number from 1 to 65535"),
        ("garbage::::", "not a host name"),
        (":29500", "no host name before the port"),
    ],  # fmt: skip
)
def test_a_rendezvous_endpoint_torch_cannot_use_is_one_line(make_cfg, tmp_path, endpoint, said):
    # An audit's: torch's ValueError was an internal error, and the run folder was left behind.
    with refused(f"distributed.rdzv_endpoint={endpoint}: {said}; give HOST:PORT"):
        run(make_cfg("distributed=multi_node", f"distributed.rdzv_endpoint={endpoint}", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()
    from wandistiller.job.checks import endpoint_problem

    assert endpoint_problem("[::1]:29500") is None and endpoint_problem("node0") is None
