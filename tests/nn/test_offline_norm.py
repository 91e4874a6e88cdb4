"""OfflineNorm / UnifiedNorm against two independent references.

(a) `LoopNorm`: a deliberately plain re-implementation of paper 004's formulas (python loops over
    tokens and channels, lists, math.prod for the geometric mean), with the readings documented in
    docs/unified-norm.md. The module must match it on outputs, input gradients, γ/β gradients and
    every buffer over 60 random steps with padding and injected outliers.
(b) autograd through x / sqrt(σ_t² + ε) where the paper's estimator is the exact gradient
    (window 1, α = 0, no filtration), and during warm-up.
"""

import math

import pytest
import torch

from normfold.nn import OfflineNorm, UnifiedNorm, padding

EPS = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors run fastest on one thread (and far faster on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class LoopNorm:
    """Paper 004 §3.1-3.3 for one norm, one token at a time. Lists of floats, no tensors."""

    def __init__(self, C, method, M, M_grad, alpha, eta, warmup, filtration, gamma, beta, eps=EPS):
        self.C, self.method, self.eps = C, method, eps
        self.M = M if method == "un" else 1
        self.M_grad = M_grad if method in ("un", "mabn") else 1
        self.alpha, self.eta, self.warmup, self.filtration = alpha, eta, warmup, filtration
        self.gamma, self.beta = list(gamma), list(beta)
        self.running_var, self.running_mean = [1.0] * C, [0.0] * C
        self.ema_var, self.psi = [1.0] * C, [0.0] * C
        self.var_ring = [[1.0] * C for _ in range(self.M)]  # slot (t-1) % M holds step t's record
        self.grad_ring = [[0.0] * C for _ in range(self.M_grad)]
        self.history, self.grad_history = [], []  # chronological records
        self.t = self.gt = self.skipped = 0

    def forward(self, X, pad):
        C, M = self.C, self.M
        valid = [row for row, p in zip(X, pad) if not p]
        n = len(valid)
        self.t += 1
        t = self.t
        if self.method == "bn":
            mu = [sum(r[c] for r in valid) / n for c in range(C)]
            var_t = [sum((r[c] - mu[c]) ** 2 for r in valid) / n for c in range(C)]
        else:
            mu = [0.0] * C
            var_t = [sum(r[c] ** 2 for r in valid) / n for c in range(C)]
        warm = t <= self.warmup
        skip = False
        if self.filtration and not warm and t - 1 >= M:
            prev = self.history[-M:]  # Ω_{t-1}
            cur = prev[1:] + [var_t]  # Ω_t
            roots = [math.sqrt(v[c]) for v in prev for c in range(C)]  # V over the whole window
            mean_root = sum(roots) / len(roots)
            threshold = M * sum((r - mean_root) ** 2 for r in roots) / len(roots)
            for c in range(C):
                am = sum(v[c] for v in cur) / M
                gm = math.prod(v[c] for v in cur) ** (1.0 / M)
                if am - gm > threshold:
                    skip = True
        if self.method == "un":
            record = list(self.running_var) if skip else list(var_t)
            self.history.append(record)
            self.var_ring[(t - 1) % M] = record
        if self.method in ("mabn", "pn"):
            self.ema_var = [self.eta * e + (1 - self.eta) * v for e, v in zip(self.ema_var, var_t)]
        if warm or skip or self.method == "bn":
            var_hat = list(var_t)
        elif self.method == "un":
            window = self.history[-min(t, M):]
            var_hat = [math.prod(v[c] for v in window) ** (1.0 / len(window)) for c in range(C)]
        else:
            var_hat = list(self.ema_var)
        self.running_var = [self.alpha * r + (1 - self.alpha) * v for r, v in zip(self.running_var, var_hat)]
        if self.method == "bn":
            self.running_mean = [self.alpha * r + (1 - self.alpha) * m for r, m in zip(self.running_mean, mu)]
        self.skipped += skip
        s = [math.sqrt(v + self.eps) for v in var_hat]
        Z = [[(row[c] - mu[c]) / s[c] for c in range(C)] for row in X]
        Y = [[self.gamma[c] * z[c] + self.beta[c] for c in range(C)] for z in Z]
        self._saved = (Z, s, pad, warm or skip, skip)
        return Y

    def backward(self, dY):
        Z, s, pad, exact, skip = self._saved
        C = self.C
        dZ = [[dy[c] * self.gamma[c] for c in range(C)] for dy in dY]
        n = sum(1 for p in pad if not p)  # real tokens; every normalized token enters the sums
        g = [sum(dZ[i][c] * Z[i][c] for i in range(len(dZ))) / n for c in range(C)]
        g_mu = [sum(dZ[i][c] for i in range(len(dZ))) / n for c in range(C)]
        self.gt += 1
        psi_prev = list(self.psi)
        if self.method in ("un", "mabn"):
            record = psi_prev if skip else list(g)
            self.grad_history.append(record)
            self.grad_ring[(self.gt - 1) % self.M_grad] = record
        if exact or self.method in ("bn", "pn"):
            average = list(g)
        else:
            window = self.grad_history[-min(self.gt, self.M_grad):]
            average = [sum(w[c] for w in window) / len(window) for c in range(C)]
        rho = {"un": self.alpha, "pn": self.eta}.get(self.method)
        if rho is not None:
            self.psi = [rho * p + (1 - rho) * a for p, a in zip(psi_prev, average)]
            average = list(self.psi)
        used = g if exact else average
        dX = []
        for i, dz in enumerate(dZ):
            if pad[i]:
                dX.append([dz[c] / s[c] for c in range(C)])
            elif self.method == "bn":
                dX.append([(dz[c] - g_mu[c] - Z[i][c] * used[c]) / s[c] for c in range(C)])
            else:
                dX.append([(dz[c] - Z[i][c] * used[c]) / s[c] for c in range(C)])
        dgamma = [sum(dY[i][c] * Z[i][c] for i in range(len(dY))) for c in range(C)]
        dbeta = [sum(dY[i][c] for i in range(len(dY))) for c in range(C)]
        return dX, dgamma, dbeta


def _rows(t):
    return t.reshape(-1, t.shape[-1]).tolist()


def _close(a, b, what, tol=1e-10):
    a = torch.as_tensor(a.detach() if isinstance(a, torch.Tensor) else a, dtype=torch.float64)
    b = torch.as_tensor(b.detach() if isinstance(b, torch.Tensor) else b, dtype=torch.float64).reshape(a.shape)
    scale = max(1.0, float(b.abs().max()))
    assert float((a - b).abs().max()) <= tol * scale, f"{what}: {a} vs {b}"


def _buffers(mod, ref):
    _close(mod.running_var, ref.running_var, "running_var")
    if mod.method == "bn":
        _close(mod.running_mean, ref.running_mean, "running_mean")
    if mod.method == "un":
        _close(mod.var_window, ref.var_ring, "var_window")
    if mod.method in ("mabn", "pn"):
        _close(mod.ema_var, ref.ema_var, "ema_var")
    if mod.method in ("un", "mabn"):
        _close(mod.grad_window, ref.grad_ring, "grad_window")
    if mod.method in ("un", "pn"):
        _close(mod.psi, ref.psi, "psi")
    assert (int(mod.step), int(mod.grad_step), int(mod.skipped)) == (ref.t, ref.gt, ref.skipped)


SETTINGS = {
    "un": dict(M=3, M_grad=4, warmup=6, outlier_filtration=True),
    "un-no-filtration": dict(M=4, M_grad=2, warmup=3, outlier_filtration=False),
    "mabn": dict(M_grad=3, warmup=4),
    "pn": dict(warmup=4, eta=0.8),
    "bn": dict(warmup=0),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_matches_plain_loop_reference_over_60_steps(setting):
    method = setting.split("-")[0]
    opts = dict(alpha=0.9, eta=0.9, M=1, M_grad=1, warmup=0, outlier_filtration=False)
    opts.update(SETTINGS[setting])
    C = 5
    g = torch.Generator().manual_seed(hash(setting) % 1000)
    mod = OfflineNorm(C, method=method, eps=EPS, **opts).double().train()
    with torch.no_grad():
        mod.weight.copy_(1 + 0.3 * torch.randn(C, generator=g, dtype=torch.float64))
        mod.bias.copy_(0.2 * torch.randn(C, generator=g, dtype=torch.float64))
    ref = LoopNorm(C, method, opts["M"], opts["M_grad"], opts["alpha"], opts["eta"], opts["warmup"],
                   mod.outlier_filtration, mod.weight.tolist(), mod.bias.tolist())
    # Channel scales drift slowly (as activations do in training); some steps carry outliers.
    outliers = {14: 40.0, 23: 0.02, 31: 25.0, 32: 25.0, 44: 60.0, 52: 1e-3}
    for step in range(1, 61):
        B, N = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(2, 6, (1,), generator=g))
        scale = torch.linspace(0.5, 2.0, C, dtype=torch.float64) * (1 + 0.01 * step)
        x = torch.randn(B, N, C, generator=g, dtype=torch.float64) * scale + 0.3
        if step in outliers:
            x[..., :2] *= outliers[step]
        pad = torch.rand(B, N, generator=g) < 0.3
        pad[0, 0] = False  # at least one real token
        if step % 5 == 0:
            pad = None  # also steps without a mask
        x.requires_grad_(True)
        mod.zero_grad()
        y = mod(x, padding_mask=pad)
        dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
        y.backward(dy)
        pad_list = [False] * (B * N) if pad is None else pad.reshape(-1).tolist()
        y_ref = ref.forward(_rows(x.detach()), pad_list)
        dx_ref, dgamma_ref, dbeta_ref = ref.backward(_rows(dy))
        _close(y.detach(), y_ref, f"step {step} output")
        _close(x.grad, dx_ref, f"step {step} dx")
        _close(mod.weight.grad, dgamma_ref, f"step {step} dgamma")
        _close(mod.bias.grad, dbeta_ref, f"step {step} dbeta")
        _buffers(mod, ref)
    if setting == "un":
        # both branches of eq. 19 were exercised after warm-up
        assert 0 < ref.skipped < 60 - opts["warmup"] - opts["M"]
    # eval mode: the running statistics (eq. 1)
    mod.eval()
    x = torch.randn(2, 3, C, generator=g, dtype=torch.float64)
    mean = torch.tensor(ref.running_mean, dtype=torch.float64)
    expect = (x - mean) / torch.sqrt(torch.tensor(ref.running_var, dtype=torch.float64) + EPS) * mod.weight + mod.bias
    _close(mod(x).detach(), expect, "eval output")


# ---- (b) the estimator where it is the exact gradient ----------------------------------------------

def _exact(x, gamma, beta, pad, centered=False):
    """Autograd through y = γ·(x − μ_t)/sqrt(σ_t² + ε) + β with statistics over the real tokens."""
    rows = x.reshape(-1, x.shape[-1])
    keep = rows if pad is None else rows[~pad.reshape(-1)]
    mu = keep.mean(0) if centered else torch.zeros_like(keep[0])
    var = (keep - mu).square().mean(0)
    return (x - mu) / torch.sqrt(var + EPS) * gamma + beta


@pytest.mark.parametrize("method", ["un", "mabn", "pn", "bn"])
def test_window_one_and_zero_momentum_give_the_exact_gradient(method):
    C = 6
    mod = OfflineNorm(C, method=method, M=1, M_grad=1, alpha=0.0, eta=0.0, warmup=0,
                      outlier_filtration=False).double()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(C, generator=g, dtype=torch.float64))
        mod.bias.copy_(torch.randn(C, generator=g, dtype=torch.float64))
    for step in range(6):
        x = (torch.randn(3, 4, C, generator=g, dtype=torch.float64) * (1 + step)).requires_grad_(True)
        pad = torch.rand(3, 4, generator=g) < 0.4
        pad[0, 0] = False
        dy = torch.randn(3, 4, C, generator=g, dtype=torch.float64)
        mod.zero_grad()
        mod(x, padding_mask=pad).backward(dy)
        x2 = x.detach().clone().requires_grad_(True)
        w2 = mod.weight.detach().clone().requires_grad_(True)
        b2 = mod.bias.detach().clone().requires_grad_(True)
        _exact(x2, w2, b2, pad, centered=method == "bn").backward(dy)
        _close(x.grad, x2.grad, f"{method} dx", tol=1e-12)
        _close(mod.weight.grad, w2.grad, f"{method} dgamma", tol=1e-12)
        _close(mod.bias.grad, b2.grad, f"{method} dbeta", tol=1e-12)
    assert int(mod.step) == 6 and int(mod.grad_step) == 6


