"""One process's training: the recipe's setup steps, the flat loop, targets, hooks and what a run leaves.

`from wandistiller.recipe import DistillationRecipe` (the documented base class to subclass) keeps working;
it is looked up on first use so importing `wandistiller.recipe.loop` does not build the whole recipe."""


def __getattr__(name: str):
    if name == "DistillationRecipe":
        from wandistiller.recipe.distillation import DistillationRecipe  # noqa: PLC0415 -- on first use, as said above

        return DistillationRecipe
    raise AttributeError(f"module 'wandistiller.recipe' has no attribute {name!r}")
