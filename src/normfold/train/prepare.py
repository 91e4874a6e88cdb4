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

This module builds the recipes from the plan and undoes them; the parts live beside it: `phi.py` (the
recipes φ = h(θ) and their cache), `swap.py` (the class swaps and hooks), `probes.py` (the probe forwards
that check reachability and locate dropouts), `prepared.py` (the state kept on the model).

Since g(h(θ)) = f(θ) for every θ, the loss, ∇θ and therefore every optimizer step equal those of
the LayerNorm model, up to floating-point rounding.
"""

from __future__ import annotations


from torch import Tensor, nn

from .. import algebra, fastpath
from ..adapters import Adapter, ConversionPlan, NormSite, find_adapter
from ..adapters.base import get
from ..errors import UnsupportedConversionError, UnsupportedModelError
from ..options import ConvertOptions, resolve as resolve_options
from .phi import ModuleSpec, Recipe, Step, new_generation
from .prepared import STATE_ATTR, PreparedState, StreamState, is_prepared, state
from .probes import functional_dropout, locate_dropouts, probe_inputs, unreached_norms
from .swap import NormSpec, prepared_class, prepared_norm_class, recenter_hook, recenter_pre_hook

__all__ = ["TARGETS", "PreparedState", "prepare", "restore", "invalidate", "set_cache", "is_prepared", "state"]

TARGETS = ("rmsnorm", "crmsnorm")
_Recipe = Recipe  # the old private name, patched by tests/train/test_ecosystem.py


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
            keep_affine: bool | None = None, fold_final: bool | None = None,
            cache: bool = True, adapter: Adapter | None = None, inputs: dict | None = None,
            dropout: str = "exact", check: bool = True, fast: bool = True) -> nn.Module:
    """Make `model` (a Pre-LN model) compute as Pre-RMSNorm (`to="rmsnorm"`) or Pre-CRMSNorm
    (`to="crmsnorm"`, width d kept: docs/training.md) while its parameters stay θ. In place; returns
    `model`. Parameters, their names, `state_dict()` keys and module types seen by optimizers and
    checkpoints are unchanged.

    options / keywords: a `normfold.ConvertOptions` or its fields `to`, `keep_affine`, `fold_final`.
    keep_affine: keep each norm's γ/β in the norm (True) or fold them into its linear readers where
        `normfold.convert` would (False).
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
    fast: run the residual add and the next norm as one pass inside the blocks of the families that
        `normfold.fastpath` knows (forward and backward, the same fused blocks `normfold.load` uses);
        False keeps transformers' block code. `restore` undoes it.
    """
    options = resolve_options(options, "train.prepare", to=to, keep_affine=keep_affine, fold_final=fold_final)
    to, fold_final = options.to, options.fold_final
    if options.pad or options.allow_new_bias or options.variant_options or options.rotate or options.rotate_online:
        raise UnsupportedConversionError("train.prepare takes to, keep_affine and fold_final; pad, allow_new_bias, "
                                         "rotate and variant options have no training form")
    if to not in TARGETS:
        raise UnsupportedConversionError(f"prepare(to={to!r}): choose one of {', '.join(TARGETS)}")
    options = options.check()  # the rules every conversion follows (ConvertOptions.check)
    # the training default keeps γ/β in the norm for rmsnorm and folds them for crmsnorm (docs/python-api.md)
    fold = (to == "crmsnorm") if options.keep_affine is None else not options.keep_affine
    if is_prepared(model):
        raise UnsupportedConversionError("model is already prepared; call normfold.train.restore(model) first")
    adapter = _adapter_for(model, adapter, inputs)
    if adapter.check is not None:
        adapter.check(model)
    plan: ConversionPlan = adapter.plan(model)
    st = PreparedState(to=to, adapter=adapter.name, cache=cache, fold=fold, fold_final=fold_final)
    specs: dict[int, tuple[nn.Module, ModuleSpec]] = {}

    def spec_of(module: nn.Module) -> ModuleSpec:
        if id(module) not in specs:
            specs[id(module)] = (module, ModuleSpec())
        return specs[id(module)][1]

    def recipe(module: nn.Module, attr: str) -> Recipe:
        sp = spec_of(module)
        return sp.recipes.setdefault(attr, Recipe(attr))

    crms = to == "crmsnorm"
    writer_modules: dict[str, nn.Module] = {}
    for stream in plan.streams:
        ss = StreamState(stream.name)
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
                r.steps.append(Step("center", -1, writer=True))
                if crms:
                    r.steps.append(Step("zero_last", -1, writer=True))
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
                        r.steps.append(Step("center", dim, writer=True))
                        if crms:
                            r.steps.append(Step("zero_last", dim, writer=True))
                spec_of(obj).stream = ss
                writer_modules[path] = obj
            st.writers.append(path)
        for path in stream.recenter_after:
            m = get(model, path)
            st.hooks.append((m, m.register_forward_hook(recenter_hook(crms)).id))
        for path in stream.recenter_before:
            m = get(model, path)
            st.hooks.append((m, m.register_forward_pre_hook(recenter_pre_hook(crms), with_kwargs=True).id))

    for module, sp in specs.values():
        attrs = tuple(sorted(sp.recipes))
        module.__dict__["_nf_spec"] = sp
        module.__class__ = prepared_class(type(module), attrs)
        st.modules.append(module)
    for m in model.modules():
        m.__dict__["_nf_root"] = st
    object.__setattr__(model, STATE_ATTR, st)
    probe = probe_inputs(model, adapter, inputs)
    if probe is not None and check:
        # φ must reach every norm: a parameter read outside its own module's forward (a head computing
        # F.linear(h, self.embed.weight)) would silently skip it
        bad = unreached_norms(model, plan, probe, crms, training=False)
        if bad:
            restore(model)
            first = next(iter(bad.values()))[0]
            raise UnsupportedConversionError(
                f"after prepare, the input of {first} is not {'compressed' if crms else 'zero-mean'} in eval mode: some "
                "stream writer's parameter is read outside that module's forward, so φ does not reach it. "
                "This model family is not supported by normfold.train (the model was left unprepared).")
    if dropout == "exact" and (any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
                               or functional_dropout(model)):
        locate_dropouts(model, adapter, plan, writer_modules, specs, st, probe, crms)
    if fast:
        fastpath.fuse_blocks(model)
    return model


def _prepare_norm(model, site: NormSite, fold: bool, fold_final: bool, crms: bool, ss: StreamState,
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
                recipe(reader, lay.bias).steps.append(Step("fold_b", lay.in_dim, norm=ln, weight_attr=lay.weight))
            r = recipe(reader, lay.weight)
            if fold_gamma:
                r.steps.append(Step("fold_w", lay.in_dim, norm=ln))
            if crms:
                r.steps.append(Step("compress_in", lay.in_dim))
        st.folded.append(site.path)
    keep_w = gamma is not None and not fold_gamma
    keep_b = beta is not None and not fold_beta
    if crms and folded and (keep_w or keep_b):  # pragma: no cover - the rules above fold both or neither
        raise AssertionError(site.path)
    ln.__dict__["_nf_norm"] = NormSpec(to="rmsnorm" if not crms else "crmsnorm", keep_weight=keep_w,
                                        keep_bias=keep_b, stream=ss)
    ln.__class__ = prepared_norm_class(type(ln))
    st.modules.append(ln)
    st.norms.append(site.path)


def restore(model: nn.Module) -> nn.Module:
    """Undo `prepare` in place: the plain LayerNorm model with its (trained) θ. Returns `model`."""
    st = state(model)
    for m in model.modules():
        fastpath.unfuse_block(m)
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
    object.__delattr__(model, STATE_ATTR)
    return model


def invalidate() -> None:
    """Drop every cached φ. Needed only after changing θ in place outside a torch.optim optimizer
    without bumping its version counter (e.g. a custom fused kernel); load_state_dict, copy_ and
    every torch.optim optimizer are detected."""
    new_generation()


def set_cache(model: nn.Module, enabled: bool) -> None:
    """Turn the once-per-optimizer-step φ cache on or off (off: φ recomputed in every forward)."""
    st = state(model)
    st.cache = enabled
    for m in st.modules:
        sp = m.__dict__.get("_nf_spec")
        if sp is not None:
            sp.cache.clear()
