"""Train a Pre-LN model as Pre-RMSNorm / Pre-CRMSNorm with its LayerNorm parameters θ (paper 001 §3.5).

    model = normfold.train.prepare(model, to="rmsnorm")   # in place; θ, names and keys unchanged
    ...train as usual (any optimizer, scheduler, Trainer, DDP, FSDP2, torch.compile)...
    normfold.train.export(model, "out-dir")               # a normal converted checkpoint
    normfold.train.restore(model)                         # back to the plain LayerNorm model

How: every module the conversion would edit keeps its parameters θ where they are
(`module._parameters`, so `state_dict()`, `named_parameters()`, `load_state_dict()` and every
optimizer see the LayerNorm model's θ under its own names), and its class is swapped for a subclass
with a property per edited attribute: `module.weight` read inside `forward` returns φ = h(θ) (the
centred writer, the reader with the norm's γ/β folded in), computed by differentiable torch ops, so
gradients reach θ. The same trick as `torch.nn.utils.parametrize`, without its
`parametrizations.*.original` renaming. Each LayerNorm on the stream becomes a subclass of its own
class (so `isinstance(m, nn.LayerNorm)` still holds: Trainer's no-weight-decay rule for norm
parameters is unchanged) whose forward is RMSNorm (or CRMSNorm). What to centre and fold comes from
the adapter's ConversionPlan (or `normfold.analyze(model).to_adapter()`), the same plan
`normfold.convert` uses, with the same folding rules.

Since g(h(θ)) = f(θ) for every θ, the loss, ∇θ and therefore every optimizer step equal those of
the LayerNorm model, up to floating-point rounding.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.optim import optimizer as _optim

from .. import algebra, ops
from ..adapters import Adapter, ConversionPlan, NormSite, find_adapter
from ..adapters.base import get
from ..errors import UnsupportedConversionError, UnsupportedModelError
from ..options import ConvertOptions, resolve as resolve_options
from . import functional as F

TARGETS = ("rmsnorm", "crmsnorm")
_STATE = "_normfold_train"


# ---- per-parameter recipes: φ = h(θ) ------------------------------------------------------------------

@dataclass
class _Step:
    kind: str  # center | zero_last | fold_w | fold_b | compress_in
    dim: int = -1
    norm: nn.Module | None = None  # the LayerNorm whose γ/β is folded
    weight_attr: str = "weight"
    writer: bool = False  # part of centring a writer (skipped in training when dropout follows it)


@dataclass
class _Recipe:
    attr: str
    steps: list[_Step] = field(default_factory=list)

    def inputs(self, module: nn.Module) -> list[Tensor]:
        xs = [module._parameters[self.attr]]
        for s in self.steps:
            if s.kind == "fold_w":
                xs.append(s.norm.weight)
            elif s.kind == "fold_b":
                xs += [module._parameters[s.weight_attr], s.norm.bias]
        return xs

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
class _ModuleSpec:
    recipes: dict[str, _Recipe] = field(default_factory=dict)
    dropouts: list[nn.Module] = field(default_factory=list)  # element-wise dropouts right after this writer
    stream: "_StreamState | None" = None
    cache: dict = field(default_factory=dict)

    def __deepcopy__(self, memo):  # a copy starts with an empty φ cache (its entries hold autograd graphs)
        return _ModuleSpec(copy.deepcopy(self.recipes, memo), copy.deepcopy(self.dropouts, memo),
                           copy.deepcopy(self.stream, memo), {})


@dataclass
class _StreamState:
    name: str
    layernorm_in_training: bool = False  # fallback: an element-wise dropout on this stream was not located


def _writer_on(module: nn.Module, spec: _ModuleSpec) -> bool:
    if not module.training:
        return True
    if spec.stream is not None and spec.stream.layernorm_in_training:
        return False
    return not any(d.training and d.p > 0 for d in spec.dropouts)


class _Reuse(torch.autograd.Function):
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


@dataclass
class _Entry:
    key: tuple
    out: Tensor
    leaves: list[Tensor]
    need: list[bool]


# Every torch.optim optimizer step (fused ones included, which do not bump tensors' version counters)
# starts a new generation: a cached φ is only reused within one generation, for the same θ tensors at
# the same version and storage.
_GENERATION = [0]


def _new_generation(*_args) -> None:
    _GENERATION[0] += 1


_optim.register_optimizer_step_post_hook(_new_generation)


def _same(t):
    return t


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except Exception:  # pragma: no cover
        return False


def _no_autocast():
    if torch.is_autocast_enabled("cpu") or (torch.cuda.is_available() and torch.is_autocast_enabled("cuda")):
        return torch.autocast("cuda" if torch.is_autocast_enabled("cuda") else "cpu", enabled=False)
    return contextlib.nullcontext()


def _phi(module: nn.Module, attr: str) -> Tensor | None:
    spec: _ModuleSpec = module.__dict__["_nf_spec"]
    recipe = spec.recipes[attr]
    xs = recipe.inputs(module)
    if xs[0] is None:
        return None
    on = _writer_on(module, spec)
    state = _root_state(module)
    with _no_autocast():
        if _compiling() or state is None or not state.cache or any(x is None for x in xs):
            return recipe.run(xs, on)
        key = (on, _GENERATION[0], *((id(x), x._version, x.data_ptr()) for x in xs))
        entry = spec.cache.get(attr)
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in xs)
        if entry is None or entry.key != key or (grad and not entry.leaves):
            if grad:
                leaves = [x.detach().requires_grad_(x.requires_grad) for x in xs]
                # identity saved-tensor hooks: the cached graph's tensors are not seen by an enclosing
                # activation checkpoint (whose recomputation will hit the cache and save nothing)
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
                    out = recipe.run(leaves, on)
                entry = _Entry(key, out, leaves, [x.requires_grad for x in xs])
            else:
                with torch.no_grad():
                    entry = _Entry(key, recipe.run(xs, on), [], [])
            spec.cache[attr] = entry
        if grad:
            return _Reuse.apply(entry, *xs)
        return entry.out.detach()


_CLASSES: dict[tuple, type] = {}


def _get(self: nn.Module, attr: str):
    # φ while this module's own forward runs (or inside torch.compile, which only traces forwards);
    # θ, the registered Parameter, everywhere else: FSDP2, transformers' weight tying, optimizers and
    # users reading `module.weight` between steps see the real parameter.
    if self.__dict__.get("_nf_active") or _compiling():
        return _phi(self, attr)
    return self._parameters[attr]


def _active_forward(base):
    def forward(self, *args, **kwargs):
        if _compiling():
            return base(self, *args, **kwargs)
        d = self.__dict__
        d["_nf_active"] = d.get("_nf_active", 0) + 1
        try:
            return base(self, *args, **kwargs)
        finally:
            d["_nf_active"] -= 1

    return forward


def _prepared_class(cls: type, attrs: tuple[str, ...]) -> type:
    key = (cls, attrs)
    if key not in _CLASSES:
        props = {a: property(lambda self, a=a: _get(self, a)) for a in attrs}
        props["_normfold_original_class"] = cls
        props["forward"] = _active_forward(cls.forward)
        _CLASSES[key] = type(f"Prepared{cls.__name__}", (cls,), props)
    return _CLASSES[key]


# ---- the norms -------------------------------------------------------------------------------------

@dataclass
class _NormSpec:
    to: str
    keep_weight: bool
    keep_bias: bool
    stream: _StreamState


def _crms_scale(x: Tensor) -> Tensor:
    """ops.crms_norm on width d uses d+1 in its statistic; a constant √(d/(d+1)) weight corrects it."""
    d = x.shape[-1]
    return torch.full((d,), (d / (d + 1)) ** 0.5, dtype=x.dtype, device=x.device)


def _norm_forward(self: nn.Module, x: Tensor) -> Tensor:
    s: _NormSpec = self.__dict__["_nf_norm"]
    eps = float(self.eps)
    w = self.weight if s.keep_weight else None
    b = self.bias if s.keep_bias else None
    fallback = self.training and s.stream.layernorm_in_training
    if s.to == "rmsnorm":
        if fallback:
            x = x - x.mean(-1, keepdim=True)
        return ops.rms_norm(x, w, b, eps)
    if fallback:
        x = F.compress_padded(x)
    d = x.shape[-1]
    if w is None and b is None:
        # the readers were folded and compressed: they ignore the last coordinate, no decompression
        return ops.crms_norm(x, _crms_scale(x), None, eps * d / (d + 1))
    y = F.decompress_padded(F.crms_norm_padded(x, eps))
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


_NORM_CLASSES: dict[type, type] = {}


def _prepared_norm_class(cls: type) -> type:
    if cls not in _NORM_CLASSES:
        _NORM_CLASSES[cls] = type(f"Prepared{cls.__name__}", (cls,),
                                  {"forward": _norm_forward, "_normfold_original_class": cls})
    return _NORM_CLASSES[cls]


# ---- state kept on the root model --------------------------------------------------------------------

@dataclass
class PreparedState:
    """What `prepare` did (`model._normfold_train`); `restore` undoes it."""

    to: str
    adapter: str
    cache: bool
    modules: list[nn.Module] = field(default_factory=list)
    norms: list[str] = field(default_factory=list)
    folded: list[str] = field(default_factory=list)
    writers: list[str] = field(default_factory=list)
    dropouts: dict[str, list[str]] = field(default_factory=dict)
    fallback_streams: list[str] = field(default_factory=list)
    hooks: list = field(default_factory=list)  # (module, hook id)
    streams: list[_StreamState] = field(default_factory=list)
    fold: bool = True
    fold_final: bool = False

    def summary(self) -> str:
        lines = [f"prepared for {self.to} training ({self.adapter} adapter): {len(self.norms)} LayerNorm(s) computed as "
                 f"{'RMSNorm' if self.to == 'rmsnorm' else 'CRMSNorm'}, {len(self.writers)} writer(s) centred, "
                 f"{len(self.folded)} affine(s) folded into readers"]
        for d, ws in self.dropouts.items():
            lines.append(f"  dropout {d} after {', '.join(ws)}: writer left uncentred in training, output recentred")
        for s in self.fallback_streams:
            lines.append(f"  stream {s}: an element-wise dropout could not be located; in training mode its norms "
                         "centre their input (LayerNorm arithmetic, exact, no speed-up)")
        return "\n".join(lines)


def _root_state(module: nn.Module) -> PreparedState | None:
    return module.__dict__.get("_nf_root")


def is_prepared(model: nn.Module) -> bool:
    return getattr(model, _STATE, None) is not None


def state(model: nn.Module) -> PreparedState:
    st = getattr(model, _STATE, None)
    if st is None:
        raise UnsupportedConversionError("this model was not prepared with normfold.train.prepare")
    return st


# ---- prepare / restore ------------------------------------------------------------------------------

def _adapter_for(model: nn.Module, adapter: Adapter | None, inputs: dict | None) -> Adapter:
    if adapter is not None:
        return adapter
    try:
        return find_adapter(model)
    except UnsupportedModelError:
        if inputs is None:
            raise
        from ..analysis import analyze

        # structural: verdicts that hold for every θ (not "γ happens to be constant right now"); eval
        # mode: dropout is handled by prepare itself (the trace would see it as a non-zero-mean op)
        was = model.training
        try:
            return analyze(model.eval(), inputs, structural=True).to_adapter()
        finally:
            model.train(was)


def _linear_reader_bias(reader: nn.Module) -> Tensor | None:
    lay = algebra.layout_of(reader)
    return getattr(reader, lay.bias, None) if lay.bias else None


def prepare(model: nn.Module, to: str | None = None, *, options: ConvertOptions | None = None,
            keep_affine: bool | None = None, fold: bool | None = None, fold_final: bool | None = None,
            cache: bool = True, adapter: Adapter | None = None, inputs: dict | None = None,
            dropout: str = "exact", check: bool = True) -> nn.Module:
    """Make `model` (a Pre-LN model) compute as Pre-RMSNorm (`to="rmsnorm"`) or Pre-CRMSNorm
    (`to="crmsnorm"`, width d kept: docs/training.md) while its parameters stay θ. In place; returns
    `model`. Parameters, their names, `state_dict()` keys and module types seen by optimizers and
    checkpoints are unchanged.

    options / keywords: a `normfold.ConvertOptions` or its fields `to`, `keep_affine`, `fold_final`.
    keep_affine: keep each norm's γ/β in the norm (True) or fold them into its linear readers where
        `normfold.convert` would (False). `fold=` is the deprecated spelling (fold = not keep_affine).
        Default: keep for rmsnorm — in training φ is recomputed every step, and folding costs a pass over
        every reader's weight (and its VJP) while the affine inside the norm kernel is nearly free; fold
        for crmsnorm, whose compressed readers need the fold.
    fold_final: also fold the final norm (as with `convert(fold_final=True)`).
    cache: compute φ once per θ version (once per optimizer step) in eager mode; under
        torch.compile φ is traced into the compiled graph instead.
    inputs: example forward kwargs, used to locate element-wise dropouts on the stream (default:
        the adapter's example inputs) and, for models without an adapter, for the analysis.
    dropout: "exact" (default): an element-wise dropout right after a stream writer (or after the
        embedding sum) leaves that writer uncentred in training mode and recentres the dropout's
        output; a dropout that cannot be located makes that stream's norms centre their input in
        training mode (LayerNorm arithmetic). "ignore": skip this (only for dropout-free models).
    check: run the example inputs once in eval mode and refuse (UnsupportedConversionError, model left
        unprepared) if some norm's input is not zero-mean, i.e. φ did not reach a writer.
    """
    if fold is not None:  # the old spelling, with the opposite sense
        warnings.warn("train.prepare(fold=...) is deprecated; use keep_affine=... (keep_affine = not fold)",
                      DeprecationWarning, stacklevel=2)
        if keep_affine is None:
            keep_affine = not fold
    options = resolve_options(options, "train.prepare", to=to, keep_affine=keep_affine, fold_final=fold_final)
    to, fold_final = options.to, options.fold_final
    if options.pad or options.allow_new_bias or options.variant_options:
        raise UnsupportedConversionError("train.prepare takes to, keep_affine and fold_final; pad, allow_new_bias and "
                                         "variant options have no training form")
    if to not in TARGETS:
        raise UnsupportedConversionError(f"prepare(to={to!r}): choose one of {', '.join(TARGETS)}")
    # the training default keeps γ/β in the norm for rmsnorm and folds them for crmsnorm (docs/python-api.md)
    fold = (to == "crmsnorm") if options.keep_affine is None else not options.keep_affine
    if is_prepared(model):
        raise UnsupportedConversionError("model is already prepared; call normfold.train.restore(model) first")
    adapter = _adapter_for(model, adapter, inputs)
    if adapter.check is not None:
        adapter.check(model)
    plan: ConversionPlan = adapter.plan(model)
    st = PreparedState(to=to, adapter=adapter.name, cache=cache, fold=fold, fold_final=fold_final)
    specs: dict[int, tuple[nn.Module, _ModuleSpec]] = {}

    def spec_of(module: nn.Module) -> _ModuleSpec:
        if id(module) not in specs:
            specs[id(module)] = (module, _ModuleSpec())
        return specs[id(module)][1]

    def recipe(module: nn.Module, attr: str) -> _Recipe:
        sp = spec_of(module)
        return sp.recipes.setdefault(attr, _Recipe(attr))

    crms = to == "crmsnorm"
    writer_modules: dict[str, nn.Module] = {}
    for stream in plan.streams:
        ss = _StreamState(stream.name)
        st.streams.append(ss)
        # readers first (fold, then compress), writers after (centre the folded map), like convert
        for site in stream.norms:
            _prepare_norm(model, site, fold, fold_final, crms, ss, st, recipe)
        for path in stream.writers:
            obj = get(model, path)
            if isinstance(obj, nn.Parameter):
                parent_path, _, leaf = path.rpartition(".")
                parent = get(model, parent_path) if parent_path else model
                r = recipe(parent, leaf)
                r.steps.append(_Step("center", -1, writer=True))
                if crms:
                    r.steps.append(_Step("zero_last", -1, writer=True))
                spec_of(parent).stream = ss
                writer_modules[path] = parent
            else:
                lay = algebra.layout_of(obj)
                if lay is None:
                    raise UnsupportedConversionError(f"stream writer {path} is a {type(obj).__name__}, which normfold "
                                                     "cannot centre")
                for attr, dim in ((lay.weight, lay.out_dim), (lay.bias, -1)):
                    if attr and getattr(obj, attr, None) is not None:
                        r = recipe(obj, attr)
                        r.steps.append(_Step("center", dim, writer=True))
                        if crms:
                            r.steps.append(_Step("zero_last", dim, writer=True))
                spec_of(obj).stream = ss
                writer_modules[path] = obj
            st.writers.append(path)
        for path in stream.recenter_after:
            m = get(model, path)
            st.hooks.append((m, m.register_forward_hook(_recenter_hook(crms)).id))
        for path in stream.recenter_before:
            m = get(model, path)
            st.hooks.append((m, m.register_forward_pre_hook(_recenter_pre_hook(crms), with_kwargs=True).id))

    for module, sp in specs.values():
        attrs = tuple(sorted(sp.recipes))
        module.__dict__["_nf_spec"] = sp
        module.__class__ = _prepared_class(type(module), attrs)
        st.modules.append(module)
    for m in model.modules():
        m.__dict__["_nf_root"] = st
    object.__setattr__(model, _STATE, st)
    probe = _example_inputs(model, adapter, inputs)
    if probe is not None and check:
        # φ must reach every norm: a parameter read outside its own module's forward (a head computing
        # F.linear(h, self.embed.weight)) would silently skip it
        bad = _unreached_norms(model, plan, probe, crms, training=False)
        if bad:
            restore(model)
            first = next(iter(bad.values()))[0]
            raise UnsupportedConversionError(
                f"after prepare, the input of {first} is not {'compressed' if crms else 'zero-mean'} in eval mode: some "
                "stream writer's parameter is read outside that module's forward, so φ does not reach it. "
                "This model family is not supported by normfold.train (the model was left unprepared).")
    if dropout == "exact" and (any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
                               or _functional_dropout(model)):
        _locate_dropouts(model, adapter, plan, writer_modules, specs, st, probe, crms)
    return model


def _functional_dropout(model: nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    return any(float(getattr(cfg, k, 0) or 0) > 0 for k in ("dropout", "activation_dropout")) if cfg else False


def _prepare_norm(model, site: NormSite, fold: bool, fold_final: bool, crms: bool, ss: _StreamState,
                  st: PreparedState, recipe) -> None:
    ln = get(model, site.path)
    if not isinstance(ln, nn.LayerNorm):
        raise UnsupportedConversionError(f"{site.path} is a {type(ln).__name__}, not a LayerNorm; the adapter's "
                                         "plan does not match this model")
    if len(ln.normalized_shape) != 1:
        raise UnsupportedConversionError(f"{site.path} normalizes over {tuple(ln.normalized_shape)}")
    gamma, beta = ln.weight, getattr(ln, "bias", None)
    readers = [get(model, r) for r in site.readers]
    do_fold = fold and bool(readers) and (not site.final or fold_final) and \
        all(algebra.is_linear_reader(r) for r in readers)
    # same rules as convert.swap_norm, decided on the presence of β (its value changes in training)
    fold_beta = do_fold and beta is not None and all(_linear_reader_bias(r) is not None for r in readers)
    fold_gamma = do_fold and gamma is not None and (beta is None or fold_beta)
    folded = fold_gamma or fold_beta
    # not folded under crmsnorm: the norm decompresses and applies γ/β itself; readers stay as they are
    if folded:
        for reader in readers:
            lay = algebra.layout_of(reader)
            if fold_beta:
                recipe(reader, lay.bias).steps.append(_Step("fold_b", lay.in_dim, norm=ln, weight_attr=lay.weight))
            r = recipe(reader, lay.weight)
            if fold_gamma:
                r.steps.append(_Step("fold_w", lay.in_dim, norm=ln))
            if crms:
                r.steps.append(_Step("compress_in", lay.in_dim))
        st.folded.append(site.path)
    keep_w = gamma is not None and not fold_gamma
    keep_b = beta is not None and not fold_beta
    if crms and folded and (keep_w or keep_b):  # pragma: no cover - the rules above fold both or neither
        raise AssertionError(site.path)
    ln.__dict__["_nf_norm"] = _NormSpec(to="rmsnorm" if not crms else "crmsnorm", keep_weight=keep_w,
                                        keep_bias=keep_b, stream=ss)
    ln.__class__ = _prepared_norm_class(type(ln))
    st.modules.append(ln)
    st.norms.append(site.path)


def _recenter_hook(crms: bool):
    def hook(module, args, output):
        return F.compress_padded(output) if crms else output - output.mean(-1, keepdim=True)

    return hook


def _recenter_pre_hook(crms: bool):
    def fix(x):
        return F.compress_padded(x) if crms else x - x.mean(-1, keepdim=True)

    def hook(module, args, kwargs):
        if args and isinstance(args[0], Tensor):
            return (fix(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), Tensor):
            return args, {**kwargs, "hidden_states": fix(kwargs["hidden_states"])}
        raise TypeError(f"normfold: cannot find the stream input of {type(module).__name__} to recenter")

    return hook


def _dropout_hook(crms: bool):
    def hook(module, args, output):
        if module.training and module.p > 0:
            return F.compress_padded(output) if crms else output - output.mean(-1, keepdim=True)
        return output

    return hook


# ---- dropout -----------------------------------------------------------------------------------------

def _locate_dropouts(model, adapter, plan, writer_modules, specs, st: PreparedState, inputs, crms) -> None:
    """Find element-wise dropouts on the stream with one probe forward in training mode.

    A dropout whose input is a writer's output (the end of a residual branch), or whose output is
    the first norm's input (dropout after the embedding sum): that writer (the stream's sources) is
    left uncentred in training mode and the dropout's output is recentred, which is exact:
    C(m⊙b) is what the LayerNorm model's norms see. Centring the writer *and* recentring after the
    dropout (paper 001 §4.1, read literally) would compute C(m⊙Cb) ≠ C(m⊙b). A second probe checks
    that every norm input is zero-mean in training mode; a stream where it is not (dropout applied
    by functional code, out of reach of module hooks) falls back to LayerNorm arithmetic in training.
    """
    if inputs is None:
        return
    names = {id(m): n for n, m in model.named_modules()}
    writer_by_module = {id(m): p for p, m in writer_modules.items()}
    keep: list = []
    outs: dict[int, str] = {}
    drop_in: list[tuple[nn.Module, int]] = []
    drop_out: dict[int, nn.Module] = {}
    first_norm_in: dict[int, int] = {}  # id(input) -> stream index
    handles = []
    first_norms = {id(get(model, s.norms[0].path)): i for i, s in enumerate(plan.streams) if s.norms}

    def w_hook(m, a, o):
        if isinstance(o, Tensor):
            keep.append(o)
            outs[id(o)] = writer_by_module[id(m)]

    def d_pre(m, a):
        if a and isinstance(a[0], Tensor):
            keep.append(a[0])
            drop_in.append((m, id(a[0])))

    def d_post(m, a, o):
        keep.append(o)
        drop_out[id(o)] = m

    def n_pre(m, a):
        if a and isinstance(a[0], Tensor):
            keep.append(a[0])
            first_norm_in[id(a[0])] = first_norms[id(m)]

    for p, m in writer_modules.items():
        if isinstance(get(model, p), nn.Module):
            handles.append(m.register_forward_hook(w_hook))
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            handles += [m.register_forward_pre_hook(d_pre), m.register_forward_hook(d_post)]
        if id(m) in first_norms:
            handles.append(m.register_forward_pre_hook(n_pre))
    was = model.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.train()
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    hooked: set[int] = set()
    for m, i in drop_in:
        if i in outs:
            path = outs[i]
            spec = specs[id(writer_modules[path])][1]
            if m not in spec.dropouts:
                spec.dropouts.append(m)
            st.dropouts.setdefault(names[id(m)], []).append(path)
            hooked.add(id(m))
    for i, m in drop_out.items():
        if i in first_norm_in:
            stream = plan.streams[first_norm_in[i]]
            for path in stream.writers:
                wm = writer_modules[path]
                if _is_source(path, stream):
                    spec = specs[id(wm)][1]
                    if m not in spec.dropouts:
                        spec.dropouts.append(m)
                    st.dropouts.setdefault(names[id(m)], []).append(path)
            hooked.add(id(m))
    for m in model.modules():
        if id(m) in hooked:
            st.hooks.append((m, m.register_forward_hook(_dropout_hook(crms)).id))
    _check_training_stream(model, plan, st, inputs, crms)


def _is_source(path: str, stream) -> bool:
    """A stream source (embedding, position table, stem) rather than a block's branch writer."""
    return path in stream.writers[:_n_sources(stream)]


