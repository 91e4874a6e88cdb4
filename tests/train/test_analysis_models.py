"""A model without an adapter: prepare() takes its plan from `normfold.analyze(...).to_adapter()`."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from normfold import train as nftrain

import trainkit as tk

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "analysis"))
from analysis_toys import PreLN, realistic_norms  # noqa: E402


def _batch(model, g):
    return {"ids": torch.randint(0, 31, (2, 10), generator=g)}


class _Loss(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        logits = self.inner(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        return type("Out", (), {"loss": loss})()


@pytest.mark.parametrize("to", ["rmsnorm", "crmsnorm"])
def test_toy_without_adapter_trains_exactly(to):
    torch.manual_seed(0)
    ln = realistic_norms(PreLN(tie=True, dropout=0.1)).double()
    prep = copy.deepcopy(ln)
    inputs = {"ids": torch.randint(0, 31, (2, 10))}
    nftrain.prepare(prep, to=to, inputs=inputs)
    st = nftrain.state(prep)
    assert st.adapter == "analysis" and len(st.norms) == 5 and st.dropouts
    fam = tk.Family("toy", None, _batch)
    ref = tk.train(_Loss(ln), fam, "adamw")
    got = tk.train(_Loss(prep), fam, "adamw")
    assert tk.loss_error(got.losses, ref.losses) <= 1e-10
    assert tk.worst_param_error(got.params, ref.params)[0] <= 1e-10
