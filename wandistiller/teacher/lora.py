"""Low-rank adapters (LoRA: Hu et al. 2021) on a frozen Wan expert, switched on only inside `Adapters.active()`:
the same module then gives the teacher's own output (adapters off: targets, samples, validation) and an adapted
one (on: dmd's `method.fake_score=lora`), with one copy of its weights. peft is not a dependency: this is the
little of it that is needed.

Each adapted Linear `y = W x + b` gets `+ (alpha / rank) B(A x)` (alpha = rank: a scale of 1) from a forward
hook; B starts at zero, so an adapted expert starts equal to the teacher. Adapted: in every block, the attention
projections of self- and cross-attention (to_q, to_k, to_v, to_out.0) and the FFN's two Linears.

The hooks are registered once and read a flag (no hook bookkeeping per call). Not on a compiled teacher
(teacher.compile: dmd refuses it): torch.compile does not see module hooks added after it traced a block.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

# Inside each block (blocks.<i>.<name>).
TARGETS = tuple(f"attn{a}.to_{p}" for a in (1, 2) for p in ("q", "k", "v", "out.0")) + ("ffn.net.0.proj", "ffn.net.2")


def targets(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The Linear layers an adapter goes on, by name (`blocks.<i>.attn1.to_q`, ...), in module order."""
    found = []
    for name, module in model.named_modules():
        parts = name.split(".", 2)
        if parts[0] == "blocks" and len(parts) == 3 and parts[2] in TARGETS and isinstance(module, nn.Linear):
            found.append((name, module))
    return found


def adapter_count(model: nn.Module, rank: int) -> int:
    """Trainable parameters of rank-`rank` adapters on `model` (a meta skeleton will do)."""
    return sum(rank * (m.in_features + m.out_features) for _, m in targets(model))


class Adapters(nn.Module):
    """Rank-`rank` adapters on `model`'s target layers; their parameters are this module's (`model` stays frozen
    and is not a submodule: saving these saves the adapters alone)."""

    def __init__(self, model: nn.Module, rank: int, dtype: torch.dtype = torch.float32, seed: int = 0):
        super().__init__()
        found = targets(model)
        if not found:
            raise ValueError("no Linear layer to adapt: not a Wan transformer (blocks.<i>.attn1.to_q, ...)")
        self.rank, self.scale = rank, 1.0  # alpha = rank
        self.on = False
        self.down, self.up = nn.ParameterDict(), nn.ParameterDict()
        g = torch.Generator().manual_seed(seed)  # every rank starts from the same A
        for name, linear in found:
            key = name.replace(".", "_")  # a parameter's name holds no dot
            down = torch.empty(rank, linear.in_features, dtype=dtype)
            nn.init.kaiming_uniform_(down, a=math.sqrt(5), generator=g)  # nn.Linear's (and peft's) init of A
            device = linear.weight.device
            self.down[key] = nn.Parameter(down.to(device))
            self.up[key] = nn.Parameter(torch.zeros(linear.out_features, rank, dtype=dtype, device=device))
            linear.register_forward_hook(functools.partial(self._adapt, key))

    def _adapt(self, key: str, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not self.on:
            return None  # the teacher's own output
        down, up = self.down[key], self.up[key]
        delta = F.linear(F.linear(inputs[0].to(down.dtype), down), up)
        return output + self.scale * delta.to(output.dtype)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The adapted model inside the block; the teacher's own outside it (an exception included)."""
        self.on = True
        try:
            yield
        finally:
            self.on = False
