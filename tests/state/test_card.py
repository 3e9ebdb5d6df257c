"""`wandistiller.state.card`: the model card states the teacher, the data, the training and the run's figures, names
local files by their names alone, and never evaluates a received config's resolvers or copies a received file's text."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from wandistiller.state import card as card_module
from wandistiller.state.card import model_card


def no_path_of_this_machine(card: str, *paths) -> None:
    for path in (*paths, Path.home(), Path(card_module.__file__).parents[1]):
        assert str(path) not in card, path
    assert not re.search(r"(?<![\w.])/(tmp|home|root|work|usr|var|mnt|data)/", card)


@pytest.fixture
def run_folder(make_cfg, tmp_path):
    """A run folder as far as the card reads it: the saved config (latent 8x8, seed 0, fp32)."""
    folder = tmp_path / "run"
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(make_cfg("data.latent_height=6", run_dir=folder), folder / ".hydra" / "config.yaml")
    return folder


def saved(folder, *overrides: str, **raw):
    """`folder`'s saved config with `raw` keys set unresolved (a received config's `${…}` included)."""
    path = folder / ".hydra" / "config.yaml"
    cfg = OmegaConf.load(path)
    for key, value in raw.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    OmegaConf.save(cfg, path)


def test_the_card_states_teacher_data_training_size_and_the_runs_figures(run_folder):
    saved(run_folder, teacher__path="Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    run = {"teacher": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "teacher_experts": 1, "student_params_m": 41.888}
    metrics = run | {"steps_run": 7, "batch_size": 3, "precision": "bf16", "eval_psnr": 21.23456, "eval_ssim": None}
    (run_folder / "metrics.json").write_text(json.dumps(metrics))
    card = model_card(run_folder)
    assert card.startswith("---\nlibrary_name: diffusers\n") and "base_model: Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in card
    assert "# A 41.9M-parameter text-to-image student of Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in card
    assert "| training | 7 steps, batch 3, precision bf16, seed 0 |" in card
    assert "| image size | 48x64 (latent 6x8) |" in card and "height=48, width=64" in card  # Wan's VAE: 8x
    assert "max_sequence_length=512" in card  # Wan's padding
    assert "| `eval_psnr` | 21.23 |" in card and "eval_ssim" not in card  # a figure the run did not measure


def test_a_card_without_metrics_names_the_built_in_teacher_and_no_path_of_this_machine(run_folder, tiny_path):
    card = model_card(run_folder)
    assert "base_model" not in card and "A ?-parameter text-to-image student of tiny (built-in, random weights)" in card
    assert "| (no evaluation in this run) | |" in card and "| data | Gaussian x0 (data-free); prompts: the" in card
    no_path_of_this_machine(card, tiny_path, run_folder)


def test_a_local_teacher_and_prompts_file_are_named_by_their_names_alone(run_folder, tmp_path):
    saved(run_folder, teacher__path=str(tmp_path / "models" / "MyWan"), data__prompts_path=str(tmp_path / "p.txt"))
    card = model_card(run_folder)
    assert "student of MyWan (a local folder)" in card and "prompts: `p.txt`" in card
    no_path_of_this_machine(card, tmp_path)


def test_a_received_configs_resolvers_are_never_evaluated_into_the_card(run_folder, monkeypatch):
    monkeypatch.setenv("WD_TEST_SECRET", "hf_s3cret")
    secret = "${oc.env:WD_TEST_SECRET}"
    saved(run_folder, teacher__path=secret, teacher__name=secret, data__prompts_path=secret, seed=secret,
          teacher__guidance_scale=secret)  # fmt: skip
    card = model_card(run_folder)
    assert "s3cret" not in card and "WD_TEST_SECRET" not in card
    assert "student of a local folder" in card and "prompts: your prompts" in card and "seed ?" in card


def test_a_received_metrics_file_cannot_add_lines_to_the_front_matter_or_text_to_the_card(run_folder):
    evil = "x\nbase_model: evil/model\nlicense: evil"
    metrics = {"teacher": evil, "precision": evil, "steps_run": evil, "student_params_m": evil, "eval_psnr": evil}
    (run_folder / "metrics.json").write_text(json.dumps(metrics))
    card = model_card(run_folder)
    front = card.split("---\n")[1].splitlines()
    assert front == ["library_name: diffusers", "pipeline_tag: text-to-image", "tags: [wan, distillation, kd]"]
    assert "evil" not in card and "| (no evaluation in this run) | |" in card
    (run_folder / "metrics.json").write_text("[1, 2]")  # not an object: no figures, no failure
    assert "A ?-parameter" in model_card(run_folder)
    saved(run_folder, method__name=evil)  # nor a received config's method name
    card = model_card(run_folder)
    assert card.split("---\n")[1].splitlines()[2] == "tags: [wan, distillation]" and "evil" not in card


@pytest.mark.parametrize(
    "method, steps, phrase",
    [("kd", None, "the student transformer learned the teacher's classifier-free-guided velocity (guidance scale"),
     ("trajectory", 4, "the 4-step student learned to jump between points of the teacher's classifier-free-guided"),
     ("dmd", 4, "the 4-step student learned by distribution matching (DMD2)"),
     ("mine", None, "the student transformer was trained with the method `mine` against the teacher's")],
)  # fmt: skip
def test_the_card_names_the_method_the_student_was_trained_with(run_folder, method, steps, phrase):
    from wandistiller.recipe.methods import card_phrases

    saved(run_folder, method__name=method, method__steps=steps)
    card = model_card(run_folder, phrases=card_phrases())
    text = " ".join(card.split())  # the sentence as read, whatever its line breaks
    assert f"with `method={method}`: {phrase}" in text and f"| method | `{method}` |" in card
    assert f"tags: [wan, distillation, {method}]" in card
    others = {"kd": "velocity (guidance", "trajectory": "jump between", "dmd": "distribution matching"}
    assert not [m for m, words in others.items() if m != method and words in text]  # no other method's wording


def test_a_dmd_card_names_its_regression_term_and_an_old_run_is_kd(run_folder):
    from wandistiller.recipe.methods import card_phrases

    saved(run_folder, method__name="dmd", method__steps=4, method__regression_weight=0.1)
    assert "and away from a fake score trained on them, with trajectory's regression term (weight 0.1)." in " ".join(
        model_card(run_folder, phrases=card_phrases()).split()
    )
    path = run_folder / ".hydra" / "config.yaml"
    cfg = OmegaConf.load(path)
    del cfg["method"]  # a run saved before there were methods
    OmegaConf.save(cfg, path)
    assert "with `method=kd`: the student transformer learned" in " ".join(
        model_card(run_folder, phrases=card_phrases()).split()
    )


@pytest.mark.parametrize("method, steps", [("kd", None), ("trajectory", 4), ("dmd", 1)])
def test_val_loss_best_is_quoted_for_a_kd_student_alone(run_folder, method, steps):
    # val/loss is a KD student's velocity error: the run itself calls it meaningless for a few-step student
    saved(run_folder, method__name=method, method__steps=steps)
    (run_folder / "metrics.json").write_text(json.dumps({"val_loss_best": 0.125, "eval_psnr": 20.5}))
    card = model_card(run_folder)
    assert "| `eval_psnr` | 20.5 |" in card
    assert ("| `val_loss_best` | 0.125 |" in card) == (steps is None) and ("val_loss" in card) == (steps is None)


def test_each_method_carries_its_own_cards_phrase_and_an_unknown_one_is_named_plainly(run_folder):
    from wandistiller.recipe.methods import REGISTRY, card_phrases

    phrases = card_phrases()
    assert set(phrases) == set(REGISTRY.names()) and len(set(phrases.values())) == len(phrases)
    saved(run_folder, method__name="dmd", method__steps=4)
    assert "learned by distribution matching (DMD2)" in model_card(run_folder, phrases=phrases)
    mine = model_card(run_folder, phrases={"dmd": "the {k}-step student learned my way (guidance {g})"})
    assert "the 4-step student learned my way (guidance" in mine
    assert "trained with the method `dmd` against the teacher's" in model_card(run_folder)  # no phrase handed
