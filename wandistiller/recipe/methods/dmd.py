"""`method=dmd`: distribution matching distillation (DMD2: Yin et al. 2024, "Improved Distribution Matching
Distillation for Fast Image Synthesis"), for a K-step student (`method.steps`, its schedule teacher/fewstep.py's).

A student update: from noise the student runs j of its K Euler steps without gradient (j drawn per micro-batch,
DMD2's backward simulation) and predicts x0 = x_j - sigma_j v at step j, with gradient through that call alone. x0
is re-noised at a random t of the teacher's shifted schedule; the placed teacher's guided velocity there is the
real score (real_x0 = x_t - sigma v), an online fake score's is the fake one. The generator's loss is DMD's:
grad = (fake_x0 - real_x0) / mean|x0 - real_x0| per sample, as 0.5 * MSE(x0, (x0 - grad).detach()). Optional:
+ `method.regression_weight` x trajectory's jump loss on the teacher's cached ODE (DMD's regression term).

The fake score learns the student's distribution: `method.fake_updates` flow-matching denoising updates per
training step, each on fresh detached student samples, with its own optimizer (trainer.optimizer's settings) and
grad scaler, checkpointed with the run. `method.fake_score`:
- `student` (the default): student-sized, started from the student (a copy of it);
- `teacher`: teacher-shaped, started from the teacher's first expert, a trainable copy: only where the placement
  keeps a whole teacher on the training device;
- `lora`: the placed teacher itself, frozen, with trainable low-rank adapters (`method.lora_rank`; teacher/lora.py)
  switched on for the fake score's calls alone (`LoraFakeScore`): it starts equal to the teacher (DMD2's start)
  for a few adapters' memory, where the placement can backpropagate through its teacher in the training process
  (`Placement.backprop`, on every training rank; an fp8 base and a compiled one too). Only the adapters train and are
  checkpointed.

Every draw (prompts, noise, j, t) comes from a generator of (seed, step, micro-batch or update, rank): a resumed
run repeats an uninterrupted one bit for bit.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch.nn.parallel import DistributedDataParallel

from wandistiller.core.distributed import Topology
from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.data.batches import Batch, mixed_seed, shifted_sigmas
from wandistiller.placements import names_where
from wandistiller.placements.base import check_adapters_on_teacher
from wandistiller.placements.memory import ADAPTERS, STUDENT_SHAPED, TEACHER_SHAPED, OwnNetwork
from wandistiller.placements.steptime import Passes
from wandistiller.recipe.losses import logged, total
from wandistiller.recipe.methods.base import Method, Network, steps_within
from wandistiller.recipe.methods.fewstep import FewStepConfig, OdePoints, positive, schedule_identity
from wandistiller.student.lora import check_rank
from wandistiller.student.model import Student
from wandistiller.teacher.fewstep import parse_schedule, student_schedule
from wandistiller.teacher.finetune import apply as apply_loras
from wandistiller.teacher.image import ImageCondition, denoised_frames
from wandistiller.teacher.lora import AdaptedTeacher, Adapters
from wandistiller.teacher.spec import loading

# Each method.fake_score as the planner counts it (placements/memory.py's OwnNetwork shapes).
FAKE_SHAPES = {"student": STUDENT_SHAPED, "teacher": TEACHER_SHAPED, "lora": ADAPTERS}
FAKE_SCORES = tuple(FAKE_SHAPES)
# The draws' own generator streams beside the data's and the ODE points' (fewstep.STREAM).
STUDENT_STREAM, FAKE_STREAM = 2, 3
T_RANGE = (0.02, 0.98)  # where x0 is re-noised, before the shift: DMD2's min/max step


@dataclass
class DmdConfig(FewStepConfig):
    """FewStepConfig's keys (`steps`, `teacher_steps`; `noises_per_prompt` and `chunk`: the regression term's
    trajectories) and dmd's own."""

    _target_: str = "wandistiller.recipe.methods.dmd.DMD"
    name: str = "dmd"
    # Fake-score updates per training step (DMD2's two-time-scale ratio: 5).
    fake_updates: int = 5
    # "student" (student-sized, from the student), "teacher" (teacher-shaped, from its first expert), "lora" (the
    # frozen teacher + trainable low-rank adapters, on a placement with `backprop`: gpu, offload, disk, cpu).
    fake_score: str = "student"
    # The adapters' rank with fake_score=lora (alpha = rank).
    lora_rank: int = 16
    # Weight of trajectory's jump loss on the teacher's cached ODE (0: off, nothing is sampled).
    regression_weight: float = 0.0


