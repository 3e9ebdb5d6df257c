"""Which prompts `python -m wandistiller.eval` reads from a run's saved config (issue 20, issue 16): an image run's
own held-out captions; a received prompts file only from the run folder or the package, else --prompts FILE.
Real Hydra compose and the real tiny teacher's spec; the run folder is built from the composed config."""

from __future__ import annotations

import pytest

from tests.data.test_images import CAPTIONS, write_folder
from wandistiller.core.errors import UserError
from wandistiller.data.images import image_source
from wandistiller.data.validation import split_prompts
from wandistiller.eval import eval_prompts
from wandistiller.state.runs import RunFolder
from wandistiller.teacher.model import inspect_teacher


def run_of(make_cfg, tmp_path, tiny_path, *overrides):
    cfg = make_cfg(*overrides)
    return RunFolder(tmp_path / "run", cfg, inspect_teacher(tiny_path))


def test_an_image_run_is_evaluated_on_its_own_held_out_captions(make_cfg, tmp_path, tiny_path):
    root = write_folder(tmp_path / "images")
    run = run_of(make_cfg, tmp_path, tiny_path, "data=image_folder", f"data.root={root}", "data.val_fraction=0.34")
    # the same split training validates on (data_sources._held_out_captions): the last val_fraction of the captions
    held = split_prompts(image_source(run.cfg.data).captions, None, 0.34)[1]
    assert eval_prompts(run, None, 8) == held and len(held) == 1 and held[0] in CAPTIONS
    assert eval_prompts(run, str(write_prompts(tmp_path / "mine.txt")), 8) == ["my own prompt"]  # --prompts wins


def write_prompts(path, text="my own prompt\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("key", ["prompts_path", "val_prompts_path"])
def test_a_received_prompts_file_outside_the_run_and_the_package_is_not_read(make_cfg, tmp_path, tiny_path, key):
    secret = write_prompts(tmp_path / "elsewhere" / "secret.txt", "a private line\nanother\n")
    run = run_of(make_cfg, tmp_path, tiny_path, f"data.{key}={secret}")
    with pytest.raises(UserError) as e:
        eval_prompts(run, None, 8)
    assert str(e.value).startswith(f"data.{key}='{secret}' in the run's saved config lies outside the run folder")
    assert str(e.value).endswith("give --prompts FILE") and "\n" not in str(e.value)
    mine = write_prompts(tmp_path / "mine.txt")
    assert eval_prompts(run, str(mine), 8) == ["my own prompt"]  # the user's own file, named on the command line


def test_prompts_inside_the_run_folder_or_shipped_are_read(make_cfg, tmp_path, tiny_path):
    inside = write_prompts(tmp_path / "run" / "prompts.txt", "one\ntwo\nthree\n")
    assert eval_prompts(run_of(make_cfg, tmp_path, tiny_path, f"data.prompts_path={inside}"), None, 8) == ["three"]
    assert eval_prompts(run_of(make_cfg, tmp_path, tiny_path), None, 8)  # the shipped prompts (the default)


def test_the_end_of_run_eval_reads_the_users_own_prompts_file_wherever_it_lies(make_cfg, tmp_path, tiny_path):
    # `python -m wandistiller.train data.prompts_path=my_prompts.txt` evaluates itself at the end: its own file
    mine = write_prompts(tmp_path / "elsewhere" / "my_prompts.txt", "one\ntwo\nthree\n")
    run = run_of(make_cfg, tmp_path, tiny_path, f"data.prompts_path={mine}")
    assert eval_prompts(run, None, 8, own_files=True) == ["three"]
    with pytest.raises(UserError):  # the same folder received from someone else is not
        eval_prompts(run, None, 8)
