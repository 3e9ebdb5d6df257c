"""The student's regional torch.compile settings (`trainer.compile_student`, `trainer.compile_mode`), checked
before anything loads: `reduce-overhead` (CUDA graphs) or `max-autotune` is passed to its compile."""

from __future__ import annotations

from wandistiller.core.errors import UserError

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_compile_mode(mode: str | None, compile_student: bool) -> None:
    if mode is None:
        return
    if mode not in COMPILE_MODES:
        raise UserError(f"trainer.compile_mode={mode} is unknown; use one of {', '.join(COMPILE_MODES)} or null")
    if not compile_student:
        raise UserError(f"trainer.compile_mode={mode} applies to a compiled student; add trainer.compile_student=true")


def compile_kwargs(mode: str | None) -> dict:
    """torch.compile arguments for the student's regional compile."""
    return {"fullgraph": True} | ({"mode": mode} if mode else {})
