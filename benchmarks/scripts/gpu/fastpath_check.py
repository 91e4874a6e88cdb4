"""On a CUDA machine: the fast paths of loaded models (fused add + norm blocks, tied head) against the
same checkpoints loaded with fast=False, and against the original, on the GPU; which backend the norms
use there; greedy generate() tokens. Prints one line per check; exits 1 if a check fails.

    python benchmarks/scripts/gpu/fastpath_check.py
"""

from __future__ import annotations

import copy
import sys
import tempfile

import torch
import transformers

import normfold
from normfold import fastpath, ops


def _models():
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=768, n_layer=2, n_head=12, vocab_size=5003, n_positions=256, bos_token_id=0, eos_token_id=0))
    vit = transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=384, num_hidden_layers=2, num_attention_heads=6, intermediate_size=1536, image_size=224,
        patch_size=16, num_labels=1000))
    g = torch.Generator().manual_seed(1)
    return {"gpt2": (gpt2.eval(), {"input_ids": torch.randint(0, 5003, (2, 128), generator=g)}),
            "vit": (vit.eval(), {"pixel_values": torch.randn(2, 3, 224, 224, generator=g)})}


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def main() -> int:
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the script itself
    failed = 0
    x_probe = torch.randn(256, 768, device=dev)
    print(f"device {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"norm backend on {dev} float32: {ops.backend_for(x_probe)}, bfloat16: {ops.backend_for(x_probe.bfloat16())}")
    with tempfile.TemporaryDirectory() as work:
        for family, (model, x) in _models().items():
            for to in ("rmsnorm", "crmsnorm"):
                conv, report = normfold.convert(model, to=to, verify=False)
                normfold.save(conv, report, f"{work}/{family}-{to}")
                for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
                    orig = copy.deepcopy(model).to(dev, dtype)
                    fast = normfold.load(f"{work}/{family}-{to}").to(dev, dtype)
                    plain = normfold.load(f"{work}/{family}-{to}", fast=False).to(dev, dtype)
                    fused = sum(fastpath.is_fused(m) for m in fast.modules())
                    xx = {k: v.to(dev, dtype) if v.is_floating_point() else v.to(dev) for k, v in x.items()}
                    with torch.no_grad():
                        a, b, c = fast(**xx).logits, plain(**xx).logits, orig(**xx).logits
                    e_plain, e_orig = _rel(a, b), _rel(a, c)
                    ok = e_plain <= tol and e_orig <= tol and fused > 0
                    line = (f"{family:5s} {to:9s} {str(dtype)[6:]:9s} fused blocks {fused}  "
                            f"fast vs fast=False {e_plain:.2e}  fast vs original {e_orig:.2e}")
                    if family == "gpt2" and dtype is torch.float32:
                        ids = xx["input_ids"][:1, :16]
                        kw = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": 0}
                        with torch.no_grad():
                            same = torch.equal(fast.generate(ids, **kw), orig.generate(ids, **kw))
                        line += f"  generate() tokens equal: {same}"
                        ok = ok and same
                    print(("PASS " if ok else "FAIL ") + line)
                    failed += not ok
    print("all passed" if not failed else f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
