"""Issue 9 item 5: DDP and FSDP2 (gloo, 2 processes on this machine) train a prepared model exactly like
the single-process LayerNorm model; a DCP checkpoint of the prepared FSDP2 model loads into the plain
LayerNorm model (keys unchanged)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from normfold import train as nftrain

import distworker
import trainkit as tk

TOL = 1e-10
STEPS = 20

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


@pytest.fixture(scope="module")
def reference():
    fam = tk.FAMILIES["gpt2"]
    torch.manual_seed(0)
    ln = fam.build().double()
    return tk.train(ln, fam, "adamw", steps=STEPS, loss64=True)


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_distributed_equals_single_process_layernorm(engine, reference, tmp_path):
    distworker.run(engine, str(tmp_path), steps=STEPS)
    got = torch.load(tmp_path / "result.pt", weights_only=True)
    assert tk.loss_error(got["losses"].tolist(), reference.losses) <= TOL
    assert list(got["params"]) == [n for n in tk.pair(tk.FAMILIES["gpt2"])[0].state_dict()]
    params = {n: got["params"][n] for n in reference.params}
    err, name = tk.worst_param_error(params, reference.params)
    assert err <= TOL, (name, err)
    if engine == "fsdp":
        import torch.distributed.checkpoint as dcp

        torch.manual_seed(1)
        plain = tk.FAMILIES["gpt2"].build().double()  # a fresh LayerNorm model, never prepared
        assert not nftrain.is_prepared(plain)
        state = plain.state_dict()
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
        plain.load_state_dict(state)
        for n, p in plain.named_parameters():
            assert torch.equal(p, got["params"][n]), n