def test_gradcheck_at_window_one():
    mod = UnifiedNorm(4, M=1, alpha=0.0, warmup=0, outlier_filtration=False).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    from normfold.nn.offline import _OfflineNormFunction

    assert torch.autograd.gradcheck(lambda x, w, b: _OfflineNormFunction.apply(x, w, b, mod, None), (x, w, b))


def test_warmup_uses_current_statistics_and_exact_gradient():
    mod = UnifiedNorm(5, M=4, warmup=3).double()  # default α = 0.9: only warm-up makes it exact
    g = torch.Generator().manual_seed(3)
    for step in range(1, 6):
        x = (torch.randn(4, 5, generator=g, dtype=torch.float64) * step).requires_grad_(True)
        dy = torch.randn(4, 5, generator=g, dtype=torch.float64)
        mod(x).backward(dy)
        x2 = x.detach().clone().requires_grad_(True)
        _exact(x2, mod.weight.detach(), mod.bias.detach(), None).backward(dy)
        err = float((x.grad - x2.grad).abs().max())
        if step <= 3:
            assert err < 1e-12
        else:
            assert err > 1e-6  # past warm-up the estimator (GM window, ψ momentum) takes over


# ---- outlier filtration: skipped exactly when eq. 19 says so ------------------------------------------

def _constant_stat(values, n=3):
    """An input whose per-channel quadratic mean is exactly `values` (every token the same)."""
    v = torch.tensor(values, dtype=torch.float64)
    return v.sqrt().expand(n, len(values)).clone()


