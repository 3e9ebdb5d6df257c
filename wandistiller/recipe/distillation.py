"""The distillation recipe: what one process of a run builds (`setup`) and runs (`train`).

`recipe._target_` in the config names this class; a subclass can replace any `_setup_*` step. Each
step builds one thing from the config and the earlier steps; runtime objects (devices, dtypes, process
groups, parameters) are passed in code, never through YAML.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel

from wandistiller.core.distributed import Topology, gather, local_device, made_once, roles_for
from wandistiller.core.errors import human_count
from wandistiller.core.files import enclosing_run
from wandistiller.core.precision import Precision
from wandistiller.data import sources as data_sources
from wandistiller.data.batches import BatchSettings, batch_source
from wandistiller.data.conditions import ImageBank
from wandistiller.data.prompts import encode_prompts, read_prompts
from wandistiller.data.validation import drop_rows_after, split_prompts
from wandistiller.recipe import hooks, outputs
from wandistiller.recipe.context import Prepared, RunContext
from wandistiller.recipe.loop import Run, memory_metrics, train_loop
from wandistiller.recipe.losses import as_loss
from wandistiller.recipe.samples import sample_grids
from wandistiller.recipe.targets import LocalTargets, OwnerTargets, RemoteTargets, WholeStepTargets, serve
from wandistiller.state.checkpoint import checkpoint_step, load_checkpoint, restore, teacher_record
from wandistiller.state.received import targets_of
from wandistiller.student.compile import compile_kwargs
from wandistiller.student.lora import LoraStudent, is_lora
from wandistiller.student.model import build_student
from wandistiller.student.prune import write_record
from wandistiller.teacher.fastpaths import quantize_teacher, use_attention_backend
from wandistiller.teacher.model import compile_blocks, log_first_call
from wandistiller.tracking import loggers
from wandistiller.tracking.loggers import Loggers

log = logging.getLogger("wandistiller")


class DistillationRecipe:
    """One process's view of the run: who it is, where it computes, what it trains."""

    def __init__(self, cfg: DictConfig, prepared: Prepared, topo: Topology):
        self.cfg, self.prepared, self.topo = cfg, prepared, topo
        placement = prepared.placement
        roles = roles_for(placement.serving, topo)
        # What data sources, outputs and hooks read (frozen): this process's facts, settled once, here.
        self.ctx = RunContext(
            teacher_cfg=cfg.teacher,
            data_cfg=cfg.data,
            trainer_cfg=cfg.trainer,
            student_cfg=cfg.student,
            seed=cfg.seed,
            cache_dir=str(cfg.paths.cache_dir),
            spec=prepared.spec,
            placement=placement,
            topo=topo,
            roles=roles,
            precision=Precision.from_config(cfg.precision),
            device=local_device(topo) if roles.trains else placement.teacher_device(topo),
            run_dir=Path(prepared.run_dir),
            teacher_path=prepared.teacher_path,
            sweep_point=prepared.sweep_point,
            overrides=prepared.overrides,
            student_steps=prepared.method.steps,
            student_schedule=getattr(prepared.method, "schedule", None),
        )
        self.run: Run | None = None
        # An image-to-video teacher's images per prompt, once setup has made the data (None: text alone).
        self.images: ImageBank | None = None
        self.held_out_images: ImageBank | None = None

    # -- setup: each step takes what it needs and returns what it builds --------------------------------
    def setup(self) -> None:
        embeddings, val_embeddings = self._setup_embeddings()
        self.teacher = self._setup_teacher()
        made = self._setup_latents(self.teacher, embeddings, val_embeddings)
        self.latent_bank, self.embeddings, self.val_embeddings = made.bank, made.embeddings, made.val_embeddings
        self.images = made.images  # an image-to-video teacher's conditioning per prompt (None: text alone)
        self.batch_fn = self._setup_batches(self.embeddings, self.latent_bank, self.images)
        self.val_set = self._setup_val_set(self.teacher, self.val_embeddings, made.val_images)
        self.samples = self._setup_samples(self.teacher, self.embeddings)
        self.held_out_images = made.val_images  # what the collapse watch's probe gives an image-to-video teacher
        self.method = self._setup_method(self.teacher, self.embeddings)
        resume_from = Path(self.prepared.resume_from) if self.prepared.resume_from else None
        self.start_step = checkpoint_step(resume_from) if resume_from else 0
        # Only training ranks need the optimizer and student states; a dedicated owner needs the step alone.
        state = load_checkpoint(resume_from) if resume_from and self.ctx.roles.trains else None
        self.student_group = dist.new_group(list(self.ctx.roles.students)) if self.topo.distributed else None
        if not self.ctx.roles.trains:
            self._setup_layers(None)  # a dedicated owner builds no student, but asks its teacher for the same blocks
            return
        student = self._setup_student()
        optimizer, lr_scheduler, scaler, ema = self._setup_optimization(student, state)
        # The method's own networks beside the student (dmd's fake score), before DDP wraps the student.
        self.method.bind(self.ctx, student, self.cfg.trainer, state, self.student_group)
        tracker = self._setup_tracker(state)
        if self.ctx.is_main:  # as the loggers drop them: the steps past the checkpoint are trained again
            drop_rows_after(Path(self.ctx.run_dir), self.start_step)
        self.run = Run(
            model=self._wrap_ddp(student),
            targets=self._setup_targets(),
            batch_fn=self.batch_fn,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            scaler=scaler,
            ema=ema,
            tracker=tracker,
            precision=self.ctx.precision,
            device=self.ctx.device,
            run_dir=self.ctx.run_dir,
            loss_fn=self.loss_fn,
            dp_rank=self.ctx.roles.dp_rank,
            is_main=self.ctx.is_main,
            student_group=self.student_group if self.topo.distributed else None,
            hooks=self._setup_hooks(self.val_set, self.samples),
            teacher=teacher_record(self.ctx.spec, self.cfg.teacher.path),  # each checkpoint records its teacher
            method=self.method,
        )

    def _setup_embeddings(self):
        """(training, held-out) prompt embeddings: the main rank encodes (or finds them cached), then the
        others read the cache."""
        cfg, ctx = self.cfg, self.ctx
        train, held_out = split_prompts(
            read_prompts(cfg.data.prompts_path), cfg.data.val_prompts_path, cfg.data.val_fraction
        )
        encode = functools.partial(
            encode_prompts,
            ctx.spec,
            negative_prompt=cfg.teacher.negative_prompt,
            max_sequence_length=cfg.teacher.max_sequence_length,
            dtype=ctx.precision.teacher_dtype,
            cache_dir=ctx.cache_dir,
            # The shipped prompts, read where data.prompts_path is unset (an image or video source's run, which
            # trains on its captions): generic words a pocket teacher does not know, said of no file the user gave
            warn_unknown=cfg.data.prompts_path is not None,
        )
        where = ctx.placement.teacher_device(self.topo) if ctx.roles.has_teacher else ctx.device
        cpu = torch.device("cpu")
        both = lambda device: (encode(train, device=device), encode(held_out, device=device))
        return made_once(self.topo, lambda: both(where), lambda: both(cpu), makes=ctx.is_main)

    def _setup_latents(self, teacher, embeddings, val_embeddings) -> data_sources.Made:
        """x0 for training from `data.latents`'s source (wandistiller/data/sources/): None (Gaussian), the
        teacher's own samples, or encoded images (whose captions then replace the prompts)."""
        return data_sources.training_data(self.ctx, teacher, embeddings, val_embeddings)

    def _setup_teacher(self):
        if not self.ctx.roles.has_teacher:
            return None
        teacher = self.ctx.placement.load(self.ctx.spec, self.cfg.teacher, self.ctx.precision, self.topo)
        # The opt-in fast paths, before compiling (a graph then sees the fp8 layers).
        quantize_teacher(teacher, self.cfg.teacher.quantize)
        use_attention_backend(teacher, self.cfg.teacher.attention_backend)
        if self.cfg.teacher.compile and self.ctx.placement.compilable:
            for expert in teacher.experts:
                compile_blocks(expert)
            log.info("teacher.compile: the teacher's first forward compiles its blocks (a minute or more)")
        return teacher

    def _setup_batches(self, embeddings, latent_bank, images=None):
        cfg, spec = self.cfg, self.ctx.spec
        shift = cfg.teacher.flow_shift or spec.flow_shift
        return batch_source(
            BatchSettings(
                cfg.seed,
                cfg.trainer.batch_size,
                self.ctx.latent_shape,
                shift,
                spec.num_train_timesteps,
                embeddings,
                latent_bank=latent_bank,
                device=self.ctx.device,
                keep_x0=self.loss_fn.needs.x0,
                images=images,
            )
        )

    @functools.cached_property
    def loss_fn(self):
        """`trainer.loss` (wandistiller.recipe.losses), built once: its `needs` decide what the loop computes,
        what the batches carry, what the teacher returns and which projections the student builds."""
        return as_loss(instantiate(self.cfg.trainer.loss))

    def _setup_method(self, teacher, embeddings):
        """`method` (wandistiller/recipe/methods/): what one training step does; what it samples from the teacher
        once (trajectory's ODE points) is made here, by the ranks that hold a teacher, and read by the others. It is
        the one preflight built and checked (`prepared.method`; a worker's is its unpickled copy)."""
        method = self.prepared.method
        method.prepare(self.ctx, teacher, embeddings, self.images)
        return method

    def _setup_val_set(self, teacher, val_embeddings, val_images):
        """The held-out set, made where a hook validates (`hooks.monitor.val_every` > 0); None otherwise."""
        validating = hooks.configured(self.cfg.hooks, "validates")
        if not (validating and validating.val_every):
            return None
        return data_sources.val_set(self.ctx, teacher, val_embeddings, val_images)

    def _setup_samples(self, teacher, embeddings):
        """The sample grid (recipe/samples.py) of the hook that draws them (`hooks.samples`), its teacher column drawn
        now, by every rank together; None without samples. The hook decides when the student is drawn into it."""
        drawing = hooks.configured(self.cfg.hooks, "draws_samples")
        if not drawing:
            return None
        # An image-to-video teacher's clips start from the training prompts' own images.
        return sample_grids(self.ctx, teacher, embeddings, drawing.prompts, drawing.steps, self.images)

    def _setup_hooks(self, val_set, samples) -> list:
        """`hooks` (monitor, progress, samples, ...), instantiated in order and bound to this run."""
        held_out = None if self.held_out_images is None else (self.val_embeddings, self.held_out_images)
        parts = hooks.HookParts(val_set, samples, tuple(targets_of(self.cfg)), held_out)
        return hooks.build(self.cfg.hooks, self.ctx, parts)

    def _setup_student(self) -> torch.nn.Module:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        # _partial_: runtime objects go in as they are (instantiate would turn the spec dataclass into a config).
        build = instantiate(cfg.student, _partial_=True)
        hidden = self.loss_fn.needs.student_hidden  # passed only when the loss matches hidden states
        # A LoRA student is the placed teacher plus adapters (student/lora.py): it is built on that teacher.
        on_teacher = {"teacher": self.teacher} if is_lora(cfg.student) else {}
        # The default builder takes the config preflight checked (a builder of the user's checks its own keys).
        checked = {"checked": self.prepared.student_config} if build.func is build_student else {}
        student = build(
            spec=self.ctx.spec,
            dtype=self.ctx.precision.student_dtype,
            **({"hidden_layers": hidden} if hidden else {}),
            **on_teacher,
            **checked,
        )
        if self.ctx.is_main and getattr(student, "pruning", None):  # a student cut from the teacher: what it kept
            write_record(student.pruning, self.ctx.run_dir)
        self._setup_layers(student)
        student.to(self.ctx.device).train()
        if cfg.trainer.gradient_checkpointing:
            student.transformer.enable_gradient_checkpointing()  # (refused with a LoRA student: preflight)
        if cfg.trainer.compile_student:
            student.transformer.compile_repeated_blocks(**compile_kwargs(cfg.trainer.compile_mode))
            # On the transformer, not a block: compile_repeated_blocks compiles each block's whole call, hooks
            # included, and a logging hook inside a fullgraph is a graph break torch.compile refuses.
            log_first_call(student.transformer, "the student's block graph (forward; backward follows)")
        log.info(
            "rank %d (pid %d): student %s params on %s; teacher %s (%s)",
            self.topo.rank,
            os.getpid(),
            human_count(sum(p.numel() for p in student.parameters())),
            self.ctx.device,
            self.ctx.placement.name,
            "here" if self.ctx.roles.has_teacher else f"served by rank {self.ctx.roles.owner}",
        )
        return student

    def _setup_layers(self, student) -> None:
        """A loss that picks its blocks from the student's depth and keep-map (one with `resolve`: loss=features)
        settles them here, once the student is built, and the student builds their projections. The first
        training rank's depth and keep-map go to every rank (one all-gather), so every rank, a teacher owner that
        builds no student included, asks its teacher for the same blocks (scoring the keep-map again elsewhere
        would cost a pass over the teacher's weights)."""
        resolve = getattr(self.loss_fn, "resolve", None)
        if resolve is None:
            return
        shape = student_shape(student, self.ctx.spec) if student is not None else None
        if self.topo.distributed:
            shape = gather(self.topo, {"shape": shape})[self.ctx.roles.main]["shape"]
        assert shape is not None  # the main rank trains
        resolve(self.ctx.spec.transformer_config["num_layers"], *shape)
        needs = self.loss_fn.needs
        log.info(
            "trainer.loss matches (teacher block, student block) %s",
            list(zip(needs.teacher_hidden, needs.student_hidden)),
        )
        if student is not None:
            student.match(needs.student_hidden, self.ctx.precision.student_dtype)

    def _setup_optimization(self, student: torch.nn.Module, state: dict | None):
        """Optimizer, LR schedule, grad scaler and EMA, restored from the checkpoint when resuming."""
        from diffusers.optimization import get_scheduler
        from diffusers.training_utils import EMAModel

        t = self.cfg.trainer
        params = [p for p in student.parameters() if p.requires_grad]
        optimizer = instantiate(t.optimizer)(params, **({"fused": True} if self.ctx.device.type == "cuda" else {}))
        lr_scheduler = get_scheduler(
            str(t.lr_scheduler),
            optimizer,
            num_warmup_steps=t.warmup_steps,
            num_training_steps=t.schedule_steps or t.max_steps,  # a resume's: its first launch's (job/resumed.py)
        )
        # Past a resumed run's schedule (a longer max_steps): its last LR, never a new curve. A constant schedule's
        # LR does not depend on its length: its warm-up goes on as a first launch of the whole length would have it.
        if t.schedule_steps and hasattr(lr_scheduler, "lr_lambdas") and str(t.lr_scheduler) not in ENDLESS_SCHEDULES:
            lr_scheduler.lr_lambdas = [held_after(f, t.schedule_steps) for f in lr_scheduler.lr_lambdas]
        scaler = torch.amp.GradScaler(self.ctx.device.type, enabled=self.ctx.precision.needs_grad_scaler)
        ema = EMAModel(params, decay=t.ema_decay) if t.ema_decay else None
        if state is not None:
            restore(state, student, optimizer, lr_scheduler, scaler, ema)
            log.info("resuming at step %d", state["step"])
        return optimizer, lr_scheduler, scaler, ema

    def _setup_tracker(self, state: dict | None):
        """Every configured logger behind one (`logger=[wandb,tensorboard,csv]`), on the main rank; a resumed
        run continues the tracker run its checkpoint names."""
        if not self.ctx.is_main:
            return Loggers([])
        tracker = loggers.build(self.cfg.logger)
        point = self.prepared.sweep_point or {}
        config = cast(dict, OmegaConf.to_container(self.cfg, resolve=True)) | {
            "teacher_placement": self.ctx.placement.name
        }
        run_id = state.get("tracker_run_id") if state else None
        if self.prepared.resume_from:  # a checkpoint of another folder (a run's, or copied out of one) continued
            of_run = enclosing_run(Path(self.prepared.resume_from))  # here: a tracker run of its own
            if of_run is None or of_run.resolve() != Path(self.ctx.run_dir).resolve():
                run_id = None
        tracker.start(
            self.ctx.run_dir, config, run_id, point.get("group"), point.get("name"), start_step=self.start_step
        )
        return tracker

    def _wrap_ddp(self, student: torch.nn.Module) -> torch.nn.Module:
        if len(self.ctx.roles.students) == 1:
            return student
        return wrap_ddp(student, self.ctx.device, self.student_group)

    def _setup_targets(self):
        """Where this rank's teacher targets come from: an owner, its own teacher, or its own for a whole step."""
        roles, inputs = self.ctx.roles, self.student_inputs()
        if roles.owner is not None:
            return RemoteTargets(roles.owner, self.ctx.spec.transformer_config, self.transfer_device(), inputs)
        if roles.served:
            return OwnerTargets(
                self.teacher, list(roles.served), self.batch_fn, self.transfer_device(), self.served_text()
            )
        if self.cfg.trainer.teacher_whole_step:
            return WholeStepTargets(self.teacher, self.batch_fn, roles.dp_rank, self.cfg.trainer.grad_accum_steps)
        return LocalTargets(self.teacher)

    def student_inputs(self) -> bool:
        """Whether the method calls the teacher at inputs the student makes (dmd): the run's method says (its class)."""
        return self.prepared.method.student_inputs

    def served_text(self):
        """How an owner looks up the text (and image) of the inputs its ranks send (a method whose inputs the
        student makes: their prompt indices into the training prompts), None where it rebuilds whole batches from
        the seed."""
        if not self.student_inputs():
            return None
        embeddings, images, device = self.embeddings, self.images, self.ctx.placement.teacher_device(self.topo)

        def text(idx: torch.Tensor):
            image = None if images is None else images.select(idx).to(device)  # the image each prompt comes with
            return embeddings.padded(idx, device), embeddings.negative_batch(len(idx), device), image

        return text

    def transfer_device(self) -> torch.device:
        """Where served targets travel: CUDA (NCCL) when teacher and students are on GPUs, else CPU (gloo)."""
        teacher_device = self.ctx.placement.teacher_device(self.topo)
        if teacher_device.type != "cuda":
            return torch.device("cpu")
        return self.ctx.device if self.ctx.roles.trains and not self.ctx.roles.has_teacher else teacher_device

    # -- train: the loop (or serving), then the outputs -----------------------------------------------
    def train(self) -> dict:
        """The loop, then the outputs; the loggers closed however it ends (a stop, a crash, a non-finite loss),
        so what they buffered is written."""
        try:
            return self._train()
        finally:
            if self.run is not None:  # a dedicated owner has no loggers
                self.run.tracker.close()

    def _train(self) -> dict:
        cfg, roles = self.cfg, self.ctx.roles
        if roles.trains:
            assert self.run is not None  # setup built it on every training rank
            history = train_loop(self.run, cfg.trainer, self.start_step)
            role = "owner + student" if roles.has_teacher and roles.served else "student"
            rank_summary = {"rank": self.topo.rank, "role": role} | memory_metrics()
        else:  # a dedicated owner: serve until the students are done
            log.info(
                "rank %d: teacher owner on %s serving ranks %s",
                self.topo.rank,
                self.teacher.device,
                [s.rank for s in roles.served],
            )
            # A method that trains without the teacher (trajectory, from its cache) gets no targets served.
            steps = range(self.start_step, cfg.trainer.max_steps) if self.method.teacher_in_loop else range(0)
            stats = serve(
                self.teacher,
                list(roles.served),
                self.batch_fn,
                steps,
                cfg.trainer.grad_accum_steps,
                self.loss_fn.needs.teacher_hidden,
                self.transfer_device(),
                text=self.served_text(),
            )
            rank_summary = {"rank": self.topo.rank, "role": "teacher owner"} | stats | memory_metrics()
            history = []
        ranks = gather(self.topo, rank_summary)
        self.teacher = None  # freed: the end-of-run evaluation (hooks.evaluate) loads its own
        if not self.ctx.is_main:
            return ranks[self.topo.rank]
        return outputs.finish(self.ctx, self.run, history, ranks)


