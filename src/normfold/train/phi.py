"""φ = h(θ): the per-parameter recipes (centre a writer, fold a norm's γ/β into a reader, compress) and
the once-per-optimizer-step cache that hands φ to a prepared module's forward."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.optim import optimizer as _optim

from . import functional as F
from .prepared import StreamState, root_state


# ---- per-parameter recipes: φ = h(θ) ------------------------------------------------------------------

@dataclass
class Step:
    kind: str  # center | zero_last | fold_w | fold_b | compress_in
    dim: int = -1
    norm: nn.Module | None = None  # the LayerNorm whose γ/β is folded
    weight_attr: str = "weight"
    writer: bool = False  # part of centring a writer (skipped in training when dropout follows it)


_LINEAR = ("center", "zero_last", "compress_in")


@dataclass
class Recipe:
    attr: str
    steps: list[Step] = field(default_factory=list)

    def inputs(self, module: nn.Module) -> list[Tensor]:
        xs = [module._parameters[self.attr]]
        for s in self.steps:
            if s.kind == "fold_w":
                xs.append(s.norm.weight)
            elif s.kind == "fold_b":
                xs += [module._parameters[s.weight_attr], s.norm.bias]
        return xs

    @property
    def linear(self) -> bool:
        """φ = A·θ with θ the recipe's only input (centre, zero_last, compress_in: no γ/β folded)."""
        return all(s.kind in _LINEAR for s in self.steps)

    def transpose(self, grad: Tensor, writer_on: bool) -> Tensor:
        """Aᵀ·grad for a `linear` recipe: each step's transpose, last step first (the VJP of `run`)."""
        for s in reversed(self.steps):
            if s.writer and not writer_on:
                continue
            if s.kind == "compress_in":
                grad = F.compress_reader_padded_adjoint(grad, s.dim)
            else:  # centring and zeroing a slice are symmetric
                grad = F.center(grad, s.dim) if s.kind == "center" else F.zero_last(grad, s.dim)
        return grad

    def run(self, xs: list[Tensor], writer_on: bool) -> Tensor:
        t, k = xs[0], 1
        for s in self.steps:
            if s.kind == "fold_w":
                t, k = F.fold_weight(t, xs[k], s.dim), k + 1
                continue
            if s.kind == "fold_b":
                t, k = F.fold_bias(t, xs[k], xs[k + 1], s.dim), k + 2
                continue
            if s.writer and not writer_on:
                continue
            if s.kind == "center":
                t = F.center(t, s.dim)
            elif s.kind == "zero_last":
                t = F.zero_last(t, s.dim)
            elif s.kind == "compress_in":
                t = F.compress_reader_padded(t, s.dim)
        return t


@dataclass
class ModuleSpec:
    recipes: dict[str, Recipe] = field(default_factory=dict)
    dropouts: list[nn.Module] = field(default_factory=list)  # element-wise dropouts right after this writer
    stream: "StreamState | None" = None
    cache: dict = field(default_factory=dict)

    def __deepcopy__(self, memo):  # a copy starts with an empty φ cache (its entries hold autograd graphs)
        return ModuleSpec(copy.deepcopy(self.recipes, memo), copy.deepcopy(self.dropouts, memo),
                           copy.deepcopy(self.stream, memo), {})



def writer_on(module: nn.Module, spec: ModuleSpec) -> bool:
    if not module.training:
        return True
    if spec.stream is not None and spec.stream.layernorm_in_training:
        return False
    return not any(d.training and d.p > 0 for d in spec.dropouts)


class Reuse(torch.autograd.Function):
    """Hands out a cached φ; its backward runs the VJP of h through the cached graph (kept with
    retain_graph), so φ is computed once per θ version (once per optimizer step) however many
    micro-batches, checkpoint recomputations or backward passes use it."""

    @staticmethod
    def forward(ctx, entry, *thetas):
        ctx.entry = entry
        return entry.out.detach()

    @staticmethod
    def backward(ctx, grad):
        e = ctx.entry
        grads = torch.autograd.grad(e.out, e.leaves, grad, retain_graph=True, allow_unused=True)
        return (None, *(g if need else None for g, need in zip(grads, e.need)))