def _eq19(prev, new):
    """Independent evaluation of eq. 19 for one channel from python floats."""
    M = len(prev)
    cur = prev[1:] + [new]
    am = sum(cur) / M
    gm = math.prod(cur) ** (1 / M)
    roots = [math.sqrt(p) for p in prev]
    m = sum(roots) / M
    return am - gm > M * sum((r - m) ** 2 for r in roots) / M


def test_a_step_is_skipped_exactly_when_eq19_says_so():
    M = 4
    history = [1.0, 1.3, 0.8, 1.1]
    prev = history[-M:]
    # The boundary value of the new statistic above which eq. 19 fires, found by bisection on the
    # independent python evaluation; candidates just below / above it and far from it.
    lo, hi = prev[-1], 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _eq19(prev, mid) else (mid, hi)
    candidates = [1.05, hi * (1 - 1e-6), hi * (1 + 1e-6), 50.0, 0.9, 1e-4]
    for new in candidates:
        mod = UnifiedNorm(1, M=M, warmup=0, alpha=0.9).double()
        for v in history:
            mod(_constant_stat([v]))
        running = mod.running_var.clone()
        x = _constant_stat([new])
        y = mod(x)
        fired = bool(mod.skipped)
        assert fired == _eq19(prev, new), new
        slot = (mod.step - 1) % M
        if fired:  # current statistic used; the outlier is kept out of the window
            _close(y, x / math.sqrt(new + EPS), "skipped output")
            _close(mod.var_window[slot], running, "recorded statistic")
        else:
            gm = math.prod(prev[1:] + [new]) ** (1 / M)
            _close(y, x / math.sqrt(gm + EPS), "smoothed output")
            _close(mod.var_window[slot], [new], "recorded statistic")


