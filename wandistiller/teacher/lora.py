"""Low-rank adapters (LoRA: Hu et al. 2021) on a frozen Wan expert, switched on only inside `Adapters.active()`:
the same module then gives the teacher's own output (adapters off: targets, samples, validation) and an adapted
one (on: a LoRA student, `student=lora`, and dmd's `method.fake_score=lora`), with one copy of its weights. Several
`Adapters` on one expert share its `Switch`, which names the one set that is on (or none): the student's and the
fake score's adapters are never on together.

Each adapted Linear `y = W x + b` (an nn.Linear, or an fp8 teacher's Fp8Linear: teacher/fp8.py, whose backward
passes the gradient to its input alone) gets `+ (alpha / rank) B(A x)` from a forward hook; B starts at zero, so an
adapted expert starts equal to the teacher. Adapted (`layers`): in every block, the attention projections of self-
and cross-attention (to_q, to_k, to_v, to_out.0) and the FFN's two Linears (`all`, the default), or the attention
ones alone (`attention`), or the FFN's (`ffn`), or a list of those names.

Why hooks for training, and peft only for the saved format and loading (`peft_state_dict`: the keys
`WanPipeline.save_lora_weights` writes and `load_lora_weights` reads, `blocks.0.attn1.to_q.lora_A.weight`): peft's
injection replaces each adapted Linear by a wrapper whose frozen weight is renamed `<name>.base_layer.weight` and
puts the trainable A and B inside the block. The streamed placements (placements/streaming.py: offload, disk) swap
each block's tensors in and out by their names in the teacher's own files, and move every tensor of a block as it
leaves: renamed weights would no longer be found, and the adapters would be streamed out with the frozen weights
(and their gradients and optimizer state with them). Here every teacher tensor stays where and what it is; the
adapters' parameters belong to their own module (`Adapters`: the one the optimizer and DDP see), and each adapted
Linear holds them only through a plain attribute (`LayerAdapters`, not a submodule: neither streamed nor moved).

Compiled (teacher.compile=true, teacher/model.py's regional compile): every adapted Linear runs the same hook
function (`adapt`) that reads the expert's switch and the layer's A and B through its attributes, so every block
traces to the same code. A compiled block sees the switch as a constant and A, B as graph inputs: one graph per
state (off; set k on; with and without grad), shared by all blocks, compiled on its first use and reused after, so
switching per call recompiles nothing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from wandistiller.teacher.fp8 import Fp8Linear
from wandistiller.teacher.image import ImageCondition, expert_inputs

if TYPE_CHECKING:
    from wandistiller.teacher.model import Teacher

# Inside each block (blocks.<i>.<name>).
ATTENTION = tuple(f"attn{a}.to_{p}" for a in (1, 2) for p in ("q", "k", "v", "out.0"))
FFN = ("ffn.net.0.proj", "ffn.net.2")
TARGETS = ATTENTION + FFN
LAYER_SETS = {"all": TARGETS, "attention": ATTENTION, "ffn": FFN}
ADAPTABLE = (nn.Linear, Fp8Linear)  # a 16-bit teacher's layers, or an fp8 one's (teacher.quantize=fp8)


def layer_names(layers) -> tuple[str, ...]:
    """The adapted Linear names inside a block for `layers`: all | attention | ffn, or a list of TARGETS' names
    (ValueError naming the allowed ones otherwise). None: all."""
    if layers is None:
        return TARGETS
    if isinstance(layers, str):
        if layers in LAYER_SETS:
            return LAYER_SETS[layers]
        raise ValueError(f"{layers!r} is not one of {', '.join(LAYER_SETS)} nor a list of layer names")
    names = tuple(str(n) for n in layers)
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names or len(set(names)) != len(names):
        why = f"{unknown[0]!r} is not an adaptable layer" if unknown else "it names none, or one twice"
        raise ValueError(f"{why}: give all, attention, ffn, or a list of {', '.join(TARGETS)}")
    return tuple(n for n in TARGETS if n in names)  # module order


def targets(model: nn.Module, names: Sequence[str] = TARGETS) -> list[tuple[str, nn.Linear | Fp8Linear]]:
    """The Linear layers an adapter goes on, by name (`blocks.<i>.attn1.to_q`, ...), in module order."""
    found: list[tuple[str, nn.Linear | Fp8Linear]] = []
    for name, module in model.named_modules():
        parts = name.split(".", 2)
        if parts[0] == "blocks" and len(parts) == 3 and parts[2] in names and isinstance(module, ADAPTABLE):
            found.append((name, module))
    return found


def layer_widths(config: dict, names: Sequence[str] = TARGETS) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adapted Linear of a Wan transformer, from its config.json alone."""
    inner, ffn = config["num_attention_heads"] * config["attention_head_dim"], config["ffn_dim"]
    widths = {n: (inner, inner) for n in ATTENTION} | {"ffn.net.0.proj": (inner, ffn), "ffn.net.2": (ffn, inner)}
    return {n: widths[n] for n in names}


