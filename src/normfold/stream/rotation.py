"""`--rotate` streamed: the rotated Pre-RMSNorm values, one component at a time.

The in-memory rotation (`normfold.rotate.apply_rotation`) casts the model to float64, runs the Pre-RMSNorm
conversion with the final norms folded and the heads untied, folds every γ still kept into its readers, rotates
every stream tensor (t ← t·Q along its stream axis, writers re-centred) and rounds once. Each tensor's value
depends only on the tensors of its component (a writer alone, a norm with its readers), so here each component
runs the same functions (`center_writer_at`, `fold_scales`, `swap_norm`, `rotate.fold_kept_gamma`,
`algebra.rotate_axis`) on its parameters cast to float64, and rounds once: the same bytes.

A component above BLOCK_ABOVE float64 bytes whose largest tensor is rotated along its last axis (an embedding
table, a vocabulary head) runs over that tensor's row blocks (`algebra.rotation.row_blocks`, the blocks the
in-memory rotation multiplies by Q), so float64 is only ever one block of it; its other outputs must come out
the same from every block (checked).

Streams the in-memory rotation rotates through an explicit x ← x·Q hook (a stem recentred explicitly: BLOOM's
word_embeddings_layernorm, CLIP's pre_layrnorm, mBART's layernorm_embedding, the input of Whisper's first encoder
layer; a final norm no head reads, which keeps γ/β and reads x·Qᵀ) stream too: the hooks hold no weights (Q is a
non-persistent buffer rebuilt from kind + seed), the structure pass records them in structure.rotation["explicit"]
exactly as the in-memory rotation does (it is that code, on meta tensors), the stem's tensors are left unrotated
(`rotate.stream_tensor_names` skips them) and the final norm's γ/β are kept (`targets` reads which norms from the
record).

`--rotate-online` streams too: the structure pass records the down-projections (structure.rotation["online"]) as the
in-memory rotation does, and each of their weights, once rotated by Q along its stream axis, is multiplied by H/√n
along its input axis in the same float64 values before the one rounding (`online_targets`; the order and the
function, `algebra.rotate_axis`, of `rotate.add_online_hadamard`). Such a weight is never split into row blocks:
H mixes what would be its rows in GPT-2's Conv1D layout. `--rotate-attention online` (the Hadamard before each
attention output projection) streams the same way: the structure pass records those projections in
structure.rotation["online"] after the down-projections, as the in-memory rotation does. The value/output rotation
(`vo`, `both`) does not stream (it rotates V's rows inside a fused QKV weight): the executor refuses it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..adapters.base import get, parent_and_leaf
from ..algebra import rotate_axis
from ..algebra.rotation import row_blocks
from ..conversion import VARIANTS, center_writer_at, rotating_variant
from ..errors import NormfoldError, UnsupportedConversionError
from ..ops.hadamard import hadamard_matrix
from .compute import Computer, batches
from .plan import Component
from .source import StreamUnsupportedError

BLOCK_ABOVE = 64 * 1024**2  # float64 bytes of a component above which its largest tensor runs in row blocks

def variant(options):
    """The rotating rmsnorm variant of `options` (what normfold.convert builds for rotate=..., rotate_online=...,
    rotate_attention="online"; the executor refuses the value/output rotation before this)."""
    return rotating_variant(VARIANTS[options.to], options.rotate, options.rotate_seed, options.keep_affine,
                            bool(options.rotate_online), options.rotate_attention)


def check_plan(plan) -> None:
    """Refuse, before anything is written, what the in-memory rotation refuses to place (`rotate.rotation_points`:
    a Recenter that does not start its stream)."""
    from ..rotate import rotation_points

    try:
        rotation_points(plan)
    except UnsupportedConversionError as exc:
        raise StreamUnsupportedError(str(exc)) from exc


def targets(model: nn.Module, plan, report) -> dict[str, tuple[int, bool, int]]:
    """{parameter name: (stream axis, is a writer, stream width)} of every rotated tensor, read off the structure
    model after the rotating variant ran on it (norms swapped, γ folded)."""
    from ..rotate import rotation_points, stream_tensor_names

    widths = [s["width"] for s in report.structure.rotation["streams"]]
    # the final norms no head reads keep γ/β and read x·Qᵀ (the in-memory rotation's record of them)
    back = {e["path"] for e in report.structure.rotation.get("explicit", []) if e.get("transpose")}
    out: dict[str, tuple[int, bool, int]] = {}
    for stream, pts, d in zip(plan.streams, rotation_points(plan), widths):
        pts.unrotate = [s.path for s in stream.norms if s.path in back]
        for name, axis, writer in stream_tensor_names(model, stream, pts):
            if name in out and out[name][2] != d:
                raise StreamUnsupportedError(f"{name} is shared by streams of widths {out[name][2]} and {d}")
            out.setdefault(name, (axis, writer, d))
    return out


def online_targets(model: nn.Module, report) -> dict[str, int]:
    """{weight name: input axis} of the down-projections the in-memory rotation gives an online Hadamard
    (structure.rotation["online"], recorded by the structure pass on `model`)."""
    from ..algebra import layout_of

    out = {}
    for path in (report.structure.rotation or {}).get("online", []):
        lay = layout_of(get(model, path))
        out[f"{path}.{lay.weight}"] = lay.in_dim
    return out


def _module_of(name: str, modules: set[str]) -> bool:
    return name in modules or name.rpartition(".")[0] in modules


class RotatingComputer(Computer):
    """Computer whose components run in float64 from read to one rounding, rotated (see the module docstring)."""

    def __init__(self, model, plan, options, source, names, rotated: dict, qs: dict, outputs,
                 online: dict | None = None):
        super().__init__(model, plan, options, source, names)
        self.rotated, self.qs, self.online = rotated, qs, dict(online or {})
        self.hs: dict[int, torch.Tensor] = {}  # n -> H/√n (float64), built once: see `_hadamard`
        self.dtypes = {o.name: o.dtype for o in outputs}
        self.shapes = {o.name: tuple(o.shape) for o in outputs}

    def check_owned(self, comps: list[Component]) -> None:
        """Every rotated tensor is computed by some component (else it would be copied unrotated)."""
        wanted = set(self.rotated) | set(self.online)
        owned = [n for n in wanted if any(n in c.params or _module_of(n, set(c.modules)) for c in comps)]
        missing = sorted(wanted - set(owned))
        if missing:
            raise StreamUnsupportedError(f"--rotate does not stream this model: {', '.join(missing[:3])} would be "
                                         "rotated but no edit of the streamed plan computes it; convert in memory")

    def read(self, comp: Component) -> dict[str, torch.Tensor] | None:
        """None for a component larger than a read buffer (a table, a vocabulary head): `run` reads it once the
        previous component's float64 temporaries are handed back, not beside them (measured at GPT-2-XL widths:
        the table read ahead beside a block's float64 values was the conversion's peak, 1141 MiB)."""
        if sum(self.source.tensors[self.names[n]].nbytes for n in comp.params) > self.slabs.largest:
            return None
        return super().read(comp)

    def run(self, comp: Component, keys: list[str], tensors: dict | None = None) -> dict[str, torch.Tensor]:
        from . import safetensors_io as st

        if tensors is None:
            st.trim()
            tensors = super().read(comp)
        else:
            st.trim_if_over()
        saved = {p: copy.deepcopy(get(self.model, p)) for p in comp.modules}  # meta: restored per row block
        try:
            big = self._blocked(comp, tensors)
            out = None if big is None else self._by_blocks(comp, keys, tensors, big, saved)
            if out is None:
                self._restore(saved)
                # each read buffer let go as soon as its float64 copy exists
                out = self._once(comp, keys, {n: tensors.pop(n).to(torch.float64) for n in list(tensors)})
                out = {k: v.to(self.dtypes[k]) for k, v in out.items()}
            return out
        finally:
            self._restore(saved)

    def _blocked(self, comp: Component, tensors: dict) -> str | None:
        total = sum(t.numel() for t in tensors.values()) * 8
        if total <= BLOCK_ABOVE:
            return None
        name = max(tensors, key=lambda n: tensors[n].numel())
        t = tensors[name]
        spec = self.rotated.get(name)
        module = name.rpartition(".")[0]
        if (spec is None or name in self.online or t.dim() != 2 or spec[0] not in (1, -1) or not t.is_contiguous()
                or any(n.rpartition(".")[0] == module for n in tensors if n != name)):
            return None  # not row-separable (a bias beside it takes β·W by rows): whole, in float64 (same bytes)
        return name

    def _restore(self, saved: dict) -> None:
        for path in sorted(saved, key=len):
            parent, leaf = parent_and_leaf(self.model, path)
            setattr(parent, leaf, copy.deepcopy(saved[path]))

    def _by_blocks(self, comp, keys, tensors, big, saved) -> dict[str, torch.Tensor] | None:
        """None: the component's other outputs depend on the rows (a reader's bias taking β·W, one grown), found on
        the first block before anything is overwritten; the caller then runs it whole."""
        table = tensors[big]
        others = {n: t for n, t in tensors.items() if n != big}
        first: dict[str, torch.Tensor] = {}
        for i, (a, b) in enumerate(row_blocks(table.shape[0], table.shape[1])):
            self._restore(saved)
            params = {n: t.to(torch.float64) for n, t in others.items()}
            params[big] = table[a:b].to(torch.float64)
            out = self._once(comp, list(dict.fromkeys(keys + [big])), params)
            rows = out.pop(big)
            if i == 0 and any(tuple(v.shape) != self.shapes[k] for k, v in out.items()):
                return None
            table[a:b].copy_(rows)  # rows [a, b) are this block's alone: written over their own source
            for k, v in out.items():
                v = v.to(self.dtypes[k])
                if k not in first:
                    first[k] = v.clone()
                elif not torch.equal(v, first[k]):
                    raise NormfoldError(f"--rotate streamed {big} in row blocks, but {k} of the same component came "
                                        "out differently from two blocks (it depends on the rows): convert in memory "
                                        "(--stream never)")
        return {**first, big: table} if big in keys else first

    def _hadamard(self, n: int) -> torch.Tensor:
        """H/√n as rotate.add_online_hadamard computes it (`hadamard_matrix(n) / n ** 0.5`, float64: the same Q
        `rotate_axis` multiplies by), kept for the next down-projection: building it per layer took ~2.5 × its
        size transiently (the doubling's copies and the division; at n = 4096 that was the conversion's peak,
        1068 MiB against 786 MiB without --rotate-online on a 0.5 GB BLOOM, loaded machine) and its time."""
        if n not in self.hs:
            self.hs[n] = hadamard_matrix(n) / n ** 0.5
        return self.hs[n]

    def _once(self, comp: Component, keys: list[str], params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from ..rotate import fold_kept_gamma

        for name, t in params.items():
            parent, leaf = parent_and_leaf(self.model, name)
            setattr(parent, leaf, nn.Parameter(t, requires_grad=False))
        for batch in batches(comp.edits):
            if batch[0].kind == "center":
                center_writer_at(self.model, batch[0].arg)  # the in-memory code itself (float64: no chunk rounding)
            else:
                self._apply(batch)
        for e in comp.edits:  # step 2 of the rotation: γ a norm still holds goes into its readers
            if e.kind == "swap" and e.arg.readers and getattr(get(self.model, e.arg.path), "weight", None) is not None:
                fold_kept_gamma(self.model, e.arg)
        modules = set(comp.modules)
        with torch.no_grad():
            for name, (axis, writer, d) in self.rotated.items():
                if name in comp.params or _module_of(name, modules):
                    p = get(self.model, name)
                    p.copy_(rotate_axis(p, self.qs[d], axis, center=writer))
            for name, axis in self.online.items():  # after the stream rotation, as rotate.add_online_hadamard
                if name in comp.params or _module_of(name, modules):
                    p = get(self.model, name)
                    p.copy_(rotate_axis(p, self._hadamard(int(p.shape[axis])), axis))
        return {k: get(self.model, k).detach() for k in keys}