def test_filtration_threshold_is_per_layer_and_waits_for_a_full_window():
    """V(Ω_{t−1}^{1/2}) is one number per layer (the spread of σ over the window's steps and channels);
    E − Π is per channel, and one channel over the threshold filters the whole layer."""
    base = [1.0, 4.0, 9.0]  # σ = 1, 2, 3: M·V = 3 · var{1, 2, 3} = 2

    def run(*steps):
        mod = UnifiedNorm(3, M=3, warmup=0).double()
        for values in steps:
            mod(_constant_stat(values))
        return int(mod.skipped)

    assert run(base, base, [100.0, 4.0, 9.0]) == 0  # Ω_{t−1} is not full yet: never filtered
    assert run(base, base, base, base) == 0
    assert run(base, base, base, [16.0, 4.0, 9.0]) == 1  # channel 0: E − Π = 6 − 16^(1/3) = 3.5 > 2
    assert run(base, base, base, [1.0, 4.0, 16.0]) == 0  # channel 2: 11.33 − 1296^(1/3) = 0.43 < 2


def test_a_lasting_change_of_scale_stops_being_filtered():
    """Why a filtered step still updates the running σ²: otherwise a real change of scale would be
    filtered forever (the window would only ever record the stale running statistic)."""
    g = torch.Generator().manual_seed(0)
    scales = torch.exp(torch.randn(8, generator=g, dtype=torch.float64))  # channels differ in scale
    mod = UnifiedNorm(8, M=4, warmup=0).double()
    for _ in range(20):
        mod(torch.randn(16, 8, generator=g, dtype=torch.float64) * scales)
    before = int(mod.skipped)
    fired = []
    for _ in range(100):
        mod(10 * torch.randn(16, 8, generator=g, dtype=torch.float64) * scales)
        fired.append(int(mod.skipped) - before)
    assert fired[0] == 1  # the jump is filtered at first ...
    assert fired[-1] == fired[-50] < 20  # ... but not for ever
    ratio = mod.running_var / scales.square()
    assert bool(((ratio > 50) & (ratio < 200)).all())  # the running σ² followed the new scale (×100)


