"""normfold.bench.quant: the fake quantizer against a brute-force reference, the quantized copy, and the
issue-25 targets on the outlier GPT-2 (crest factor >= 3x lower with rotation, W8A8 error lower)."""

import torch

from normfold.bench import quant as Q


def test_fake_quant_brute_force():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=g, dtype=torch.float64) * torch.linspace(0.1, 10, 16, dtype=torch.float64)
    for bits in (4, 8):
        qmax = 2 ** (bits - 1) - 1
        got = Q.fake_quant(x, bits, -1)
        for i in range(5):
            s = max(abs(v) for v in x[i].tolist()) / qmax
            want = [max(-qmax, min(qmax, round(v / s))) * s for v in x[i].tolist()]
            assert torch.allclose(got[i], torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
            assert len(set((got[i] / s).round().tolist())) <= 2 * qmax + 1
        s = float(x.abs().max()) / qmax
        assert torch.allclose(Q.fake_quant(x, bits, None), (x / s).round().clamp(-qmax, qmax) * s, atol=1e-12)


def test_quantized_copy_quantizes_weights_per_output_channel_and_inputs():
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(8, 4))
    q = Q.quantized(lin, 4, 8, "token")
    w = q[0].weight.detach()
    for row, orig in zip(w, lin[0].weight.detach()):
        s = orig.abs().max() / 7
        assert torch.allclose(row, (orig / s).round() * s)
    x = torch.randn(3, 8)
    want = torch.nn.functional.linear(Q.fake_quant(x, 8, -1), w, q[0].bias)
    assert torch.equal(q(x), want)
    assert not torch.equal(lin(x), q(x))


def test_outlier_model_targets():
    model = Q.outlier_gpt2(vocab=256)
    batches = [torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    variants, sites = Q.forms(model, lambda m: None)
    st = {f: Q.activation_stats(variants[f], batches, sites)["stream readers"]["crest_mean"]
          for f in ("plain", "rotated")}
    assert st["rotated"] * 3 <= st["plain"], st
    ref = Q.logits_of(model, batches)
    err = {}
    for f in ("plain", "rotated"):
        assert (Q.logits_of(variants[f], batches) - ref).norm() <= 1e-4 * ref.norm()  # same function
        lq = Q.logits_of(Q.quantized(variants[f], 8, 8, "token"), batches)
        err[f] = float((lq - ref).norm() / ref.norm())
    assert err["rotated"] < err["plain"], err


def test_cli_bench_quant_writes_tables(tmp_path, monkeypatch, capsys):
    """The suite end to end on a tiny budget (random token windows instead of the KJV text)."""
    from normfold.cli import main

    monkeypatch.setattr(Q, "heldout_batches", lambda windows, text=None: [
        torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))])
    monkeypatch.setattr(Q, "CONFIGS", Q.CONFIGS[:2])
    code = main(["bench", "quant", "--quick", "-q", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "Rotated vs plain" in out and "Crest factor" in out
    rows = (tmp_path / "quant.csv").read_text().splitlines()
    assert rows[0].startswith("model,form,config") and any("outlier-gpt2,rotated+online" in r for r in rows)
    assert (tmp_path / "quant_crest.csv").is_file()
    assert main(["bench", "quant", "--device", "cuda", "--out", str(tmp_path)]) == 2