def narrowest(config: dict, names: Sequence[str] = TARGETS) -> int:
    """The smallest side of the narrowest adapted Linear: a rank above it adds nothing but parameters."""
    return min(min(w) for w in layer_widths(config, names).values())


SWITCH, HELD = "wandistiller_switch", "wandistiller_adapters"  # plain attributes (not modules) of an expert, a Linear


class Switch:
    """Which adapter set of one expert is on (`active`: an index into each adapted layer's `LayerAdapters.sets`),
    None: none, the teacher's own output. One per expert, shared by all its blocks: a compiled block reads it as a
    constant, so each state (off, or set k on) is one graph for every block, and switching costs one assignment."""

    def __init__(self) -> None:
        self.active: int | None = None
        self.count = 0  # adapter sets made on this expert

    @staticmethod
    def of(model: nn.Module) -> Switch:
        """`model`'s switch (made on its first adapters): a plain attribute, so not a submodule (not moved,
        saved nor streamed)."""
        found = model.__dict__.get(SWITCH)
        if found is None:
            found = Switch()
            object.__setattr__(model, SWITCH, found)
        return found


class LayerAdapters:
    """What one adapted Linear holds of its adapters: per adapter set of its expert, its A, B and scale (None where
    that set does not adapt this layer). A plain attribute of the Linear, not a submodule: the Linear's own tensors
    stay what and where they are (the streamers find them by name and never move these), while a compiled block
    reaches A and B through it as graph inputs, by the same code in every block (`adapt`, one hook function)."""

    def __init__(self, switch: Switch) -> None:
        self.switch = switch
        self.sets: list[tuple[nn.Parameter, nn.Parameter, float] | None] = []

    @staticmethod
    def of(linear: nn.Module, switch: Switch) -> LayerAdapters:
        """`linear`'s adapters, made (and `adapt` hooked on, once) on its first set."""
        found = linear.__dict__.get(HELD)
        if found is None:
            found = LayerAdapters(switch)
            object.__setattr__(linear, HELD, found)
            linear.register_forward_hook(adapt)
        return found


