"""normfold.checkpoint.writer: the safetensors files it writes are byte for byte safetensors' own, and the
SHA-256 it computes while writing is the file's (checked with an independent hash of the file on disk)."""

import hashlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from normfold.checkpoint.writer import can_write, save_safetensors


def _state(dtype):
    g = torch.Generator().manual_seed(0)
    return {"b.weight": torch.randn(7, 5, generator=g).to(dtype), "a.bias": torch.randn(5, generator=g).to(dtype),
            "pos": torch.arange(11), "mask": torch.ones(3, 3, dtype=torch.bool), "empty": torch.zeros(0, 4),
            "scalar": torch.tensor(2.5, dtype=dtype), "u8": torch.arange(9, dtype=torch.uint8)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_same_bytes_as_safetensors_and_true_digest(dtype, tmp_path):
    state = _state(dtype)
    assert can_write(state)
    save_file(state, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    digest = save_safetensors(state, tmp_path / "ours.safetensors", metadata={"format": "pt"})
    ours, ref = (tmp_path / "ours.safetensors").read_bytes(), (tmp_path / "ref.safetensors").read_bytes()
    assert ours == ref
    assert digest == {"sha256": hashlib.sha256(ours).hexdigest(), "bytes": len(ours)}
    back = load_file(str(tmp_path / "ours.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_refuses_to_overwrite(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"old")
    with pytest.raises(FileExistsError):
        save_safetensors(_state(torch.float32), tmp_path / "x.safetensors", metadata={})
    assert (tmp_path / "x.safetensors").read_bytes() == b"old"
