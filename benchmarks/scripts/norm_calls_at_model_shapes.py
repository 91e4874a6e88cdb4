"""Norm and residual-add call costs at the shapes of `bench hf`'s models (ViT-S/16 197x384, GPT-2 256x768),
float32 / bfloat16: nn.LayerNorm, aten layer_norm, normfold RMSNorm / CRMSNorm modules, the raw kernel, the add,
add + LayerNorm against the fused module call and the layers below it (ops.add_rms_norm, cpu.add_forward);
torch.utils.benchmark, 7 interleaved rounds, medians, µs (docs/performance-breakdown.md).

    python benchmarks/scripts/norm_calls_at_model_shapes.py [threads]
"""
import torch, torch.utils.benchmark as tb, sys
from torch import nn
from normfold.nn import CRMSNorm, RMSNorm
from normfold import ops
from normfold.ops import cpu
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
torch.manual_seed(0)
rounds = 7
for dt in (torch.float32, torch.bfloat16):
    for shape in ((1, 197, 384), (1, 256, 768)):
        d = shape[-1]
        ln = nn.LayerNorm(d, dtype=dt).eval()
        rms = RMSNorm.from_layernorm(ln).eval()
        crms = CRMSNorm(d - 1, dtype=dt).eval()
        x = torch.randn(shape, dtype=dt); x = x - x.mean(-1, keepdim=True)
        r = torch.randn(shape, dtype=dt); r = r - r.mean(-1, keepdim=True)
        xc = x[..., :-1].contiguous(); rc = r[..., :-1].contiguous()
        w, b = rms.weight, rms.bias
        stmts = {"LN": "ln(x)", "F.ln": "torch.layer_norm(x,(d,),ln.weight,ln.bias,1e-5)", "RMS": "rms(x)",
                 "kern": "cpu.fast_forward(x,w,b,1e-5,False)",
                 "add": "x + r",
                 "add+LN": "ln(x + r)", "RMS(x,r)": "rms(x, r)", "ops.add_rms": "ops.add_rms_norm(x,r,w,b,1e-5)",
                 "cpu.add_fwd": "cpu.add_forward(x,r,w,b,1e-5,False,False)",
                 "CRMS": "crms(xc)", "CRMS(x,r)": "crms(xc, rc)"}
        t = {k: [] for k in stmts}
        g = dict(x=x, r=r, xc=xc, rc=rc, ln=ln, rms=rms, crms=crms, torch=torch, d=d, cpu=cpu, ops=ops, w=w, b=b)
        with torch.inference_mode():
            for _ in range(rounds):
                for k, st in stmts.items():
                    t[k].append(tb.Timer(st, globals=g).blocked_autorange(min_run_time=0.1).median)
        med = {k: sorted(v)[len(v) // 2] * 1e6 for k, v in t.items()}
        print(f"{str(dt)[6:]:9s} {str(shape):14s} " + " ".join(f"{k}={v:.1f}" for k, v in med.items()), flush=True)
