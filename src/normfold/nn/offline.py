"""Offline norms of paper 004's unified framework (§3.1, eq. 1-14): BN, MABN, PN* and Unified
Normalization (UN, §3.2-3.3, Algorithm 2, eq. 16-19).

An offline norm uses statistics that are fixed at inference, y = γ·(x − μ)/sqrt(σ² + ε) + β, so it
folds into an adjacent linear layer (`normfold.fuse_offline_norms`). In training it normalizes with
statistics Θ_σ² of recent batches (eq. 2-5) and estimates the gradient statistic ψ with Θ_g
(eq. 7-9). One module class covers every method; a `Method` row of the `METHODS` registry says which
statistics and which averaging functions it uses. Where the paper is ambiguous, the reading chosen
is written next to the code and collected in docs/unified-norm.md.

Statistics are per channel (the last dimension), over every non-padded token of the batch.
All state lives in buffers, so `state_dict` round-trips it. Under DistributedDataParallel the
statistics are those of each process's local batch (like nn.BatchNorm without SyncBatchNorm); with
DDP's default `broadcast_buffers=True`, every process starts each forward from rank 0's buffers,
so the windows and running statistics stay identical across processes (rank 0's history).
A training step is one forward and one backward: the forward records σ_t², the backward g_t
(activation checkpointing, which re-runs forwards, would record statistics twice).
"""

from __future__ import annotations

import contextlib
import numbers
import typing
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..algebra.offline import offline_affine

