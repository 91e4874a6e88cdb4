"""The values of a streamed conversion: one component at a time, its parameters read from the checkpoint into
real tensors on an otherwise meta model, and the in-memory conversion's own edit functions run on them (the
same roundings, so the same bytes); big last-axis writers and tied heads in float64 row chunks."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..adapters.base import get, parent_and_leaf
from ..algebra import layout_of, reused_buffers
from ..algebra.rows import CENTER_CHUNK_BYTES, center_rows_in_place, row_chunks  # noqa: F401 (re-exported)
from ..compress.crmsnorm import compressed_value, tied_head_mean
from ..conversion import center_writer_at, fold_scales, swap_norm, tied_head_shift, will_fold
from ..errors import NonFiniteWeightsError
from ..nn import TiedHead
from ..options import ConvertOptions
from . import safetensors_io as st
from .plan import Component, Edit
from .source import Source

# A writer whose output axis is its last (embeddings, Conv1D) is centred in row chunks of about this many
# float64 bytes (algebra.CENTER_CHUNK_BYTES, the in-memory conversion's too): the same result (rows are
# independent), float64 temporaries stay small and in cache (~5x faster than whole-tensor passes on a 2-core machine).
CHUNK_BYTES = CENTER_CHUNK_BYTES
SLAB_BYTES = 192 * 1024 * 1024



class Computer:
    """Runs one component at a time on real tensors read from the checkpoint, the rest of the model on meta."""

    def __init__(self, model: nn.Module, plan, options: ConvertOptions, source: Source, names: dict[str, str],
                 compression: dict | None = None):
        self.model, self.plan, self.options, self.source, self.names = model, plan, options, source, names
        self.ties: dict[str, tuple] = {}  # head -> (original row means, γ or None), from its "tieprep" edit
        self.compression = compression  # Pre-CRMSNorm: compress's record, applied to each computed tensor
        # a TiedCompressedHead's `mean` output: the row means of the head's original (tied) table
        self.head_means = {f"{t['head']}.mean": f"{t['head']}.weight" for t in (compression or {}).get("tied_heads", [])}
        # read buffers recycled block after block (st.Slabs): about what is in flight at once (a component read
        # ahead, one computed, 64 MB queued for the writer)
        # (Pre-CRMSNorm: the d−1 results take slabs too, about as many bytes again)
        self.slabs = st.Slabs(budget=SLAB_BYTES * (1 if compression is None else 2))
        self.scratch: dict = {}  # fold_affine's float64 copy and rounded result, reused (algebra.reused_buffers)
        self.aliases: dict[str, str] = {}  # output name -> the computed parameter it is tied to (plan.tied_aliases)

    def derived(self, name: str) -> torch.Tensor:
        """An output computed from source tensors outside any edit (a tied compressed head's row means, in row
        chunks: rows are independent, so the bytes are tied_head_mean's over the whole table)."""
        src = self.names[self.head_means[name]]
        info = self.source.tensors[src]
        dtype = st.TORCH_DTYPES.get(info.dtype)
        if dtype is None or len(info.shape) < 2 or 0 in info.shape:
            table = self._read(self.head_means[name])
            flat = table.reshape(-1, table.shape[-1])
            out = torch.empty(flat.shape[0], dtype=table.dtype)
            for a, b in row_chunks(flat.shape[0], CHUNK_BYTES // 8 // max(1, flat.shape[1])):
                out[a:b] = tied_head_mean(flat[a:b])
            return out.reshape(table.shape[:-1])
        # the table read chunk by chunk into one reused buffer (it is a one-off read of the whole table
        # otherwise: a second table-sized allocation, ~80 k page faults at GPT-2-XL's shapes); the same chunks
        # as above, so the same bytes
        width = info.shape[-1]
        n = info.nbytes // (width * torch.empty((), dtype=dtype).element_size())
        row_bytes = info.nbytes // n
        chunks = row_chunks(n, CHUNK_BYTES // 8 // max(1, width))
        buf = torch.empty(max(b - a for a, b in chunks) * width, dtype=dtype)
        out = torch.empty(n, dtype=dtype)
        for a, b in chunks:
            rows = buf[:(b - a) * width]
            st.read_into(info.file, info.start + a * row_bytes, rows)
            if rows.is_floating_point() and not st.all_finite(rows):
                raise NonFiniteWeightsError(f"tensor {src} of {self.source.path} has NaN/inf values; no conversion "
                                            "of it can be exact. Fix or re-download the checkpoint.")
            out[a:b] = tied_head_mean(rows.view(b - a, width))
        return out.reshape(info.shape[:-1])

    def _compressed(self, name: str, value: torch.Tensor, out: dict) -> torch.Tensor:
        t = self._drop_last_in_place(name, value, out)
        return compressed_value(name, value, self.compression) if t is None else t

    def _drop_last_in_place(self, name: str, value: torch.Tensor, out: dict) -> torch.Tensor | None:
        """A large writer whose last axis is the stream (the embedding table) without its last coordinate, as
        compress's writer step makes it (`value[..., :-1]` made contiguous: the same bytes), compacted within
        its own read buffer in row chunks instead of copied into a second table-sized tensor (at GPT-2-XL's
        shapes 0.3 GB more at the conversion's peak). None where that does not apply (compressed_value runs)."""
        c = self.compression
        if (c.get("pad") or name in c.get("reader_params", {}) or value.dim() < 2 or not value.is_contiguous()
                or c.get("writer_params", {}).get(name) not in (-1, value.dim() - 1)
                or value.device.type != "cpu" or value.numel() * value.element_size() <= self.slabs.largest
                or value.shape[-1] < 2):
            return None
        ptr = value.untyped_storage().data_ptr()
        if any(v is not value and v.untyped_storage().data_ptr() == ptr for v in out.values()):
            return None  # another output reads this memory
        d = value.shape[-1]
        flat = value.reshape(-1, d)
        n = flat.shape[0]
        dest = value.reshape(-1)[:n * (d - 1)]
        step = max(1, CHUNK_BYTES // (d * value.element_size()))
        buf = torch.empty(min(step, n) * (d - 1), dtype=value.dtype)
        for a in range(0, n, step):  # rows [a, b) land before row b's source: nothing unread is overwritten
            b = min(n, a + step)
            tmp = buf[:(b - a) * (d - 1)].view(b - a, d - 1)
            tmp.copy_(flat[a:b, :-1])
            dest[a * (d - 1):b * (d - 1)].copy_(tmp.reshape(-1))
        return dest.view(*value.shape[:-1], d - 1)

    def _result(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """Memory for a computed output (algebra.result_buffer): a slab of `self.slabs`."""
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        return self.slabs.take(n).view(dtype).reshape(shape)

    def _read(self, name: str) -> torch.Tensor:
        src = self.names[name]
        t = st.read_tensor(self.source.tensors[src], self.slabs)
        if t.is_floating_point() and not st.all_finite(t):
            raise NonFiniteWeightsError(f"tensor {src} of {self.source.path} has NaN/inf values; no conversion of it "
                                        "can be exact. Fix or re-download the checkpoint.")
        return t

    def read(self, comp: Component) -> dict[str, torch.Tensor]:
        """The component's parameters read from the checkpoint and checked finite (thread-safe: the reader
        thread runs this for the next component while the main thread computes this one)."""
        if sum(self.source.tensors[self.names[n]].nbytes for n in comp.params) > self.slabs.largest:
            # a one-off large component (an embedding table), read while the previous one is computed: the
            # reused buffers are let go first (they would add to its peak; the main thread keeps any it is using)
            self.scratch.clear()
            self.slabs.drop_free()
            st.trim()
        return {name: self._read(name) for name in comp.params}

    def run(self, comp: Component, keys: list[str], tensors: dict[str, torch.Tensor] | None = None
            ) -> dict[str, torch.Tensor]:
        st.trim_if_over()  # the previous component's memory: kept for reuse unless over budget
        if tensors is None:
            tensors = self.read(comp)
        for name in comp.params:
            parent, leaf = parent_and_leaf(self.model, name)
            setattr(parent, leaf, nn.Parameter(tensors.pop(name), requires_grad=False))
        try:
            with reused_buffers(self.scratch):
                for batch in batches(comp.edits):
                    self._apply(batch)
            out = {k: get(self.model, self.aliases.get(k, k)).detach() for k in keys}
            if self.compression is not None:
                # float64 temporaries reused; each new (d−1) result in a recycled read buffer (free again once
                # the writer has dropped it), not fresh memory
                with reused_buffers(self.scratch, results=self._result):
                    out = {k: self._compressed(k, v, out) for k, v in out.items()}
            return out
        finally:
            for path in comp.modules:  # back to meta: frees the component's memory
                obj = get(self.model, path)
                if isinstance(obj, nn.Parameter):
                    parent, leaf = parent_and_leaf(self.model, path)
                    setattr(parent, leaf, nn.Parameter(torch.empty_like(obj, device="meta"), requires_grad=False))
                else:
                    obj.to("meta")

    def _apply(self, batch: list[Edit]) -> None:
        kind = batch[0].kind
        if kind == "scale":
            fold_scales(self.model, [e.arg for e in batch])
        elif kind == "center":
            if not self._center_chunked(batch[0].arg):
                center_writer_at(self.model, batch[0].arg)
        elif kind == "tieprep":  # as convert.tie_groups reads them: before any edit
            t = batch[0].arg
            table = get(self.model, t.table).weight
            gamma = get(self.model, t.norm).weight.detach().double().clone() if t.norm else None
            self.ties[t.head] = (_by_rows(table, lambda rows, a, b: rows.double().mean(dim=-1), torch.float64), gamma)
        elif kind == "tiedhead":  # as convert.keep_ties builds it
            t = batch[0].arg
            table = get(self.model, t.table)
            means, gamma = self.ties.pop(t.head)
            flat_means = means.reshape(-1)
            shift = _by_rows(table.weight, lambda rows, a, b: tied_head_shift(flat_means[a:b], rows), table.weight.dtype)
            head = get(self.model, t.head)
            parent, leaf = parent_and_leaf(self.model, t.head)
            setattr(parent, leaf, TiedHead(table, shift, None if gamma is None else gamma.to(table.weight.dtype),
                                           head.bias))
        else:
            swap_norm(self.model, batch[0].arg, will_fold(batch[0].arg, self.options), self.options)

    def _center_chunked(self, path: str) -> bool:
        """A writer whose output axis is its last (embedding tables, Conv1D): centred in row chunks, in place,
        the same values as `center_writer_at` (rows are independent), float64 only over a chunk."""
        obj = get(self.model, path)
        if isinstance(obj, nn.Parameter):
            weight, bias, out_dim = obj, None, -1
        else:
            lay = layout_of(obj)
            if lay is None:
                return False
            weight = getattr(obj, lay.weight)
            bias = getattr(obj, lay.bias, None) if lay.bias else None
            out_dim = lay.out_dim
        if weight.dim() < 2 or out_dim not in (-1, weight.dim() - 1):
            return False
        flat = weight.data.reshape(-1, weight.shape[-1])
        with torch.no_grad():
            center_rows_in_place(flat, CHUNK_BYTES // 8 // max(1, weight.shape[-1]), self.scratch)
            if bias is not None:
                bias.copy_(_center_bias(bias))
        return True



def _by_rows(t: torch.Tensor, fn, dtype: torch.dtype) -> torch.Tensor:
    """fn(rows, a, b) -> one value per row, over row chunks of `t` (last axis kept whole): float64 temporaries
    stay chunk-sized, and the values are those of one call over all rows (each row's reduction is its own)."""
    flat = t.detach().reshape(-1, t.shape[-1])
    out = torch.empty(flat.shape[0], dtype=dtype)
    for a, b in row_chunks(flat.shape[0], CHUNK_BYTES // 8 // max(1, flat.shape[1])):
        out[a:b] = fn(flat[a:b], a, b)
    return out.reshape(t.shape[:-1])



def _center_bias(bias: torch.Tensor) -> torch.Tensor:
    from ..algebra import center

    return center(bias, -1)



def batches(edits: list[Edit]) -> list[list[Edit]]:
    """Consecutive scale folds go to one fold_scales call (it sets each multiplier to 1 after all its writers)."""
    out: list[list[Edit]] = []
    for e in edits:
        if e.kind == "scale" and out and out[-1][0].kind == "scale":
            out[-1].append(e)
        else:
            out.append([e])
    return out
