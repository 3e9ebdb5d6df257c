"""A swapped `_target_` with the wrong signature, and a `${…}` that cannot resolve, are one line naming the
key before anything loads."""

from __future__ import annotations

import pytest

from wandistiller.core.errors import UserError
from wandistiller.train import run


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "trainer.loss._target_=wandistiller.recipe.loop.training_state",
            r"trainer.loss._target_=.* cannot be called as",
        ),
        # a function: not a recipe class, refused before its signature is read
        ("recipe._target_=wandistiller.recipe.loop.memory_metrics", r"recipe._target_=.* is not a recipe \(a class"),
        ("student._target_=wandistiller.recipe.loop.memory_metrics", r"unexpected keyword argument 'builder'"),
        ("+trainer.optimizer.nonsense=1", r"trainer.optimizer._target_='torch.optim.AdamW' cannot be called"),
        (
            "logger=wandb logger.wandb._target_=tests.conftest.old_shape_loss",
            r"logger.wandb._target_=.* cannot be called",
        ),
    ],
)
def test_a_target_with_the_wrong_signature_is_one_line(make_cfg, tmp_path, override, message):
    with pytest.raises(UserError, match=message) as e:
        run(make_cfg(*override.split()))
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("paths.cache_dir=${oc.env:WANDISTILLER_TEST_UNSET}", r"^paths.cache_dir=\$\{oc.env:WANDISTILLER_TEST_UNSET\}"),
        ("seed=${no.such.key}", r"^seed=\$\{no.such.key\}: Interpolation key 'no.such.key' not found"),
    ],
)
def test_an_interpolation_that_cannot_resolve_names_its_own_key(make_cfg, override, message):
    with pytest.raises(UserError, match=message):
        run(make_cfg(override))


def test_a_target_that_cannot_be_imported_is_one_line_and_hydra_logs_none_of_its_own(make_cfg, caplog):
    """Hydra's lookup logged three lines of its own (`[hydra.utils][ERROR] ... ModuleNotFoundError(...)`) above it."""
    with pytest.raises(UserError, match=r"trainer.optimizer._target_='torch.optim.Foo' cannot be imported"):
        run(make_cfg("trainer.optimizer._target_=torch.optim.Foo"))
    assert not [r for r in caplog.records if r.name.startswith("hydra")]