# ---- the framework table --------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """One row of the unified framework (which statistics, which averaging functions).

    centered: μ_t = batch mean and σ_t² = batch variance (BN, eq. 10); otherwise μ̂ = 0 and
        σ_t² = quadratic mean (eq. 13).
    forward: Θ_σ², the training statistic σ̂_t²: "current" (σ_t², eq. 11), "ema" (EMAS with η,
        footnote 1, eq. 14) or "gm" (geometric mean of the last M recorded σ², eq. 16).
    grad_window: Θ_g averages the last M_grad recorded gradient statistics (SMAS, footnote 2)
        instead of using only the current one.
    grad_momentum: None, "alpha" or "eta": ψ_t = ρ·ψ_{t−1} + (1 − ρ)·(that average) with ρ the
        named hyper-parameter (eq. 17 uses α; PN*'s EMAS uses η); None means ρ = 0.
    outlier_filtration: default of eq. 19 (needs forward == "gm").
    """

    name: str
    centered: bool
    forward: str
    grad_window: bool
    grad_momentum: str | None
    outlier_filtration: bool
    reference: str


METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    if method.forward not in FORWARD_AVERAGES:
        raise ValueError(f"unknown forward averaging {method.forward!r}; known: {', '.join(FORWARD_AVERAGES)}")
    METHODS[method.name] = method
    return method


# ---- Θ_σ²: forward averaging functions (registry, not if/elif) --------------------------------------

def _current(norm: "OfflineNorm", var_t: Tensor, t: int) -> Tensor:
    return var_t


def _ema(norm: "OfflineNorm", var_t: Tensor, t: int) -> Tensor:
    return norm.ema_var.to(var_t.dtype)  # already updated with var_t (EMAS includes K_t)


def _geometric_mean(norm: "OfflineNorm", var_t: Tensor, t: int) -> Tensor:
    return geometric_mean(norm.var_window[:min(t, norm.M)].to(var_t.dtype))


FORWARD_AVERAGES = {"current": _current, "ema": _ema, "gm": _geometric_mean}


def geometric_mean(w: Tensor) -> Tensor:
    """GM over dim 0 as exp(mean(log)): no overflow of the product; a zero entry gives 0."""
    return torch.exp(torch.log(w).mean(0))


def am_minus_gm(w: Tensor) -> Tensor:
    return w.mean(0) - geometric_mean(w)


def filtration_threshold(window: Tensor) -> Tensor:
    """M·V(Ω^{1/2}) for a full window Ω (M, C): V is the variance of all M·C entries of Ω^{1/2}
    (one number per layer, as in the authors' code), the population variance (with it, eq. 18 is
    the sharp AM-GM bound of Aldaz 2012 that the paper cites, for C = 1). docs/unified-norm.md
    explains why not a per-channel variance: that reading filters ~99% of stationary steps."""
    return window.shape[0] * window.clamp_min(0).sqrt().var(unbiased=False)


register_method(Method("bn", centered=True, forward="current", grad_window=False, grad_momentum=None,
                       outlier_filtration=False, reference="BN: eq. 10-12"))
register_method(Method("mabn", centered=False, forward="ema", grad_window=True, grad_momentum=None,
                       outlier_filtration=False, reference="MABN: eq. 13-14"))
register_method(Method("pn", centered=False, forward="ema", grad_window=False, grad_momentum="eta",
                       outlier_filtration=False, reference="PN* (PowerNorm without layer scale): §2.2.2, "
                                                           "EMAS in both directions"))
register_method(Method("un", centered=False, forward="gm", grad_window=True, grad_momentum="alpha",
                       outlier_filtration=True, reference="UN: Algorithm 2, eq. 16-19"))


# ---- the module -------------------------------------------------------------------------------------

def _width(normalized_shape) -> int:
    if isinstance(normalized_shape, numbers.Integral):
        return int(normalized_shape)
    shape = tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"offline norms normalize over the last dimension only; got normalized_shape={shape}")
    return int(shape[0])


class OfflineNorm(nn.Module):
    """Drop-in for nn.LayerNorm on (B, N, C) or (N, C) inputs whose statistics are fixed at inference.

    Args (names as in paper 004):
        normalized_shape: C (or (C,)).
        method: a key of `METHODS`: "un" (default), "bn", "mabn", "pn".
        eps: ε.
        alpha: α, momentum of the inference statistics (eq. 12) and of ψ in UN (eq. 17). 0.9 (§4.1).
        eta: η, momentum of EMAS (MABN, PN*). 0.9.
        M: forward window (geometric mean, eq. 16, and outlier filtration, eq. 18-19). 4 (Table 6).
        M_grad: backward window (arithmetic mean of g, eq. 17; MABN's SMAS). Defaults to M.
        warmup: steps that use the current batch's statistics and exact gradient. 4000 (§4.1).
        outlier_filtration: eq. 19 (default: the method's; needs a geometric-mean window, M > 1).
        elementwise_affine, bias: learnable γ (ones) and β (zeros), as in nn.LayerNorm.

    forward(x, padding_mask=None): padding_mask (shape x.shape[:-1], True = padded token) excludes
    tokens from every statistic; `padding(model, mask)` sets it for norms called by library code.
    """

    # options a saved report may record for this module (normfold.report checks them: name -> type)
    REPORT_OPTIONS = {"method": str, "alpha": float, "eta": float, "M": int, "M_grad": typing.Optional[int],
                      "warmup": int, "outlier_filtration": typing.Optional[bool]}

    def __init__(self, normalized_shape, method: str = "un", eps: float = 1e-5, *, alpha: float = 0.9,
                 eta: float = 0.9, M: int = 4, M_grad: int | None = None, warmup: int = 4000,
                 outlier_filtration: bool | None = None, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"unknown offline norm method {method!r}; known: {', '.join(METHODS)}")
        cfg = METHODS[method]
        self.method = method
        self.num_features = C = _width(normalized_shape)
        self.normalized_shape = (C,)
        self.eps, self.alpha, self.eta, self.warmup = float(eps), float(alpha), float(eta), int(warmup)
        # A method without a window keeps window size 1 (its buffers then hold just the current value).
        self.M = int(M) if cfg.forward == "gm" else 1
        self.M_grad = (int(M if M_grad is None else M_grad)) if cfg.grad_window else 1
        self.outlier_filtration = cfg.outlier_filtration if outlier_filtration is None else bool(outlier_filtration)
        if self.M < 1 or self.M_grad < 1:
            raise ValueError(f"window sizes must be >= 1 (got M={self.M}, M_grad={self.M_grad})")
        if self.outlier_filtration and (cfg.forward != "gm" or self.M < 2):
            raise ValueError("outlier filtration (eq. 19) compares a window of M > 1 recorded statistics; "
                             f"method {method!r} with M={self.M} has none: use M > 1 with method 'un', "
                             "or outlier_filtration=False")
        if not (0.0 <= self.alpha < 1.0 and 0.0 <= self.eta < 1.0):
            raise ValueError(f"momenta must lie in [0, 1): alpha={alpha}, eta={eta}")
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(C, **factory)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(C, **factory)) if elementwise_affine and bias else None
        # Inference statistics (eq. 12), initialised like BatchNorm's.
        self.register_buffer("running_var", torch.ones(C, **factory))
        if cfg.centered:
            self.register_buffer("running_mean", torch.zeros(C, **factory))
        if cfg.forward == "gm":
            self.register_buffer("var_window", torch.ones(self.M, C, **factory))  # recorded σ² (Ω)
        if cfg.forward == "ema":
            self.register_buffer("ema_var", torch.ones(C, **factory))  # EMAS state of σ²
        if cfg.grad_window:
            self.register_buffer("grad_window", torch.zeros(self.M_grad, C, **factory))  # recorded g
        if cfg.grad_momentum is not None:
            self.register_buffer("psi", torch.zeros(C, **factory))  # ψ_{t-1}
        self.register_buffer("step", torch.zeros((), dtype=torch.long))  # training forwards t
        self.register_buffer("grad_step", torch.zeros((), dtype=torch.long))  # backward passes
        self.register_buffer("skipped", torch.zeros((), dtype=torch.long))  # steps filtered by eq. 19
        self._padding_mask: Tensor | None = None

    @property
    def config(self) -> Method:
        return METHODS[self.method]

    def options(self) -> dict:
        """Constructor keyword arguments that rebuild this module's configuration (saved in reports)."""
        return {"method": self.method, "alpha": self.alpha, "eta": self.eta, "M": self.M, "M_grad": self.M_grad,
                "warmup": self.warmup, "outlier_filtration": self.outlier_filtration}

    def extra_repr(self) -> str:
        return (f"{self.num_features}, method={self.method}, eps={self.eps}, alpha={self.alpha}, M={self.M}, "
                f"M_grad={self.M_grad}, warmup={self.warmup}, outlier_filtration={self.outlier_filtration}")

    @classmethod
    def from_layernorm(cls, ln: nn.Module, keep_weight: bool = True, keep_bias: bool = True, **options):
        """An offline norm with `ln`'s width, eps, γ and β (for fine-tuning a LayerNorm model)."""
        eps = getattr(ln, "eps", getattr(ln, "variance_epsilon", 1e-5))
        shape = getattr(ln, "normalized_shape", None) or (ln.weight.shape[-1],)
        w, b = getattr(ln, "weight", None), getattr(ln, "bias", None)
        ref = w if w is not None else next(iter(ln.parameters()), None)
        factory = {"device": ref.device, "dtype": ref.dtype} if ref is not None else {}
        # β is kept trainable even where the LayerNorm's is zero: UN's fine-tuning may need it.
        out = cls(shape, eps=eps, elementwise_affine=keep_weight or keep_bias, bias=keep_bias, **options, **factory)
        with torch.no_grad():
            if out.weight is not None:
                out.weight.copy_(w if (keep_weight and w is not None) else torch.ones_like(out.weight))
            if out.bias is not None and b is not None:
                out.bias.copy_(b)
        return out

    # ---- state management ----

    def reset_steps(self) -> None:
        """Restart the step counters (warm-up and windows refill) keeping the running statistics,
        e.g. before fine-tuning a trained model on a new task."""
        self.step.zero_()
        self.grad_step.zero_()

    def reset_statistics(self) -> None:
        """Back to the freshly constructed state (statistics, windows, counters)."""
        for name, buf in self.named_buffers(recurse=False):
            if name in ("running_var", "var_window", "ema_var"):
                buf.fill_(1.0)
            else:
                buf.zero_()

    def inference_affine(self) -> tuple[Tensor, Tensor]:
        """(scale, shift) in float64 with y = x·scale + shift in eval mode (Algorithm 1, lines 1-2)."""
        mean = self.running_mean if self.config.centered else None
        return offline_affine(self.weight, self.bias, mean, self.running_var, self.eps)

    # ---- forward ----

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        if x.shape[-1] != self.num_features:
            raise ValueError(f"expected last dimension {self.num_features}, got input of shape {tuple(x.shape)}")
        if not self.training:
            # Eval: fixed statistics (eq. 1); folding this into a neighbour is `fuse_offline_norms`.
            var = self.running_var.to(x.dtype)
            y = x - self.running_mean.to(x.dtype) if self.config.centered else x
            y = y * torch.rsqrt(var + self.eps)
            if self.weight is not None:
                y = y * self.weight
            return y + self.bias if self.bias is not None else y
        mask = self._padding_mask if padding_mask is None else padding_mask
        valid = None
        if mask is not None:
            if tuple(mask.shape) != tuple(x.shape[:-1]):
                raise ValueError(f"padding_mask has shape {tuple(mask.shape)}; expected {tuple(x.shape[:-1])} "
                                 "(the input's shape without the channel dimension, True = padded)")
            valid = ~mask.reshape(-1).to(device=x.device, dtype=torch.bool)
        return _OfflineNormFunction.apply(x, self.weight, self.bias, self, valid)

    # The two halves of a training step; `_OfflineNormFunction` calls them. Statistics are computed
    # in float32 at least (float64 for float64 inputs).

    @torch.no_grad()
    def _training_statistics(self, x2: Tensor, valid: Tensor | None):
        """Forward half of a training step: returns (μ̂ or None, sqrt(σ̂² + ε), whether ψ = g exactly,
        whether eq. 19 filtered this step) and updates every forward buffer."""
        rows = x2 if valid is None else x2[valid]
        if rows.shape[0] == 0:
            raise ValueError("every token of the batch is padding: an offline norm needs at least one token")
        cfg = self.config
        mu_t = rows.mean(0) if cfg.centered else None
        var_t = (rows - mu_t).square().mean(0) if cfg.centered else rows.square().mean(0)
        self.step += 1
        t = int(self.step)
        warm = t <= self.warmup
        skip = False
        if cfg.forward == "gm":
            slot = (t - 1) % self.M
            if self.outlier_filtration and not warm and t - 1 >= self.M:
                skip = self._is_outlier(var_t, slot)
            # Eq. 19: a filtered step records the running σ² in its place, keeping the outlier out of Ω.
            self.var_window[slot] = self.running_var if skip else var_t
        if cfg.forward == "ema":
            self.ema_var.mul_(self.eta).add_((1 - self.eta) * var_t)
        var_hat = var_t if (warm or skip) else FORWARD_AVERAGES[cfg.forward](self, var_t, t)
        # Eq. 12 / Algorithm 2 line 5 with the statistic used this step (σ_t² on a filtered step: the
        # running σ² must follow a lasting change of scale, or the filter would fire forever).
        self.running_var.mul_(self.alpha).add_((1 - self.alpha) * var_hat)
        if cfg.centered:
            self.running_mean.mul_(self.alpha).add_((1 - self.alpha) * mu_t)
        if skip:
            self.skipped += 1
        return mu_t, torch.sqrt(var_hat + self.eps), warm or skip, skip

    def _is_outlier(self, var_t: Tensor, slot: int) -> bool:
        """Eq. 19: E(Ω_t) − Π(Ω_t) > M·V(Ω_{t−1}^{1/2}) in any channel, V over the whole window (the
        layer drops its moving averages as a whole: "in a specific normalization layer")."""
        prev = self.var_window.to(var_t.dtype)
        cur = prev.clone()
        cur[slot] = var_t  # Ω_t: the oldest entry σ_{t−M}² replaced by σ_t²
        return bool((am_minus_gm(cur) > filtration_threshold(prev)).any())

    @torch.no_grad()
    def _gradient_statistics(self, dz: Tensor, z: Tensor, valid: Tensor | None, exact: bool, skip: bool):
        """Backward half: returns (ψ_μ or None, ψ_σ²) and updates the backward buffers (eq. 17, 19)."""
        cfg = self.config
        # g_σ̂² (Algorithm 2, backward line 2) is the chain rule's ∂L/∂σ̂² up to a factor: every token
        # normalized by σ̂ contributes, padded ones too (zero when the loss ignores them), divided by
        # the number of real tokens that σ_t² averaged over. So window 1, α = 0 is the exact gradient.
        n = z.shape[0] if valid is None else int(valid.sum())
        g = (dz * z).sum(0) / n
        g_mu = dz.sum(0) / n if cfg.centered else None
        self.grad_step += 1
        gs = int(self.grad_step)
        rho = {None: 0.0, "alpha": self.alpha, "eta": self.eta}[cfg.grad_momentum]
        psi_prev = self.psi.to(g.dtype) if cfg.grad_momentum is not None else None
        average = g
        if cfg.grad_window:
            # Eq. 19: a filtered step records ψ_{t−1} instead of its own (outlier) g.
            self.grad_window[(gs - 1) % self.M_grad] = psi_prev if (skip and psi_prev is not None) else g
            if not exact:
                average = self.grad_window[:min(gs, self.M_grad)].to(g.dtype).mean(0)
        if cfg.grad_momentum is not None:
            # The momentum state follows the value used this step (g_t on warm-up / filtered steps).
            state = rho * psi_prev + (1 - rho) * average
            self.psi.copy_(state)
            average = state
        psi = g if exact else average
        return g_mu, psi


class _OfflineNormFunction(torch.autograd.Function):
    """Training step of an offline norm: statistics from `OfflineNorm._training_statistics`,
    dx = (∂L/∂z − ψ_μ − z·ψ_σ²)/sqrt(σ̂² + ε) (eq. 7) with ψ from `_gradient_statistics`.
    Padded tokens are in no statistic, so their dx is ∂L/∂z / sqrt(σ̂² + ε)."""

    @staticmethod
    def forward(ctx, x, weight, bias, norm: OfflineNorm, valid):
        C = x.shape[-1]
        compute = torch.promote_types(x.dtype, torch.float32)
        x2 = x.reshape(-1, C).to(compute)
        mu, s, exact, skip = norm._training_statistics(x2, valid)
        z = (x2 - mu if mu is not None else x2) / s
        y = z
        if weight is not None:
            y = y * weight.to(compute)
        if bias is not None:
            y = y + bias.to(compute)
        ctx.norm, ctx.exact, ctx.skip, ctx.shape = norm, exact, skip, x.shape
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(z, s, valid, weight)
        return y.to(x.dtype).reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        z, s, valid, weight = ctx.saved_tensors
        C = z.shape[-1]
        dy2 = dy.reshape(-1, C).to(z.dtype)
        dz = dy2 * weight.to(z.dtype) if weight is not None else dy2
        g_mu, psi = ctx.norm._gradient_statistics(dz, z, valid, ctx.exact, ctx.skip)
        corr = z * psi
        if g_mu is not None:
            corr = corr + g_mu
        if valid is not None:
            corr = corr * valid.unsqueeze(-1).to(corr.dtype)
        dx = ((dz - corr) / s).to(dy.dtype).reshape(ctx.shape)
        dw = (dy2 * z).sum(0).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        db = dy2.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None


class UnifiedNorm(OfflineNorm):
    """Unified Normalization (paper 004): OfflineNorm with method="un" (see `OfflineNorm`)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, **options) -> None:
        options.setdefault("method", "un")
        super().__init__(normalized_shape, eps=eps, **options)


class FixedAffine(nn.Module):
    """y = x·weight + bias per channel: an offline norm frozen at inference that had no adjacent linear
    to fold into (`fuse_offline_norms` says why). Parameter names match a LayerNorm's."""

    def __init__(self, normalized_shape, device=None, dtype=None) -> None:
        super().__init__()
        C = _width(normalized_shape)
        self.normalized_shape = (C,)
        self.weight = nn.Parameter(torch.ones(C, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(C, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return torch.addcmul(self.bias, x, self.weight)

    @classmethod
    def from_layernorm(cls, ln: nn.Module, keep_weight: bool = True, keep_bias: bool = True, **_):
        ref = next(iter(ln.parameters()), None)
        factory = {"device": ref.device, "dtype": ref.dtype} if ref is not None else {}
        return cls(getattr(ln, "normalized_shape", None) or ln.weight.shape[-1:], **factory)


class FoldedNorm(nn.Identity):
    """Where an offline norm was folded into its neighbours (it computes nothing any more)."""

    @classmethod
    def from_layernorm(cls, ln: nn.Module, keep_weight: bool = False, keep_bias: bool = False, **_):
        return cls()


def offline_norms(model: nn.Module) -> list[tuple[str, OfflineNorm]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, OfflineNorm)]


@contextlib.contextmanager
def padding(model: nn.Module, padding_mask: Tensor | None):
    """Exclude padded tokens (True in `padding_mask`, shape (B, N)) from the statistics of every
    offline norm in `model` during the block, for models whose code calls norm(x) without a mask:

        with normfold.nn.padding(model, attention_mask == 0):
            loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
    """
    norms = [m for _, m in offline_norms(model)]
    old = [m._padding_mask for m in norms]
    for m in norms:
        m._padding_mask = padding_mask
    try:
        yield
    finally:
        for m, o in zip(norms, old):
            m._padding_mask = o


def reset_steps(model: nn.Module) -> int:
    """`OfflineNorm.reset_steps` on every offline norm of `model`; returns how many."""
    norms = offline_norms(model)
    for _, m in norms:
        m.reset_steps()
    return len(norms)