def _n_sources(stream) -> int:
    # writers are listed sources first, then per-block writers (StreamTemplate.expand); the sources are
    # those before the first writer that lives under the first norm's block
    first = stream.norms[0].path.rsplit(".", 1)[0] if stream.norms else ""
    for i, w in enumerate(stream.writers):
        if first and w.startswith(first + "."):
            return i
    return len(stream.writers)


def _example_inputs(model, adapter, inputs):
    if inputs is None:
        try:
            inputs = adapter.example_inputs(model, torch.Generator().manual_seed(0))
        except Exception:
            return None
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return {k: (v.to(dtype) if isinstance(v, Tensor) and v.is_floating_point() and dtype else v)
            for k, v in inputs.items()}


def _unreached_norms(model, plan, inputs, crms, training: bool) -> dict[str, list[str]]:
    """Run `inputs` (RNG state preserved) and return, per stream, the norms whose input is not
    zero-mean (rmsnorm) or whose last coordinate is not zero (crmsnorm)."""
    bad: dict[str, list[str]] = {}
    handles = []
    for stream in plan.streams:
        for site in stream.norms:
            def pre(m, a, name=stream.name, path=site.path):
                x = a[0].detach().double()
                rms = x.square().mean(-1).sqrt().clamp_min(1e-30)
                off = x[..., -1] if crms else x.mean(-1)
                if (off.abs() / rms).max().item() > 1e-4:
                    bad.setdefault(name, []).append(path)
            handles.append(get(model, site.path).register_forward_pre_hook(pre))
    was = model.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.train(training)
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    return bad


