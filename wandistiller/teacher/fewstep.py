"""A few-step student's own schedule: the one contract between training (`method=trajectory|dmd`, which
learn to jump between its points) and sampling (`eval`, `generate`, the saved pipeline, which walk them).

The schedule is diffusers' FlowMatchEulerDiscreteScheduler at the teacher's flow shift and train timesteps,
set to K steps: K timesteps from pure noise down, and K + 1 sigmas ending at 0 (the clean sample). Its
`shift_terminal` is the shifted sigma of t = 1/K, so the K points are spread over the whole schedule as
DMD2's are (shift 3, K=4: sigmas 1, .93, .80, .50, 0); without it the last step would start at sigma 0.009 and
waste a network call. Saving that scheduler in a student's pipeline is what lets
`WanPipeline(...)(prompt, num_inference_steps=K)` sample on the student's own timesteps, with no code of ours.
It is K's alone: set to another count n, diffusers stretches the schedule to end at K's last point, and at n = 1
the stretch divides by zero (NaN sigmas). Sampling at n is `few_step_scheduler(spec, n)` (eval and generate
`--student-steps n`; the model card writes the same rebuild with diffusers alone: state/card.py `other_steps`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from wandistiller.core.errors import UserError
from wandistiller.teacher.spec import TeacherSpec


def few_step_scheduler(spec: TeacherSpec, steps: int, schedule: Schedule | None = None):
    """The K-step student's Euler flow-matching scheduler (call `set_timesteps(K)`): on diffusers' own schedule
    (`schedule` None or euler: the teacher's shift, its terminal at t = 1/K), else one whose `set_timesteps` walks
    `schedule`'s sigmas exactly (shift 1: the sigmas as given; bound in this process, not in a saved config)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if schedule is not None and schedule.name != "euler":
        sigmas = schedule_sigmas(spec, steps, schedule)[:-1].tolist()
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=spec.num_train_timesteps, shift=1.0)
        scheduler.set_timesteps = functools.partial(scheduler.set_timesteps, sigmas=sigmas)
        return scheduler
    shift = spec.flow_shift
    terminal = {"shift_terminal": shift / steps / (1 + (shift - 1) / steps)} if steps > 1 else {}
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=spec.num_train_timesteps, shift=shift, **terminal)


def student_schedule(
    spec: TeacherSpec, steps: int, schedule: Schedule | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps [K], sigmas [K + 1]) of a K-step student: x at sigma_i, the student's velocity v at
    timesteps[i], gives x + (sigma_{i+1} - sigma_i) v at sigma_{i+1}; sigmas[-1] is 0. `schedule`: None or
    euler (diffusers' own), else ComfyUI's simple / beta or an explicit list (`Schedule`); timesteps = sigma x 1000
    on each, as both diffusers and ComfyUI (ModelSamplingDiscreteFlow.timestep) feed the model."""
    if steps < 1:
        raise ValueError(f"a few-step schedule has at least one step, not {steps}")
    if schedule is not None and schedule.name != "euler":
        sigmas = schedule_sigmas(spec, steps, schedule)
        return (sigmas[:-1] * spec.num_train_timesteps).float(), sigmas
    scheduler = few_step_scheduler(spec, steps)
    scheduler.set_timesteps(steps)
    return scheduler.timesteps.float().clone(), scheduler.sigmas.float().clone()


# -- the schedule a few-step student is trained and sampled at (`method.schedule`) ----------------------------------
# "euler": diffusers' FlowMatchEulerDiscreteScheduler at K (above): what a saved pipeline samples with
# `num_inference_steps=K` and no code of ours. "simple" / "beta": ComfyUI's schedulers of those names (KSampler's
# `scheduler` widget) on a flow model at a shift (ModelSamplingSD3), ported below; or an explicit list of K sigmas.
SCHEDULES = ("euler", "simple", "beta")
DEFAULT_SCHEDULE = "euler"
COMFY_TABLE = 1000  # ModelSamplingDiscreteFlow's sigma table: timesteps=1000, multiplier=1000


@dataclass(frozen=True)
class Schedule:
    """A few-step student's schedule: `name` one of SCHEDULES, or "list" with its K `sigmas` (first the noisiest);
    `shift`: the flow shift of ComfyUI's schedules (None: the teacher's)."""

    name: str = DEFAULT_SCHEDULE
    shift: float | None = None
    sigmas: tuple[float, ...] = ()

    def describe(self) -> str:
        if self.name == "list":
            return "the explicit sigmas " + ", ".join(f"{s:g}" for s in self.sigmas)
        at = f" at shift {self.shift:g}" if self.shift is not None else ""
        return {"euler": "diffusers' flow-match Euler", "simple": "ComfyUI's simple", "beta": "ComfyUI's beta"}[
            self.name
        ] + at

    def record(self) -> str | list[float]:
        """What sampling.json and the files' metadata state of it (`schedule`)."""
        return list(self.sigmas) if self.name == "list" else self.name