class DMD(Method):
    """The student against the teacher's score and an online fake score of its own samples."""

    name = "dmd"
    card_phrase = (
        "the {k}-step student learned by distribution matching (DMD2), its own samples pushed toward the teacher's "
        "classifier-free-guided score (guidance scale {g}) and away from a fake score trained on them"
    )
    identity_keys = ("steps", "fake_score", "lora_rank")  # K, and the fake score a checkpoint holds
    student_inputs = True
    uses_loss = False
    reads_x0 = False  # it generates its own samples; the data gives its prompts

    @property
    def samples_ode(self) -> bool:  # type: ignore[override]  # its regression term's ODE points, where weighed
        return self.regression_weight > 0

    def __init__(  # every key required: its default is DmdConfig's, written once
        self,
        *,
        name: str,
        steps: int,
        teacher_steps: int,
        fake_updates: int,
        fake_score: str,
        lora_rank: int,
        regression_weight: float,
        noises_per_prompt: int,
        chunk: int,
        schedule: Any,
        shift: float | None,
    ):
        super().__init__(name, steps)
        self.k = steps_within(steps, teacher_steps)  # `steps`, checked: an int
        self.schedule = parse_schedule(schedule, shift, self.k)
        self.teacher_steps = teacher_steps
        self.fake_updates = positive("method.fake_updates", fake_updates)
        if fake_score not in FAKE_SCORES:
            raise UserError(f"method.fake_score={fake_score!r} is not one of {', '.join(FAKE_SCORES)}; e.g. student")
        self.fake_score = fake_score
        self.lora_rank = positive("method.lora_rank", lora_rank)
        if not (math.isfinite(regression_weight) and regression_weight >= 0):
            raise UserError(f"method.regression_weight={regression_weight} must be 0 or more and finite; 0 is off")
        self.regression_weight = regression_weight
        self.per_prompt = positive("method.noises_per_prompt", noises_per_prompt)
        self.chunk = positive("method.chunk", chunk)

    def identity(self) -> dict:
        """K, its schedule (where not the default) and the fake score; its adapters' rank only where it is a LoRA
        one (otherwise nothing has that rank)."""
        mine = super().identity() | schedule_identity(self.schedule)
        return mine if self.fake_score == "lora" else {k: v for k, v in mine.items() if k != "lora_rank"}

    def check_teacher(self, config: dict) -> None:
        """A LoRA fake score's rank no wider than the narrowest layer it adapts."""
        if self.fake_score == "lora":
            check_rank("method.lora_rank", self.lora_rank, config)

    def check(self, placement, ranks: int, device: torch.device, teacher_cfg=None) -> None:
        if self.fake_score == "student":
            return

        here = placement.teacher_device(Topology()).type == device.type
        if self.fake_score == "teacher" and not (placement.whole_on_one_device and here):
            able = names_where(lambda cls: cls.whole_on_one_device)
            raise UserError(
                f"method.fake_score=teacher trains a teacher-shaped network on the training device ({device.type}), "
                f"and teacher_placement={placement.name} keeps the teacher off it; use method.fake_score=student, or "
                f"a placement with the whole teacher there ({', '.join(able)})"
            )
        if self.fake_score == "lora":
            check_adapters_on_teacher(
                "method.fake_score=lora", placement, ranks, device, teacher_cfg, "method.fake_score=student"
            )

    def passes(self, micro_batches: int, whole_step: bool) -> Passes:
        """Per micro-batch the student generates from noise: j of its K steps without grad (j uniform in 0..K-1),
        then one call with grad ((K - 1) / 2 + 1 calls on average); the placed teacher's guided call and a
        fake-score forward at the re-noised sample (+ a second student forward + backward for the regression
        term). Per step, `fake_updates` updates, each a fresh generation without grad ((K + 1) / 2 calls) and a
        fake-score forward + backward."""
        trains = micro_batches * (2 if self.regression_weight else 1)
        forwards = micro_batches * (self.k - 1) / 2 + self.fake_updates * (self.k + 1) / 2
        fake = OwnNetwork(
            "fake score",
            f"method.fake_score={self.fake_score}",
            FAKE_SHAPES[self.fake_score],
            rank=self.lora_rank if self.fake_score == "lora" else 0,
            forwards=micro_batches,
            trains=self.fake_updates,
        )
        return Passes(self.name, micro_batches, micro_batches, forwards, trains, networks=(fake,))

    def prepare(self, ctx, teacher, embeddings, images=None) -> None:

        self.timesteps, self.sigmas = student_schedule(ctx.spec, self.k, self.schedule)
        self.embeddings, self.seed = embeddings, ctx.seed
        self.images = images  # an image-to-video teacher's, per prompt: the student samples from each its own
        self.batch_size, self.latent_shape = ctx.trainer_cfg.batch_size, ctx.latent_shape
        self.shift = ctx.teacher_cfg.flow_shift or ctx.spec.flow_shift
        self.train_timesteps = ctx.spec.num_train_timesteps
        self.teacher = teacher if self.fake_score == "lora" else None  # a LoRA fake score runs on it (None: none here)
        self.points = None
        if self.regression_weight > 0:
            skip = "method.regression_weight=0 skips them (dmd without its regression term)"
            self.points = OdePoints(
                ctx,
                teacher,
                embeddings,
                self.k,
                self.teacher_steps,
                self.per_prompt,
                self.chunk,
                self.schedule,
                skip,
                images,
            )

    def bind(self, ctx, student, trainer_cfg, state, group) -> None:

        device = ctx.device
        fake: torch.nn.Module
        if self.fake_score == "student" and isinstance(student, AdaptedTeacher):
            # A LoRA student's copy would copy the teacher under it: its fake score is a second adapter set of the
            # student's rank, alpha and layers on the same experts (started at zero: as the student starts).
            adapters = cast(Adapters, student.adapters[0])
            fake = LoraFakeScore(
                student.teacher[0],
                adapters.rank,
                ctx.precision.student_dtype,
                ctx.seed,
                adapters.alpha,
                list(dict.fromkeys(n.split(".", 2)[2] for n in adapters.layers.values())),
            )
        elif self.fake_score == "student":
            fake = copy.deepcopy(student)
        elif self.fake_score == "teacher":
            fake = teacher_shaped(ctx)
        else:
            if self.teacher is None:  # DMD.check refuses a layout with a training rank without a teacher
                raise RuntimeError("method.fake_score=lora on a training rank that holds no teacher")
            fake = LoraFakeScore(self.teacher, self.lora_rank, ctx.precision.student_dtype, ctx.seed)
        fake.to(device).train()  # a LoRA fake score's: its adapters' (the teacher stays frozen, in eval mode)
        params = [p for p in fake.parameters() if p.requires_grad]
        optimizer = instantiate(trainer_cfg.optimizer)(params, **({"fused": True} if device.type == "cuda" else {}))
        scaler = torch.amp.GradScaler(device.type, enabled=ctx.precision.needs_grad_scaler)
        module = data_parallel(fake, device, group)
        self.networks = {"fake_score": Network(module, optimizer, scaler, self.fake_updates)}
        self.max_grad_norm = trainer_cfg.max_grad_norm or float("inf")
        if state is not None:
            self.load_state_dict(state.get("method"))

    # -- one training step ------------------------------------------------------------------------------------
    def other_updates(self, run, step):
        """`method.fake_updates` denoising updates of the fake score on fresh, detached student samples."""
        fake = self.networks["fake_score"]
        params = [p for p in fake.module.parameters() if p.requires_grad]
        losses = []
        for update in range(fake.updates):
            g = torch.Generator().manual_seed(mixed_seed(self.seed, step, update, run.dp_rank, FAKE_STREAM))
            prompt_idx, cond, _ = self._prompts(run, g)
            image = self._image(run, prompt_idx)
            with torch.no_grad():
                x0 = self._generate(run, g, cond, image)
            x_t, t, sigma, noise = self._renoise(run, x0, g)
            with self._autocast(run):
                pred, _ = fake.module(x_t, t, cond, image)
            # Rectified flow's velocity of the student's sample, over the frames it denoises (not TI2V's given one).
            loss = F.mse_loss(denoised_frames(image, pred.float()), denoised_frames(image, noise - x0))
            fake.scaler.scale(loss).backward()
            fake.scaler.unscale_(fake.optimizer)
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            fake.scaler.step(fake.optimizer)
            fake.scaler.update()
            fake.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return {"loss_fake_score": torch.stack(losses).mean()}

    def student_loss(self, run, step, micro, clock):
        g = torch.Generator().manual_seed(mixed_seed(self.seed, step, micro, run.dp_rank, STUDENT_STREAM))
        prompt_idx, cond, uncond = self._prompts(run, g)
        image = self._image(run, prompt_idx)
        x0 = self._generate(run, g, cond, image)  # gradient through the student's last call only
        x_t, t, sigma, _ = self._renoise(run, x0.detach(), g)
        start = clock.mark()
        real, _ = run.targets.get(step, micro, Batch(prompt_idx, x_t, t, cond, uncond, image=image), ())
        span = (start, clock.mark())
        with torch.no_grad(), self._autocast(run):
            fake, _ = self.networks["fake_score"].module(x_t, t, cond, image)
        with torch.no_grad():
            real_x0 = x_t - sigma * real.to(run.device, torch.float32)
            fake_x0 = x_t - sigma * fake.float()
            scale = (x0 - real_x0).abs().mean(dim=tuple(range(1, x0.dim())), keepdim=True)
            grad = torch.nan_to_num((fake_x0 - real_x0) / scale)
        x0, moved = denoised_frames(image, x0), denoised_frames(image, (x0 - grad).detach())  # TI2V's first: given
        parts = {"dmd": 0.5 * F.mse_loss(x0, moved)}
        if self.points is not None:
            parts["regression"] = self.points.loss(run, step, micro)
            parts["loss"] = parts["dmd"] + self.regression_weight * parts["regression"]
        return total(parts), logged(parts), span

    # -- its parts --------------------------------------------------------------------------------------------
    def _prompts(self, run, g: torch.Generator):
        # The training prompts alone (an image folder's held-out captions are not among them), each with its image.
        prompt_idx = torch.randint(len(self.embeddings.embeds), (self.batch_size,), generator=g)
        cond = self.embeddings.padded(prompt_idx, run.device)
        return prompt_idx, cond, self.embeddings.negative_batch(self.batch_size, run.device)

    def _autocast(self, run):
        dtype = run.precision.autocast_dtype
        return torch.autocast(run.device.type, dtype=dtype, enabled=dtype is not None)

    def _image(self, run, prompt_idx: torch.Tensor) -> ImageCondition | None:
        """The drawn prompts' images on the training device (None: text alone)."""
        return None if self.images is None else self.images.select(prompt_idx).to(run.device)

    def _generate(self, run, g: torch.Generator, cond: torch.Tensor, image: ImageCondition | None) -> torch.Tensor:
        """The student's x0 at a step j of its K drawn from `g` (backward simulation): j Euler steps from noise
        without gradient, then its x0 prediction x_j - sigma_j v_j (float32)."""
        x = torch.randn((self.batch_size, *self.latent_shape), generator=g).to(run.device)
        last = int(torch.randint(len(self.timesteps), (1,), generator=g))
        for i in range(last + 1):
            with torch.set_grad_enabled(torch.is_grad_enabled() and i == last), self._autocast(run):
                t = self.timesteps[i].expand(self.batch_size).to(run.device)
                v = run.model(x, t, cond, image)[0].float()
            if i < last:
                x = x + float(self.sigmas[i + 1] - self.sigmas[i]) * v
        return x - float(self.sigmas[last]) * v

    def _renoise(self, run, x0: torch.Tensor, g: torch.Generator):
        """x0 re-noised at a random t of the teacher's shifted schedule: (x_t, t, sigma [n,1,1,1,1], noise)."""
        low, high = T_RANGE
        sigma = shifted_sigmas(low + (high - low) * torch.rand(self.batch_size, generator=g), self.shift)
        noise = torch.randn((self.batch_size, *self.latent_shape), generator=g).to(run.device)
        s = sigma.to(run.device).view(-1, 1, 1, 1, 1)
        return (1 - s) * x0 + s * noise, (sigma * self.train_timesteps).to(run.device), s, noise