def _check_training_stream(model, plan, st: PreparedState, inputs, crms) -> None:
    bad = _unreached_norms(model, plan, inputs, crms, training=True)
    for ss in st.streams:
        if ss.name in bad:
            ss.layernorm_in_training = True
            st.fallback_streams.append(ss.name)


def restore(model: nn.Module) -> nn.Module:
    """Undo `prepare` in place: the plain LayerNorm model with its (trained) θ. Returns `model`."""
    st = state(model)
    for m, hook_id in st.hooks:  # (module, id), not RemovableHandles: those survive deepcopy pointing at the original
        for d in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                  "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
            getattr(m, d, {}).pop(hook_id, None)
    for m in st.modules:
        m.__class__ = m._normfold_original_class
        m.__dict__.pop("_nf_spec", None)
        m.__dict__.pop("_nf_norm", None)
    for m in model.modules():
        m.__dict__.pop("_nf_root", None)
    object.__delattr__(model, _STATE)
    return model


def invalidate() -> None:
    """Drop every cached φ. Needed only after changing θ in place outside a torch.optim optimizer
    without bumping its version counter (e.g. a custom fused kernel); load_state_dict, copy_ and
    every torch.optim optimizer are detected."""
    _new_generation()


def set_cache(model: nn.Module, enabled: bool) -> None:
    """Turn the once-per-optimizer-step φ cache on or off (off: φ recomputed in every forward)."""
    st = state(model)
    st.cache = enabled
    for m in st.modules:
        sp = m.__dict__.get("_nf_spec")
        if sp is not None:
            sp.cache.clear()