class LinearPhi(torch.autograd.Function):
    """Hands out a cached φ = A·θ of a `linear` recipe; its backward is Aᵀ·grad, computed directly.
    No graph is kept and autograd is not re-entered per parameter (as `Reuse` does): for Pre-RMSNorm's
    centred writers that is two ops per parameter instead of an autograd.grad call of five."""

    @staticmethod
    def forward(ctx, entry, recipe, on, theta):
        ctx.recipe, ctx.on = recipe, on
        return entry.out.detach()

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, ctx.recipe.transpose(grad, ctx.on)


@dataclass
class Entry:
    key: tuple
    out: Tensor
    leaves: list[Tensor]
    need: list[bool]


# Every torch.optim optimizer step (fused ones included, which do not bump tensors' version counters)
# starts a new generation: a cached φ is only reused within one generation, for the same θ tensors at
# the same version and storage.
GENERATION = [0]


def new_generation(*_args) -> None:
    GENERATION[0] += 1


_optim.register_optimizer_step_post_hook(new_generation)


def _same(t):
    return t


def compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except Exception:  # pragma: no cover
        return False


def _no_autocast():
    if torch.is_autocast_enabled("cpu") or (torch.cuda.is_available() and torch.is_autocast_enabled("cuda")):
        return torch.autocast("cuda" if torch.is_autocast_enabled("cuda") else "cpu", enabled=False)
    return contextlib.nullcontext()


def _phi_linear(module: nn.Module, spec: ModuleSpec, recipe: Recipe, attr: str) -> Tensor | None:
    """`phi` for a linear recipe (one input θ): φ computed without a graph once per θ version, handed out
    through LinearPhi. Kept short: it runs once per edited parameter per forward, between large ops that
    leave the interpreter's caches cold."""
    theta = module._parameters[attr]
    if theta is None:
        return None
    on = writer_on(module, spec)
    state = root_state(module)
    if compiling() or state is None or not state.cache:
        with _no_autocast():
            return recipe.run([theta], on)
    key = (on, GENERATION[0], id(theta), theta._version, theta.data_ptr())
    entry = spec.cache.get(attr)
    if entry is None or entry.key != key:
        with torch.no_grad(), _no_autocast():
            entry = Entry(key, recipe.run([theta], on), [], [])
        spec.cache[attr] = entry
    if theta.requires_grad and torch.is_grad_enabled():
        return LinearPhi.apply(entry, recipe, on, theta)
    return entry.out.detach()


def phi(module: nn.Module, attr: str) -> Tensor | None:
    spec: ModuleSpec = module.__dict__["_nf_spec"]
    recipe = spec.recipes[attr]
    if recipe.linear:
        return _phi_linear(module, spec, recipe, attr)
    xs = recipe.inputs(module)
    if xs[0] is None:
        return None
    on = writer_on(module, spec)
    state = root_state(module)
    with _no_autocast():
        if compiling() or state is None or not state.cache or any(x is None for x in xs):
            return recipe.run(xs, on)
        key = (on, GENERATION[0], *((id(x), x._version, x.data_ptr()) for x in xs))
        entry = spec.cache.get(attr)
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in xs)
        if entry is None or entry.key != key or (grad and not entry.leaves):
            if grad:
                leaves = [x.detach().requires_grad_(x.requires_grad) for x in xs]
                # identity saved-tensor hooks: the cached graph's tensors are not seen by an enclosing
                # activation checkpoint (whose recomputation will hit the cache and save nothing)
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
                    out = recipe.run(leaves, on)
                entry = Entry(key, out, leaves, [x.requires_grad for x in xs])
            else:
                with torch.no_grad():
                    entry = Entry(key, recipe.run(xs, on), [], [])
            spec.cache[attr] = entry
        if grad:
            return Reuse.apply(entry, *xs)
        return entry.out.detach()
