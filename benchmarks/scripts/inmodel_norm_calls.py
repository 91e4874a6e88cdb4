"""Where a norm call's time goes inside the bundled model, against the same call in isolation.

For the original (nn.LayerNorm) and the converted model (normfold RMSNorm), and for three stand-ins
put in the converted model's norm positions (an identity, `torch.empty_like`, `x.clone()`), it
prints the median time per call at each norm position:
- in the model: forward hooks around every norm call during whole forwards (the hooks' own cost
  included; the identity row shows what that cost is in place);
- isolated: the same module called again and again on the input it got in the model.

docs/kernels-cpu.md, "Why the per-norm ratio is higher inside the model", cites its output.

    python benchmarks/scripts/inmodel_norm_calls.py                       # float32, batch 1 x 128
    python benchmarks/scripts/inmodel_norm_calls.py bfloat16 8 256
"""

import statistics
import sys
import time
import types

import torch

from normfold import convert
from normfold.bench.timing import steady_allocator
from normfold.io import load_source
from normfold.nn import RMSNorm

STAND_INS = {"identity": lambda self, x: x, "empty_like": lambda self, x: torch.empty_like(x),
             "clone": lambda self, x: x.clone()}


def per_call(model, kind, ids, forwards=60, repeats=200):
    """(median µs per call at each position in the model, the same isolated), for modules of `kind`."""
    mods = [m for m in model.modules() if isinstance(m, kind)]
    times = {id(m): [] for m in mods}
    start, inputs, handles = {}, {}, []

    def post(mod, args, out):
        times[id(mod)].append(time.perf_counter() - start[id(mod)])
        inputs[id(mod)] = args[0]

    for m in mods:
        handles.append(m.register_forward_pre_hook(lambda mod, args: start.__setitem__(id(mod), time.perf_counter())))
        handles.append(m.register_forward_hook(post))
    try:
        with torch.inference_mode():
            for _ in range(forwards):
                model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    in_model = [statistics.median(times[id(m)][forwards // 6:]) * 1e6 for m in mods]
    isolated = []
    with torch.inference_mode():
        for m in mods:
            x = inputs[id(m)]
            for _ in range(repeats // 4):
                m(x)
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                m(x)
                ts.append(time.perf_counter() - t0)
            isolated.append(statistics.median(ts) * 1e6)
    return in_model, isolated


def main() -> None:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
    batch, seq = (int(a) for a in sys.argv[2:4]) if len(sys.argv) > 3 else (1, 128)
    steady_allocator()
    torch.manual_seed(0)
    model, _ = load_source(None, dtype=dtype)
    converted, _ = convert(model, verify=False)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    print(f"bundled model, {dtype}, batch {batch}x{seq}, {torch.get_num_threads()} threads; µs per call, "
          "median at each norm position (in the model: hooks included)")
    print("| module | in the model: per position | sum | isolated: per position | sum |")
    print("| --- | --- | --- | --- | --- |")
    rows = [("nn.LayerNorm (original)", model, torch.nn.LayerNorm, None),
            ("normfold RMSNorm (converted)", converted, RMSNorm, None)]
    rows += [(f"{name} at the norms' places", None, RMSNorm, fn) for name, fn in STAND_INS.items()]
    for label, m, kind, fn in rows:
        if fn is not None:
            m, _ = convert(model, verify=False)
            for mod in m.modules():
                if isinstance(mod, RMSNorm):
                    mod.forward = types.MethodType(fn, mod)
        in_model, isolated = per_call(m, kind, ids)
        fmt = lambda v: " ".join(f"{t:.1f}" for t in v)  # noqa: E731
        print(f"| {label} | {fmt(in_model)} | {sum(in_model):.0f} | {fmt(isolated)} | {sum(isolated):.0f} |")


if __name__ == "__main__":
    main()