def test_eq18_holds_with_the_population_variance():
    """Eq. 18 (Aldaz's AM-GM bound) for one channel, V the population variance; tight at (1, 1, 1, 0)."""
    from normfold.nn.offline import am_minus_gm, filtration_threshold

    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        w = torch.rand(4, 1, generator=g, dtype=torch.float64) ** 6 * 100
        assert float(am_minus_gm(w)) <= float(filtration_threshold(w)) + 1e-12
    tight = torch.tensor([[1.0], [1.0], [1.0], [0.0]], dtype=torch.float64)
    assert float(am_minus_gm(tight)) == pytest.approx(float(filtration_threshold(tight)))


def test_downward_outliers_are_filtered_too():
    """Lemma 3.1 / Corollary 3.2 assume the filtered statistic is the window's largest; eq. 19 also
    fires on an abnormally small one, where GM/σ_t² > 1 and the corollary's bound does not apply."""
    mod = UnifiedNorm(1, M=4, warmup=0).double()
    for v in [1.0, 1.2, 0.9, 1.1]:
        mod(_constant_stat([v]))
    mod(_constant_stat([1e-4]))
    assert int(mod.skipped) == 1
    gm = math.prod([1.2, 0.9, 1.1, 1e-4]) ** 0.25
    assert gm / 1e-4 > 1


# ---- state, padding, API ------------------------------------------------------------------------------

def _train(mod, steps, seed):
    g = torch.Generator().manual_seed(seed)
    outs = []
    for i in range(steps):
        x = torch.randn(2, 4, mod.num_features, generator=g, dtype=torch.float64) * (1 + (i == 7) * 20)
        x.requires_grad_(True)
        y = mod(x)
        y.backward(torch.randn(y.shape, generator=g, dtype=torch.float64))
        outs.append((y.detach(), x.grad))
    return outs