def parse_schedule(value, shift, steps: int) -> Schedule:
    """`method.schedule` (a name of SCHEDULES or a list of K sigmas) and `method.shift` as one Schedule, checked:
    one line for a wrong name, a list of the wrong length, sigmas not decreasing or out of (0, 1]."""
    if shift is not None:
        if isinstance(shift, bool) or not isinstance(shift, int | float) or not math.isfinite(shift) or shift <= 0:
            raise UserError(
                f"method.shift={shift!r} must be a positive number (ModelSamplingSD3's shift); e.g. method.shift=5"
            )
        shift = float(shift)
    if isinstance(value, str):
        if value not in SCHEDULES:
            raise UserError(
                f"method.schedule={value} is not one of {', '.join(SCHEDULES)} or a list of method.steps sigmas; "
                f"e.g. method.schedule=simple"
            )
        return Schedule(value, shift)
    if isinstance(value, Sequence):  # a list, or the run config's ListConfig
        value = list(value)
    if isinstance(value, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        sigmas = tuple(float(v) for v in value)
        shown = "[" + ",".join(f"{s:g}" for s in sigmas) + "]"
        if len(sigmas) != steps:
            raise UserError(
                f"method.schedule={shown} has {len(sigmas)} sigmas and method.steps={steps}; give one sigma per step "
                f"(the noisiest first, the final 0 left out), e.g. method.schedule=[1,0.9,0.75,0.5] for 4 steps"
            )
        if not all(0 < s <= 1 and math.isfinite(s) for s in sigmas):
            raise UserError(f"method.schedule={shown}: every sigma must lie in (0, 1]; e.g. [1,0.9,0.75,0.5]")
        if any(b >= a for a, b in zip(sigmas, sigmas[1:])):
            raise UserError(
                f"method.schedule={shown}: the sigmas must decrease strictly (noisiest first); e.g. [1,0.9,0.75,0.5]"
            )
        if shift is not None:
            raise UserError(f"method.shift={shift:g} is for method.schedule=simple or beta; drop it with a list")
        return Schedule("list", None, sigmas)
    raise UserError(
        f"method.schedule={value!r} is neither one of {', '.join(SCHEDULES)} nor a list of numbers; "
        "e.g. method.schedule=simple or method.schedule=[1,0.9,0.75,0.5]"
    )


def _comfy_flow_table(shift: float) -> torch.Tensor:
    """ComfyUI's ModelSamplingDiscreteFlow.sigmas (comfy/model_sampling.py `set_parameters`, `time_snr_shift`): the
    shifted sigma of t = 1/1000 .. 1, ascending, float32 as ComfyUI holds it."""
    t = (torch.arange(1, COMFY_TABLE + 1, 1) / COMFY_TABLE) * COMFY_TABLE / COMFY_TABLE
    return t if shift == 1.0 else shift * t / (1 + (shift - 1) * t)


def comfy_simple_sigmas(shift: float, steps: int) -> list[float]:
    """ComfyUI's `simple_scheduler` (comfy/samplers.py) on a flow model at `shift`: K sigmas of its table at
    evenly spaced indices from the top, then 0."""
    table = _comfy_flow_table(shift)
    stride = len(table) / steps
    return [float(table[-(1 + int(x * stride))]) for x in range(steps)] + [0.0]


def comfy_beta_sigmas(shift: float, steps: int, alpha: float = 0.6, beta: float = 0.6) -> list[float]:
    """ComfyUI's `beta_scheduler` (comfy/samplers.py; alpha = beta = 0.6, its defaults) on a flow model at `shift`:
    the table's sigmas at the Beta(alpha, beta) quantiles 1 - i/K (rounded to its indices, repeats dropped), then
    0. scipy's `beta.ppf` is replaced by a bisection of the regularized incomplete beta function."""
    table = _comfy_flow_table(shift)
    total = len(table) - 1
    sigmas, last = [], -1
    for i in range(steps):
        t = round(_beta_ppf(1 - i / steps, alpha, beta) * total)  # numpy.rint: half to even, as round()
        if t != last:
            sigmas.append(float(table[int(t)]))
        last = t
    return sigmas + [0.0]


def _beta_ppf(q: float, a: float, b: float) -> float:
    if q <= 0.0:
        return 0.0
    if q >= 1.0:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(80):  # below float64's resolution of [0, 1]
        mid = (low + high) / 2
        low, high = (mid, high) if _beta_cdf(mid, a, b) < q else (low, mid)
    return (low + high) / 2


def _beta_cdf(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b) (Numerical Recipes' continued fraction, `betacf`)."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(x, a, b) / a
    return 1.0 - front * _beta_fraction(1 - x, b, a) / b


def _beta_fraction(x: float, a: float, b: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def schedule_sigmas(spec: TeacherSpec, steps: int, schedule: Schedule) -> torch.Tensor:
    """The K + 1 sigmas (ending at 0) of a K-step student on `schedule`."""
    if schedule.name == "euler":
        return student_schedule(spec, steps)[1]
    if schedule.name == "list" and steps != len(schedule.sigmas):
        raise UserError(
            f"the student was trained at {len(schedule.sigmas)} explicit sigmas (method.schedule); sample it at "
            f"{len(schedule.sigmas)} steps, not {steps}"
        )
    shift = schedule.shift if schedule.shift is not None else spec.flow_shift
    if schedule.name == "simple":
        sigmas = comfy_simple_sigmas(shift, steps)
    elif schedule.name == "beta":
        sigmas = comfy_beta_sigmas(shift, steps)
        if len(sigmas) != steps + 1:
            raise UserError(
                f"method.schedule=beta at method.steps={steps} gives only {len(sigmas) - 1} distinct sigmas "
                "(ComfyUI drops repeats); use fewer steps or method.schedule=simple"
            )
    else:
        sigmas = [*schedule.sigmas, 0.0]
    return torch.tensor(sigmas, dtype=torch.float32)