def data_parallel(fake: torch.nn.Module, device: torch.device, group) -> torch.nn.Module:
    """The fake score under DDP over the training ranks' `group` where there are several, else itself."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        return fake

    ids = [device.index] if device.type == "cuda" else None
    # A two-expert teacher's LoRA: a rank whose samples all fall to one expert leaves the other's adapters unused.
    unused = isinstance(fake, AdaptedTeacher) and len(fake.adapters) > 1
    return DistributedDataParallel(fake, device_ids=ids, process_group=group, find_unused_parameters=unused)


def teacher_shaped(ctx) -> torch.nn.Module:
    """A trainable network of the teacher's shape, started from its first expert's weights, in the student's dtype."""
    from diffusers import WanTransformer3DModel

    spec, name = ctx.spec, ctx.spec.experts[0]
    with loading(spec, name):
        transformer = WanTransformer3DModel.from_pretrained(
            spec.path, subfolder=name, dtype=ctx.precision.student_dtype, use_safetensors=True
        )
    apply_loras(transformer, name, spec.loras)  # a fine-tuned teacher's LoRAs: it starts from the teacher it is
    fake = Student(transformer.requires_grad_(True))
    fake.layout = spec.layout  # it takes what the teacher takes: an image-to-video teacher's image too
    return fake


class LoraFakeScore(AdaptedTeacher):
    """`method.fake_score=lora`: the placed teacher's own frozen experts with trainable rank-`rank` adapters on each
    (teacher/lora.py `AdaptedTeacher`), switched on for this module's calls alone: the real score runs the same
    modules with them off, so the teacher's weights are held once. Its parameters (its optimizer's, its
    checkpoint's) are the adapters'. B starts at zero: it starts as the teacher's own unguided velocity, DMD2's start.

    Each sample goes to the expert that serves its t, as in the real score (`Teacher.expert_index`): at every t the
    fake score starts from the very network the real score runs there, the two differing by the adapters (and
    guidance) alone. (The teacher-shaped fake score starts from the first expert at every t: a trainable copy of
    both would cost another teacher; adapters on both cost little.) Beside a LoRA student (`student=lora`) it is a
    second adapter set on the same experts: each set's hooks read their own flag."""


OPTION = Option("dmd", DmdConfig, DMD)