def student_shape(student, spec) -> tuple[int, list[int] | None]:
    """The student's depth and, when it was cut from this teacher, the teacher block each of its blocks came from
    (its keep-map, `student.pruning`); None for a student started at random or from another folder."""
    pruning = getattr(student, "pruning", None) or {}
    kept = pruning.get("kept_blocks") if pruning.get("source") == str(spec.path / "transformer") else None
    return student.transformer.config.num_layers, (list(kept) if kept is not None else None)


def wrap_ddp(student: torch.nn.Module, device: torch.device, group) -> torch.nn.Module:
    """The student under DDP over the training ranks' `group`. A LoRA student (student/lora.py) holds its adapters
    alone (the teacher is no submodule of it), so DDP broadcasts and averages those; with a two-expert teacher a
    rank whose samples all fall to one expert leaves the other's adapters unused in that step."""

    ids = [device.index] if device.type == "cuda" else None
    unused = isinstance(student, LoraStudent) and len(student.adapters) > 1
    return DistributedDataParallel(student, device_ids=ids, process_group=group, find_unused_parameters=unused)


# Schedules whose LR does not depend on their length: a resume may train past its first launch's max_steps.
ENDLESS_SCHEDULES = ("constant", "constant_with_warmup")


def held_after(factor, steps: int):
    """An LR factor (a LambdaLR's) held at its value at `steps` from there on: diffusers' cosine climbs again past
    its length."""
    return lambda step: factor(min(step, steps))