def test_state_dict_round_trip_continues_identically():
    a = UnifiedNorm(4, M=3, M_grad=2, warmup=2).double()
    _train(a, 10, 0)
    b = UnifiedNorm(4, M=3, M_grad=2, warmup=2).double()
    b.load_state_dict(a.state_dict())
    assert set(a.state_dict()) == {"weight", "bias", "running_var", "var_window", "grad_window", "psi", "step",
                                   "grad_step", "skipped"}
    for (ya, ga), (yb, gb) in zip(_train(a, 8, 1), _train(b, 8, 1)):
        assert torch.equal(ya, yb) and torch.equal(ga, gb)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    with pytest.raises(RuntimeError):
        UnifiedNorm(4, M=5).double().load_state_dict(a.state_dict())


def test_reset_steps_restarts_warmup_and_keeps_running_statistics():
    mod = UnifiedNorm(3, M=2, warmup=2).double()
    _train(mod, 6, 0)
    running = mod.running_var.clone()
    mod.reset_steps()
    assert int(mod.step) == 0 and int(mod.grad_step) == 0 and torch.equal(mod.running_var, running)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(5, 3, dtype=torch.float64)
    mod(x).backward(dy)
    x2 = x.detach().clone().requires_grad_(True)
    _exact(x2, mod.weight.detach(), mod.bias.detach(), None).backward(dy)
    _close(x.grad, x2.grad, "first step after reset is warm-up", tol=1e-12)
    mod.reset_statistics()
    assert torch.equal(mod.running_var, torch.ones(3, dtype=torch.float64)) and int(mod.skipped) == 0


def test_padding_context_and_padded_tokens_are_in_no_statistic():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), UnifiedNorm(3, warmup=10)).double()
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    pad = torch.tensor([[False, False, True, True], [False, False, False, True]])
    junk = x.clone()
    junk[pad] = 1e6  # padded tokens' values must not matter for the real ones
    with padding(model, pad):
        a, b = model(x), model(junk)
    assert torch.allclose(a[~pad], b[~pad], rtol=1e-12, atol=1e-12)
    assert model[1]._padding_mask is None
    with pytest.raises(ValueError, match="padding_mask has shape"):
        model[1](x, padding_mask=pad[:, :2])
    with pytest.raises(ValueError, match="every token"):
        model[1](x, padding_mask=torch.ones(2, 4, dtype=torch.bool))


def test_bn_method_is_torch_batch_norm_in_training():
    mod = OfflineNorm(4, method="bn").double()
    x = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 5, 4, dtype=torch.float64)
    mod(x).backward(dy)
    x2 = x.detach().clone().requires_grad_(True)
    torch.nn.functional.batch_norm(x2.reshape(-1, 4), None, None, training=True, eps=EPS).reshape(x.shape).backward(dy)
    _close(x.grad, x2.grad, "BN dx", tol=1e-12)


def test_two_dimensional_input_bfloat16_and_from_layernorm():
    ln = torch.nn.LayerNorm(8, eps=1e-6)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-1, 1)
    un = UnifiedNorm.from_layernorm(ln, M=2, warmup=5)
    assert un.eps == 1e-6 and torch.equal(un.weight, ln.weight) and torch.equal(un.bias, ln.bias)
    assert (un.M, un.M_grad, un.warmup) == (2, 2, 5)
    x = torch.randn(10, 8, requires_grad=True)
    y = un(x)
    assert y.shape == (10, 8)
    y.sum().backward()
    assert x.grad.shape == (10, 8)
    xb = torch.randn(2, 10, 8, dtype=torch.bfloat16, requires_grad=True)
    unb = UnifiedNorm(8).to(torch.bfloat16)
    yb = unb(xb)
    assert yb.dtype == torch.bfloat16 and torch.isfinite(yb).all()
    yb.float().sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and unb.weight.grad.dtype == torch.bfloat16


def test_invalid_configurations_are_refused():
    with pytest.raises(ValueError, match="unknown offline norm method"):
        OfflineNorm(4, method="gn")
    with pytest.raises(ValueError, match="outlier filtration"):
        UnifiedNorm(4, M=1)
    with pytest.raises(ValueError, match="outlier filtration"):
        OfflineNorm(4, method="mabn", outlier_filtration=True)
    with pytest.raises(ValueError, match="momenta"):
        UnifiedNorm(4, alpha=1.0)
