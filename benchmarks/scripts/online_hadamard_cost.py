"""What the online Hadamard (before the MLP down-projections) costs in a float32 forward of the bundled
model, with normfold's C Walsh-Hadamard kernel (nf_fwht_f32) vs the plain-aten fwht, and torch.ao int8
dynamic quantization with it vs float32. One thread, batch 1 x 256 and 8 x 256 tokens, interleaved
rounds (normfold.bench.timing.measure), ratios paired per round against the rotated form without the
online step; "A/A" is an identical copy of that reference (the noise floor). Two more rows bound what
any online step can cost: "in place" writes the rotation into the hook's input tensor (no allocation;
safe here because nothing else reads the down-projection's input), "copy floor" replaces the rotation
by one plain copy of the same tensors (allocation + one read and one write: a memory-bound floor).
The "step alone" rows replay only the online step: every hook input of one forward (recorded once),
transformed by the C kernel / aten / copied, timed in the same interleaved rounds, so their ratio to the
rotated forward is the step's share of a float32 forward without the forward's own noise in the numerator.

    PYTHONPATH=src python benchmarks/scripts/online_hadamard_cost.py [--rounds 15]
"""

import argparse
import contextlib
import copy
import warnings

import torch
from torch import nn

import normfold
import normfold.nn.online as online
from normfold.bench.timing import machine_info, measure, paired
from normfold.io import load_source
from normfold.ops.hadamard import fwht, fwht_fast

warnings.filterwarnings("ignore")
p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=15)
args = p.parse_args()
torch.set_num_threads(1)


def conv1d_to_linear(model: nn.Module) -> nn.Module:
    model = copy.deepcopy(model)
    for name, m in list(model.named_modules()):
        if type(m).__name__ == "Conv1D":
            lin = nn.Linear(m.weight.shape[0], m.weight.shape[1], dtype=m.weight.dtype)
            with torch.no_grad():
                lin.weight.copy_(m.weight.T)
                lin.bias.copy_(m.bias)
            for h in m._forward_pre_hooks.values():
                lin.register_forward_pre_hook(h)
            for k, v in m._buffers.items():
                lin.register_buffer(k, v, persistent=False)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, lin)
    return model


@contextlib.contextmanager
def swap_fwht(fn):
    saved = online.fwht_fast
    online.fwht_fast = fn
    try:
        yield
    finally:
        online.fwht_fast = saved


def aten_fwht():
    return swap_fwht(fwht)


def in_place(x, core=None):
    return fwht_fast(x, core, out=x) if x.is_contiguous() else fwht_fast(x, core)


def copy_only(x, core=None):
    return torch.empty_like(x).copy_(x)


model, _ = load_source(None)
model = model.float().eval()
rot, _ = normfold.convert(model, rotate="hadamard", verify=False)
onl, _ = normfold.convert(model, rotate="hadamard", rotate_online=True, verify=False)
aa = copy.deepcopy(rot)


def q8(model: nn.Module) -> nn.Module:
    lin = conv1d_to_linear(model)
    q = torch.ao.quantization.quantize_dynamic(lin, {nn.Linear}, dtype=torch.qint8)
    qmods = dict(q.named_modules())
    for name, m in lin.named_modules():  # the swap keeps hooks, not buffers: give back the Hadamard cores
        for k, v in m._buffers.items():
            if k.startswith("_normfold") and k not in qmods[name]._buffers:
                qmods[name].register_buffer(k, v, persistent=False)
    return q


int8_onl, int8_rot = q8(onl), q8(rot)
print(machine_info())
for batch in (1, 8):
    ids = torch.randint(0, 2048, (batch, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = onl(input_ids=ids, use_cache=False).logits
        with aten_fwht():
            ref_aten = onl(input_ids=ids, use_cache=False).logits
    print(f"batch {batch}: online C vs aten logits max diff {float((ref - ref_aten).abs().max()):.3g}")

    inputs = []

    def record(x, core=None):
        inputs.append((x.clone(), core))
        return fwht_fast(x, core)

    with torch.no_grad(), swap_fwht(record):
        onl(input_ids=ids, use_cache=False)

    def step(fn):
        def f():
            for x, core in inputs:
                fn(x, None if core is None else core.to(x.dtype))
        return f

    def run(m, aten=False, swap=None):
        def f():
            with torch.no_grad(), (aten_fwht() if aten else swap_fwht(swap) if swap else contextlib.nullcontext()):
                m(input_ids=ids, use_cache=False)
        return f

    c = {"fp32 original": run(model), "fp32 rotated": run(rot), "fp32 rotated A/A": run(aa),
         "fp32 rotated+online (C fwht)": run(onl), "fp32 rotated+online (aten fwht)": run(onl, aten=True),
         "fp32 rotated+online (C, in place)": run(onl, swap=in_place),
         "fp32 rotated+copy floor": run(onl, swap=copy_only),
         "step alone (C fwht)": step(fwht_fast), "step alone (aten fwht)": step(fwht),
         "step alone (copy)": step(copy_only),
         "int8 rotated": run(int8_rot), "int8 rotated+online (C fwht)": run(int8_onl),
         "int8 rotated+online (aten fwht)": run(int8_onl, aten=True)}
    st = measure(c, rounds=args.rounds, warmup=2, min_time=0.05)
    for name, s in st.items():
        r = paired(s, st["fp32 rotated"])
        o = paired(s, st["fp32 original"])
        print(f"batch {batch} | {name:36s} | median {s.median * 1e3:8.2f} ms | vs fp32 rotated {r.median:.3f} "
              f"[{r.q25:.3f}, {r.q75:.3f}] | vs fp32 original {o.median:.3f} [{o.q25:.3f}, {o.q75:.3f}]")
