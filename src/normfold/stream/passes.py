"""One streamed forward of a skeleton (block-wise verification): hooks that load and free each unit around
its call, capture every block's stream input and output, run a block once more on a reference input, or
replace it by the reference's output; and the mapping of the original's stream onto a converted one."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..verify import TensorDiff, center_last, is_zero_last, stream_diff
from .streamer import Streamer



def stream_in(args, kwargs) -> Tensor | None:
    if args and isinstance(args[0], Tensor):
        return args[0]
    return kwargs.get("hidden_states")



def _with_stream(args, kwargs, x: Tensor):
    if args and isinstance(args[0], Tensor):
        return (x,) + tuple(args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}



def _stream_out(out) -> Tensor | None:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    if hasattr(out, "items"):
        first = next(iter(out.values()), None)
        return first if isinstance(first, Tensor) else None
    return None



def _replace_stream_out(out, x: Tensor):
    if isinstance(out, Tensor):
        return x
    if isinstance(out, tuple):
        return (x,) + out[1:]
    if isinstance(out, list):
        return [x] + out[1:]
    if hasattr(out, "keys"):
        k = next(iter(out.keys()))
        out[k] = x
        return out
    return x



def to_stream(h: Tensor, like: Tensor, center: bool, rotation: dict | None = None) -> Tensor:
    """The original's stream `h` (float64) as the model whose own stream at that point is `like`
    carries it, in `like`'s dtype. A converted model computes the original's stream up to a
    per-token shift (zero for the recentred Pre-RMSNorm stream; the original's own mean where a
    non-shift-invariant block reads the stream raw, as a Post-LN block 0 does): its centred part is
    the original's, its per-token mean the converted model's own. A Pre-CRMSNorm stream is the first
    d−1 coordinates of the centred stream (or those and a zero, padded to d). `rotation` ({width: Q}, a rotated
    model's `rotate.rotation_of`): its stream is x·Q (Q fixes 1, so centring commutes with it)."""
    h = h.double()
    q = rotation.get(h.shape[-1]) if rotation and center else None
    if q is not None:
        h = h @ q
    if not center:
        return h.to(like.dtype)
    if like.shape[-1] + 1 == h.shape[-1]:
        return center_last(h)[..., :-1].to(like.dtype)
    if like.shape == h.shape and h.shape[-1] > 1 and is_zero_last(like) and not is_zero_last(h):
        c = center_last(h)
        return torch.cat([c[..., :-1], torch.zeros_like(c[..., -1:])], dim=-1).to(like.dtype)
    return (center_last(h) + like.double().mean(dim=-1, keepdim=True)).to(like.dtype)



def block_diff(name: str, test, ref, rotation: dict | None = None) -> TensorDiff:
    """`test`'s stream against `ref`'s; a rotated `test` (x·Q, `rotation` {width: Q}) mapped back by Qᵀ first."""
    t, r = _stream_out(test), _stream_out(ref)
    if t is None or r is None:
        return TensorDiff(name, float("inf"), float("inf"), 0.0)
    q = rotation.get(t.shape[-1]) if rotation else None
    if q is not None:
        t = t.double() @ q.T
    return stream_diff(name, t.double(), r.double())



@dataclass
class _Capture:
    args: tuple
    kwargs: dict
    out: object = None



class Pass:
    """Hooks for one forward of a skeleton: load/free per unit; capture or force per block."""

    def __init__(self, streamer: Streamer, blocks, others, resident, *, capture=False, forced=None,
                 replace=None, replace_like=None, map_center=False, rotation=None, raw_in=frozenset()) -> None:
        self.s = streamer
        self.blocks, self.others, self.resident = blocks, others, resident
        self.capture = capture  # record every block call's stream input / output (float64 reference)
        self.forced = forced  # {block: [_Capture]} of the reference: also run each block on those inputs
        self.replace = replace  # {block: [_Capture]}: skip blocks, return the reference outputs instead
        self.replace_like = replace_like  # {block: [stream output of this model's own run]} (its means)
        self.map_center = map_center
        self.rotation = rotation  # {width: Q}: the converted stream is the original's ·Q (normfold.rotate)
        self.raw_in = raw_in  # blocks whose input is rotated by their own explicit pre-hook: mapped without Q
        self.captured: dict[str, list[_Capture]] = {b: [] for b in blocks}
        self.forced_out: dict[str, list[tuple]] = {b: [] for b in blocks}  # (reference call, output)
        self.free_in: dict[str, list[Tensor]] = {b: [] for b in blocks}
        self.free_out: dict[str, list[Tensor]] = {b: [] for b in blocks}  # stream outputs (tail pass)
        self.row_chunked: dict[str, str] = {}  # head -> its matrix's slot, run in row chunks (Streamer.run_rows)
        self._inner = False
        self._handles = []
        self._held: dict[str, int] = {}

    def __enter__(self):
        model = self.s.model
        for path in self.resident:
            m = self.s.model.get_submodule(path) if path else model
            for pname, p in m._parameters.items():
                if p is not None:
                    full = f"{path}.{pname}" if path else pname
                    self._held[full] = self.s.load(full)
        for path in self.others:
            module = model.get_submodule(path)
            slot = self.s.row_chunked(path, module)
            if slot is not None:  # a large head in a cast pass: run over row chunks of its matrix
                self.row_chunked[path] = slot
                module.forward = _rows_forward(self.s, path, slot, type(module).forward.__get__(module))
            self._hook(module, path, block=False)
        if self.replace is None:  # each block's successor in its stack, read ahead while it computes
            self.s.next_unit = {a: b for a, b in zip(self.blocks, self.blocks[1:])
                                if a.rpartition(".")[0] == b.rpartition(".")[0]}
        for path in self.blocks:
            block = model.get_submodule(path)
            if self.replace is not None:
                calls = iter(self.replace[path])
                block.forward = _replaced_forward(calls, iter(self.replace_like[path]), self.map_center, self.rotation)
                continue
            self._hook(block, path, block=True)
        return self

    def __exit__(self, *exc):
        self.s.end_read_ahead()  # nothing left reading, also when the forward raised
        for h in self._handles:
            h.remove()
        for path in list(self.blocks) + list(self.row_chunked):
            self.s.model.get_submodule(path).__dict__.pop("forward", None)
        for full, n in self._held.items():
            self.s.free(full, n)
        self._held.clear()

    def _hook(self, module: nn.Module, path: str, block: bool) -> None:
        def pre(mod, args, kwargs):
            if self._inner:
                return None
            rows = None if block else _lookup_rows(mod, args, kwargs)
            if rows is not None:
                self.s.lookup_rows[path] = rows
            if path in self.row_chunked:
                self.s.skip[path] = self.row_chunked[path]
            self._held[path] = self.s.load(path)
            if block:
                self._block_pre(mod, path, args, kwargs)
            return None

        def post(mod, args, kwargs, out):
            if self._inner:
                return None
            if block and self.capture:
                self.captured[path][-1].out = _detach(out)
            if block and _stream_out(out) is not None:
                self.free_out[path].append(_stream_out(out).detach())
            self.s.free(path, self._held.pop(path))
            return None

        # Prepended: the block's raw input is captured before normfold's own pre-hooks (Recenter,
        # compress) transform it, so that the extra call on the reference input goes through them too.
        self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        self._handles.append(module.register_forward_hook(post, with_kwargs=True))

    @torch.no_grad()
    def _block_pre(self, mod, path, args, kwargs) -> None:
        x = stream_in(args, kwargs)
        if x is not None:
            self.free_in[path].append(x.detach())
        if self.capture:
            self.captured[path].append(_Capture(tuple(args), dict(kwargs)))
        if self.forced is not None and x is not None:
            k = len(self.forced_out[path])
            ref = self.forced[path][k] if k < len(self.forced[path]) else None
            if ref is None:
                self.forced_out[path].append((None, None))
                return
            rotation = None if path in self.raw_in else self.rotation
            a, kw = _with_stream(args, kwargs, to_stream(stream_in(ref.args, ref.kwargs), x, self.map_center,
                                                               rotation))
            self._inner = True
            try:
                with _only_normfold_hooks(mod):
                    out = mod(*a, **kw)
            finally:
                self._inner = False
            self.forced_out[path].append((ref, _detach(out)))



def _rows_forward(streamer: Streamer, path: str, slot: str, forward):
    def rows_forward(*args, **kwargs):
        return streamer.run_rows(path, slot, forward, args, kwargs)

    return rows_forward


def _lookup_rows(mod: nn.Module, args, kwargs) -> Tensor | None:
    """The token ids a plain nn.Embedding unit is about to look up (its forward reads only those rows of its
    table), else None (the whole unit is loaded)."""
    if type(mod) is not nn.Embedding or "forward" in vars(mod) or mod.max_norm is not None:
        return None
    ids = args[0] if args else kwargs.get("input")
    if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.numel() == 0:
        return None
    rows = ids.reshape(-1).unique()
    if int(rows.min()) < 0 or int(rows.max()) >= mod.num_embeddings:
        return None  # out of range: the whole table, and F.embedding raises as it would
    return rows



@contextlib.contextmanager
def _only_normfold_hooks(mod: nn.Module):
    """The extra call of a block on the reference's input must run normfold's structure hooks (Recenter,
    compress) but not other libraries' hooks: transformers records hidden states with forward hooks
    on the blocks, and would count the extra call as another layer's output."""
    names = ("_forward_pre_hooks", "_forward_hooks")
    saved = {n: getattr(mod, n) for n in names}
    for n in names:
        kept = type(saved[n])((k, h) for k, h in saved[n].items()
                              if getattr(h, "__module__", "").startswith("normfold"))
        setattr(mod, n, kept)
    try:
        yield
    finally:
        for n, hooks in saved.items():
            setattr(mod, n, hooks)



def _replaced_forward(calls, likes, center: bool, rotation=None):
    """A block's forward that returns the reference's output for this call, mapped to the stream
    the block receives (so everything after the blocks runs on the original's hidden states)."""
    def forward(*args, **kwargs):
        ref, like = next(calls), next(likes)
        return _replace_stream_out(_clone_struct(ref.out), to_stream(_stream_out(ref.out), like, center, rotation))

    return forward



def _clone_struct(out):
    if isinstance(out, tuple):
        return tuple(out)
    if isinstance(out, list):
        return list(out)
    if hasattr(out, "keys"):
        return type(out)(**dict(out.items())) if hasattr(out, "to_tuple") else dict(out)
    return out



def _detach(out):
    if isinstance(out, Tensor):
        return out.detach()
    if isinstance(out, tuple):
        return tuple(_detach(o) for o in out)
    if isinstance(out, list):
        return [_detach(o) for o in out]
    return out
