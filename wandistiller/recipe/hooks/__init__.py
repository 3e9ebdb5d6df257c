"""Loop hooks, a list instantiated from config as lightning-hydra-template's callbacks are: `hooks=[monitor,
progress,samples,evaluate,collapse]` (the default). One module per option of `conf/hooks/` (`base.Hook` is the
interface); `fault` is the failure-handling tests' injected failure, added only where WANDISTILLER_INJECT_FAILURE asks.

Adding a hook: one module here defining `OPTION = Option("<name>", <Name>Config, <Name>Hook)`, one YAML
`conf/hooks/<name>.yaml` (`defaults: [/schema/hooks/<name>@<name>, _self_]`, its keys under `<name>:`);
`REGISTRY` finds the module. Run it with `hooks=[monitor,progress,samples,evaluate,collapse,<name>]`.
"""

from __future__ import annotations

import os

from hydra.utils import get_class, instantiate

from wandistiller.core.registry import Registry
from wandistiller.core.renamed import current_target
from wandistiller.recipe.hooks.base import Hook, HookParts
from wandistiller.recipe.hooks.fault import FaultInjection

REGISTRY = Registry("hooks", __name__, "a loop hook")


def configured(hooks_cfg, capability: str):
    """The node of the configured hook whose class declares `capability` (`draws_samples`, `validates`), or None:
    what setup makes for hooks (the teacher's sample column, the held-out set) follows the hooks that use it."""

    for node in (hooks_cfg or {}).values():
        if getattr(get_class(current_target(str(node._target_))), capability, False):
            return node
    return None


def build(hooks_cfg, ctx, parts: HookParts) -> list[Hook]:
    """This rank's hooks, in the config's order, each bound to the run: the main rank runs them all, the
    other training ranks those that are not `main_only` (the injected failure)."""

    made = [instantiate(node) for node in (hooks_cfg or {}).values()]
    if os.environ.get(FaultInjection.ENV):
        made.append(FaultInjection())
    mine = [h for h in made if ctx.is_main or not getattr(h, "main_only", True)]
    for hook in mine:
        if isinstance(hook, Hook):
            hook.bind(ctx, parts)
    return mine


__all__ = ["REGISTRY", "Hook", "HookParts", "build"]
