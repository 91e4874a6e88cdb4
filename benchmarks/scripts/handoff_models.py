"""Paired A/B: the same loaded fast model with and without the cross-block hand-off (handoff.unlink on a
deepcopy), plus an A/A copy (a second deepcopy with the hand-off); GPT-2 small 4 layers (256 tokens) and
ViT-S/16 batch 1, float32, inference_mode, one thread, CPU time per forward, medians of per-round ratios.
Run: PYTHONPATH=src python THIS [rounds]."""
import copy, statistics, sys, tempfile, time
import torch, transformers, normfold
from normfold.fastpath import handoff
torch.set_num_threads(1)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
cases = {
    "GPT-2 small 4L, 256 tok": (transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=768, n_layer=4, n_head=12, vocab_size=50257, n_positions=1024)),
                                {"input_ids": torch.randint(0, 50257, (1, 256)), "use_cache": False}),
    "ViT-S/16 b1": (transformers.ViTForImageClassification(transformers.ViTConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536, image_size=224, patch_size=16, num_labels=1000)),
                    {"pixel_values": torch.randn(1, 3, 224, 224)}),
}
for name, (model, x) in cases.items():
    model.eval()
    for to in ("rmsnorm", "crmsnorm"):
        d = tempfile.mkdtemp() + "/m"
        conv, rep = normfold.convert(model, to=to, verify=False)
        normfold.save(conv, rep, d)
        on = normfold.load(d); aa = copy.deepcopy(on); off = copy.deepcopy(on); handoff.unlink(off)
        ms = {"on": on, "aa": aa, "off": off}
        t = {k: [] for k in ms}
        with torch.inference_mode():
            for m in ms.values():
                for _ in range(2): m(**x)
            for r in range(rounds):
                order = list(ms)[r % 3:] + list(ms)[:r % 3]
                for k in order:
                    t0 = time.thread_time(); ms[k](**x); t[k].append(time.thread_time() - t0)
        st = handoff.stats(on)
        r_on = statistics.median(a / b for a, b in zip(t["on"], t["off"]))
        r_aa = statistics.median(a / b for a, b in zip(t["aa"], t["off"]))
        r_onaa = statistics.median(a / b for a, b in zip(t["on"], t["aa"]))
        print(f"{name} {to}: links {st['links']} hits/round {st['hits'] / (rounds + 2):.0f}; median ms off {1e3 * statistics.median(t['off']):.1f} "
              f"on {1e3 * statistics.median(t['on']):.1f}; on/off {r_on:.4f}, copy-of-on/off {r_aa:.4f}, A/A on/copy-of-on {r_onaa:.4f}", flush=True)