def adapt(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
    """The forward hook of every adapted Linear: + scale B(A x) of the expert's active set, if it adapts this one.
    The same function everywhere, reading only its module's attributes: no closure differs between blocks."""
    held = cast(LayerAdapters, getattr(module, HELD))
    k = held.switch.active
    if k is None or k >= len(held.sets):
        return None  # the teacher's own output
    adapter = held.sets[k]
    if adapter is None:
        return None
    down, up, scale = adapter
    delta = F.linear(F.linear(inputs[0].to(down.dtype), down), up)
    return output + scale * delta.to(output.dtype)


def make_room(model: nn.Module) -> None:
    """Every adaptable layer of `model` holding its (empty) adapters and `adapt` hooked on, before any set exists:
    what a block compiled before its adapters are made must have traced (teacher/model.py `compile_blocks`)."""
    switch = Switch.of(model)
    for _, linear in targets(model):
        LayerAdapters.of(linear, switch)


def held_adapters(block: nn.Module) -> list[LayerAdapters]:
    """The adapters held by `block`'s layers (those that have any), in module order."""
    return [m.__dict__[HELD] for m in block.modules() if HELD in m.__dict__]


def strip_adapters(model: nn.Module) -> None:
    """Take every adapter off `model` (a copy of an adapted expert that should compute as the teacher alone)."""
    for module in model.modules():
        if module.__dict__.pop(HELD, None) is not None:
            hooks = module._forward_hooks
            for handle in [h for h, fn in hooks.items() if fn is adapt]:
                del hooks[handle]
    model.__dict__.pop(SWITCH, None)


class Adapters(nn.Module):
    """Rank-`rank` adapters on `model`'s target layers (`names`); their parameters are this module's (`model` stays
    frozen and is not a submodule: saving these saves the adapters alone). `alpha` None: alpha = rank (scale 1)."""

    def __init__(
        self,
        model: nn.Module,
        rank: int,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        alpha: float | None = None,
        names: Sequence[str] = TARGETS,
    ):
        super().__init__()
        found = targets(model, names)
        if not found:
            raise ValueError("no Linear layer to adapt: not a Wan transformer (blocks.<i>.attn1.to_q, ...)")
        self.rank, self.alpha = rank, float(alpha if alpha is not None else rank)
        self.scale = self.alpha / rank
        self.switch = Switch.of(model)
        self.index = self.switch.count  # this set's place in each adapted layer's `sets`
        self.switch.count += 1
        self.down, self.up = nn.ParameterDict(), nn.ParameterDict()
        self.layers: dict[str, str] = {}  # parameter key -> the Linear's name in the model
        g = torch.Generator().manual_seed(seed)  # every rank starts from the same A
        for name, linear in found:
            key = name.replace(".", "_")  # a parameter's name holds no dot
            self.layers[key] = name
            down = torch.empty(rank, linear.in_features, dtype=dtype)
            nn.init.kaiming_uniform_(down, a=math.sqrt(5), generator=g)  # nn.Linear's (and peft's) init of A
            device = linear.weight.device
            self.down[key] = nn.Parameter(down.to(device))
            self.up[key] = nn.Parameter(torch.zeros(linear.out_features, rank, dtype=dtype, device=device))
            held = LayerAdapters.of(linear, self.switch)
            held.sets += [None] * (self.index + 1 - len(held.sets))
            held.sets[self.index] = (self.down[key], self.up[key], self.scale)

    @property
    def on(self) -> bool:
        """Whether these adapters are the expert's active set."""
        return self.switch.active == self.index

    @on.setter
    def on(self, value: bool) -> None:
        if value:
            self.switch.active = self.index
        elif self.switch.active == self.index:
            self.switch.active = None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The adapted model inside the block; as it was before outside it (an exception included): a nested
        call of another set on the same expert replaces this one inside it, and gives it back after."""
        before, self.switch.active = self.switch.active, self.index
        try:
            yield
        finally:
            self.switch.active = before

    # -- the format diffusers and peft save and load ----------------------------------------------------------
    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapters under peft's names (`get_peft_model_state_dict`'s, without the `transformer.` prefix that
        `WanPipeline.save_lora_weights` adds): `<layer>.lora_A.weight` = A [rank, in], `.lora_B.weight` = B."""
        out = {}
        for key, name in self.layers.items():
            out[f"{name}.lora_A.weight"] = self.down[key].detach()
            out[f"{name}.lora_B.weight"] = self.up[key].detach()
        return out

    def peft_metadata(self) -> dict:
        """peft's LoraConfig of these adapters (saved beside them: diffusers reads its rank and alpha back)."""
        modules = sorted({name.split(".", 2)[2] for name in self.layers.values()})
        return {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": modules,
            "lora_dropout": 0.0,
            "bias": "none",
            "init_lora_weights": True,
        }

    def load_peft_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Adapters saved by `peft_state_dict` (a `transformer.` prefix dropped); KeyError or ValueError otherwise."""
        state = {k.removeprefix("transformer."): v for k, v in state.items()}
        expected = {f"{n}.lora_{s}.weight" for n in self.layers.values() for s in ("A", "B")}
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(f"the adapters hold other layers (missing {missing[:1]}, extra {extra[:1]})")
        with torch.no_grad():
            for key, name in self.layers.items():
                for side, param in (("A", self.down[key]), ("B", self.up[key])):
                    value = state[f"{name}.lora_{side}.weight"]
                    if tuple(value.shape) != tuple(param.shape):
                        raise ValueError(f"{name}.lora_{side} is {list(value.shape)}, here {list(param.shape)}")
                    param.copy_(value)

    @torch.no_grad()
    def merge_into(self, model: nn.Module) -> None:
        """W += (alpha / rank) B A in each adapted Linear of `model` (this expert's, or a copy of it): one
        teacher-sized transformer that computes what the adapted expert does, without hooks."""
        modules = dict(model.named_modules())
        for key, name in self.layers.items():
            linear = cast(nn.Linear, modules[name])
            if isinstance(linear, Fp8Linear):  # its 8-bit weight cannot hold W + BA; adapters trained on an fp8 base
                raise ValueError(f"{name} is fp8: merge into the 16-bit teacher (load_expert), as exports do")
            delta = self.scale * (self.up[key].double() @ self.down[key].double())
            linear.weight.copy_((linear.weight.double() + delta.to(linear.weight.device)).to(linear.weight.dtype))


class AdaptedTeacher(nn.Module):
    """The placed teacher's own frozen experts with trainable rank-`rank` adapters on each, switched on for this
    module's calls alone: the teacher's own calls (targets, the real score) run the same modules with them off, so
    its weights are held once. Its parameters (its optimizer's, its checkpoint's, DDP's) are the adapters'.

    Each sample goes to the expert that serves its t (`Teacher.expert_index`, the boundary in timestep space as
    WanPipeline switches): each expert's adapters train on the timesteps that expert serves."""

    def __init__(
        self,
        teacher: Teacher,
        rank: int,
        dtype: torch.dtype,
        seed: int,
        alpha: float | None = None,
        names: Sequence[str] = TARGETS,
    ):
        super().__init__()
        self.adapters = nn.ModuleList(
            Adapters(e, rank, dtype, seed + i, alpha, names) for i, e in enumerate(teacher.experts)
        )
        self.teacher = (teacher,)  # a tuple: not a submodule, so neither trained, moved nor saved with the adapters

    def forward(
        self, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor, image: ImageCondition | None = None
    ) -> tuple[torch.Tensor, None]:
        """The adapted experts' velocity; an image-to-video teacher's take `image` as the teacher's own do."""
        teacher = self.teacher[0]
        cond = cond.to(teacher.dtype)
        if len(teacher.experts) == 1:
            return self._expert(0, x_t, t, cond, image), None
        which, out = teacher.expert_index(t), None
        for i in range(len(teacher.experts)):
            rows = (which == i).nonzero().flatten()
            if rows.numel():
                pred = self._expert(i, x_t[rows], t[rows], cond[rows], None if image is None else image.select(rows))
                out = pred.new_empty((x_t.shape[0], *pred.shape[1:])) if out is None else out
                out[rows] = pred  # autograd follows the rows into `out`
        assert out is not None  # every sample has an expert
        return out, None

    def _expert(
        self, i: int, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor, image: ImageCondition | None
    ) -> torch.Tensor:
        """Expert i with its adapters on (gradient through its frozen weights to them)."""
        teacher = self.teacher[0]
        inputs = expert_inputs(teacher.spec.layout, teacher.patch, x_t, t, image, teacher.dtype)
        with cast(Adapters, self.adapters[i]).active():
            return teacher.experts[i](**inputs, encoder_hidden_states=cond, return_dict=False)[0]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Every expert's adapters on (a whole pipeline call through the experts: samples)."""
        with contextlib.ExitStack() as stack:
            for adapters in self.adapters:
                stack.enter_context(cast(Adapters, adapters).active())
            yield


@contextlib.contextmanager
def sampling_transformers(student: nn.Module) -> Iterator[tuple[list[nn.Module], list[float]]]:
    """What WanPipeline samples a student with, without CFG (it learned guided targets): a LoRA student's are the
    teacher's experts with its adapters on (for the block); another's its own transformer. DDP's wrapper unwrapped."""
    own = getattr(student, "module", student)
    if isinstance(own, AdaptedTeacher):
        experts = list(own.teacher[0].experts)
        with own.active():
            yield experts, [1.0] * len(experts)
    else:
        yield [cast(nn.Module, own.transformer)], [1.0]
