"""Verification in bounded memory: `normfold.verify`'s checks, run block by block.

The in-memory check (`verify.compare_models`) holds the original, the converted model and float64
copies of both. Here neither model is ever materialized: both are built with their parameters on the
meta device (the converted one with normfold's recorded structure replayed), and a unit's weights —
one transformer block, or one module outside the block stacks (embeddings, final norm, head) — are
read from the memory-mapped safetensors just before the unit runs and dropped right after it.

Passes (each reads every weight once, holding one unit at a time):

1. original, float64: captures every block's stream input and output, and the exact model outputs;
2. converted, float64: runs end to end (the report's `fp64.outputs`) and, inside each block's
   hook, runs that block once more on the ORIGINAL's stream input mapped to the converted stream
   (the original's centred part with the converted model's own per-token mean; the first d−1
   coordinates for a Pre-CRMSNorm stream): `fp64.blocks`, so a wrong block is named even when
   later blocks would hide or spread its error;
3. converted, float64, with every block replaced by the original's (mapped) output: the part after
   the last block (final norm, heads) checked on its own: `fp64.heads`;
4. and 5. original and converted in their own dtype: end to end (`working`, `baseline`, as in the
   in-memory check) and per block on the float64 stream inputs (`working.blocks`, informative).

Same tolerances as `verify.compare_models`; the result dict has its keys plus `fp64.blocks`,
`fp64.embeddings`, `fp64.heads`, `working.blocks` and `blockwise` (what was held in memory).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from ..errors import CheckpointError, NormfoldError
from ..verify import (CENTERED_OUTPUTS, ULP_FLOOR, WORKING_FACTOR, TensorDiff, center_last, dtype_eps, worst_of,
                      is_zero_last, describe_inputs, diff_outputs, run_model, stored_weights_tolerance, stream_view,
                      top1_agreement)

FP64 = torch.float64


# ---- reading tensors from safetensors, one at a time --------------------------------------------------

class CheckpointReader:
    """Tensor names → memory-mapped safetensors files of a model directory (single file or index).

    Files are mapped with `safe_open` only while one unit is read (`session`); `get` copies one
    tensor out, so nothing stays mapped between units."""

    def __init__(self, directory: str | os.PathLike) -> None:
        from ..checkpoint import ModelDir, read_weight_map

        model_dir = ModelDir(directory)  # every file through the path policy: nothing read from outside
        model_dir.check_all()
        self.dir = model_dir.path
        self.files: dict[str, Path] = {}
        indexes = [n for n in model_dir.entries() if n.endswith(".safetensors.index.json")]
        if indexes:
            for index in indexes:
                for name, file in read_weight_map(model_dir, index).items():
                    self.files.setdefault(name, self.dir / file)
        else:
            from safetensors import safe_open

            for n in model_dir.entries():
                if n.endswith(".safetensors") and not n.startswith("."):
                    f = model_dir.file(n)
                    with _checkpoint_errors(f), safe_open(str(f), "pt") as h:
                        for name in h.keys():
                            self.files.setdefault(name, f)
        if not self.files:
            pickles = [p.name for p in self.dir.glob("*.bin")]
            extra = f" (it has {', '.join(pickles)}: re-save it as safetensors)" if pickles else ""
            raise CheckpointError(f"{self.dir} has no safetensors weights{extra}; block-wise verification "
                                  "reads safetensors only")
        self._handles: dict[Path, object] | None = None
        self._headers: dict[Path, dict] = {}
        self._stage: Tensor | None = None

    def __contains__(self, name: str) -> bool:
        return name in self.files

    @contextlib.contextmanager
    def session(self):
        """Keep files open (mapped) while one unit is read; unmapped after it, so the pages touched
        for one unit do not stay resident for the rest of the run."""
        outer = self._handles is None
        if outer:
            self._handles = {}
        try:
            yield self
        finally:
            if outer:
                handles, self._handles = self._handles, None
                for h in handles.values():
                    with contextlib.suppress(Exception):
                        h.__exit__(None, None, None)

    def _handle(self, f: Path):
        from safetensors import safe_open

        if f not in self._handles:
            with _checkpoint_errors(f):
                self._handles[f] = safe_open(str(f), "pt").__enter__()
        return self._handles[f]

    def _info(self, name: str):
        """The tensor's header entry (file offsets), read once per file with plain reads."""
        from .safetensors_io import read_header

        f = self.files[name]
        if f not in self._headers:
            with _checkpoint_errors(f):
                self._headers[f] = read_header(f)[0]
        return self._headers[f][name]

    def get(self, name: str, out: Tensor | None = None) -> Tensor:
        """A private copy read with pread: no memory map, so no file pages stay resident beside it. `out`
        (a contiguous tensor of the stored shape and dtype) is filled instead of a new tensor."""
        from .safetensors_io import read_into, read_tensor

        with _checkpoint_errors(self.files[name]):
            if out is None:
                return read_tensor(self._info(name))
            entry = self._info(name)
            read_into(entry.file, entry.start, out)
            return out

    def info(self, name: str) -> tuple[tuple, torch.dtype]:
        """(shape, dtype) of a stored tensor, from the header."""
        entry = self._info(name)
        if entry.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{entry.file}: tensor {name!r} has dtype {entry.dtype}, which normfold does not read")
        return tuple(entry.shape), _SAFETENSORS_DTYPES[entry.dtype]

    def _staging(self, nbytes: int) -> Tensor:
        """One reused byte buffer for reads that are cast (no fresh pages per chunk)."""
        if self._stage is None or self._stage.numel() < nbytes:
            self._stage = torch.empty(nbytes, dtype=torch.uint8)
        return self._stage[:nbytes]

    def get_as(self, name: str, dtype: torch.dtype, chunk_bytes: int = 1 << 24, out: Tensor | None = None) -> Tensor:
        """The tensor cast to `dtype`, read (pread) in slices of rows through one reused staging buffer: the
        stored-dtype copy that a whole-tensor read and cast would hold next to the result is never larger
        than `chunk_bytes`. `out` (contiguous, the stored shape, `dtype`) is filled instead of a new tensor."""
        from .safetensors_io import read_into

        entry = self._info(name)
        shape, stored = self.info(name)
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        if len(shape) == 0:
            out.copy_(self.get(name))
            return out
        row = max(1, entry.nbytes // max(1, shape[0]))
        step = max(1, chunk_bytes // row)
        with _checkpoint_errors(entry.file):
            for i in range(0, shape[0], step):
                k = min(step, shape[0] - i)
                part = self._staging(k * row).view(stored).view(k, *shape[1:])
                read_into(entry.file, entry.start + i * row, part)
                out[i:i + k].copy_(part)
        return out

    def get_rows(self, name: str, rows: Tensor, dtype: torch.dtype, out: Tensor) -> None:
        """Only `rows` (indices along the first axis) of the tensor, cast to `dtype`, written into `out` (the
        full shape; the other rows are left as they are): an embedding looked up by a few tokens."""
        from .safetensors_io import read_into

        entry = self._info(name)
        shape, stored = self.info(name)
        row = entry.nbytes // max(1, shape[0])
        part = self._staging(row).view(stored).view(*shape[1:])
        with _checkpoint_errors(entry.file):
            for r in rows.tolist():
                read_into(entry.file, entry.start + r * row, part)
                out[r].copy_(part)

    def dtype(self) -> torch.dtype:
        """The stored floating dtype (of the first floating tensor, in name order)."""
        with self.session():
            return self._dtype()

    def _dtype(self) -> torch.dtype:
        for name in sorted(self.files):
            f = self._handle(self.files[name])
            with _checkpoint_errors(self.files[name]):
                dt = _SAFETENSORS_DTYPES.get(self._info(name).dtype)
            if dt is not None and dt.is_floating_point:
                return dt
        return torch.float32

    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in set(self.files.values()))


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


@contextlib.contextmanager
def _checkpoint_errors(f: Path):
    try:
        yield
    except NormfoldError:
        raise
    except Exception as exc:  # safetensors raises its own error types for broken files
        raise CheckpointError(f"{f} could not be read as safetensors ({type(exc).__name__}: "
                              f"{str(exc).strip()[:300]}); re-save or re-download it") from exc


# ---- models without weights -------------------------------------------------------------------------------

@contextlib.contextmanager
def _parameters_on_meta():
    """Build modules with parameters on the meta device but real buffers (rotary tables, masks and
    position ids computed in __init__ are needed and not always in the checkpoint) — accelerate's
    `init_empty_weights(include_buffers=False)`, without depending on accelerate."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _placeholder(shape, dtype: torch.dtype) -> nn.Parameter:
    """A weight that holds no memory (one NaN, stride 0): anything that reads a weight outside its
    unit's hooks computes NaN and fails the check instead of silently using stale values."""
    fill = float("nan") if dtype.is_floating_point else 0
    return nn.Parameter(torch.full((), fill, dtype=dtype).expand(tuple(shape)), requires_grad=False)


def build_skeleton(directory: Path, structure=None) -> nn.Module:
    """The model class of `directory`'s config, parameters on meta, normfold's structure replayed."""
    from ..io import transformers_module, apply_structure, model_class

    transformers = transformers_module()
    try:
        config = transformers.AutoConfig.from_pretrained(directory)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{directory}: config.json could not be read: {str(exc).splitlines()[0][:300]}") from exc
    cls = model_class(config)
    with _parameters_on_meta():
        model = cls(config)
        if structure is not None:
            apply_structure(model, structure)
    return model.eval()


# ---- loading units just before they run -------------------------------------------------------------------

@dataclass
class Ledger:
    """Bytes of weights materialized right now, and the most ever at once (the memory bound)."""

    live: int = 0
    peak: int = 0
    loads: int = 0

    def add(self, n: int) -> None:
        self.live += n
        self.loads += 1
        self.peak = max(self.peak, self.live)

    def sub(self, n: int) -> None:
        self.live -= n


class Streamer:
    """Loads the weights of one unit (a module) before its forward and drops them after it."""

    def __init__(self, model: nn.Module, reader: CheckpointReader, dtype: torch.dtype, ledger: Ledger) -> None:
        self.model, self.reader, self.dtype, self.ledger = model, reader, dtype, ledger
        # Tied weights appear once in a checkpoint: every name of a shared parameter is an alias.
        aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        self.slots: dict[str, tuple[nn.Module, str, tuple, list[str]]] = {}
        self.of_module: dict[int, list[str]] = {}
        for mname, module in model.named_modules():
            for pname, p in list(module._parameters.items()):
                if p is None:
                    continue
                full = f"{mname}.{pname}" if mname else pname
                names = [full] + [a for a in aliases.get(id(p), []) if a != full]
                self.slots[full] = (module, pname, tuple(p.shape), names)
                self.of_module.setdefault(id(module), []).append(full)
        self.pool = BufferPool()
        self.lookup_rows: dict[str, Tensor] = {}  # unit -> the token ids its next load is for (embeddings)
        self.reusable: set[int] = set()  # data pointers of loaded tensors filled whole (a pooled buffer can be refilled)
        buffers = {n for n, _ in model.named_buffers()}
        self.keymap = checkpoint_keys(model, list(reader.files), set(self.slots) | buffers)
        # Persistent buffers stored in the checkpoint (small: position ids, a head's row means, ...)
        # are read once and stay; the others keep the values computed when the model was built.
        for name in buffers:
            if name in self.keymap:
                module, _, leaf = name.rpartition(".")
                owner = model.get_submodule(module)
                t = reader.get(self.keymap[name])
                if tuple(t.shape) == tuple(owner._buffers[leaf].shape):
                    owner._buffers[leaf] = t
        self.set_dtype(dtype)

    def set_dtype(self, dtype: torch.dtype, pool_units: tuple | list = ()) -> None:
        """Every parameter becomes a placeholder of `dtype`; floating buffers are cast to it. Freed weights
        are kept for reuse up to the largest of `pool_units` in this dtype (see BufferPool; none by default)."""
        self.dtype = dtype
        self.pool.clear()
        self.reusable.clear()
        for module, pname, shape, _ in self.slots.values():
            p = module._parameters[pname]
            module._parameters[pname] = _placeholder(shape, dtype if p.is_floating_point() else p.dtype)
        for module in self.model.modules():
            for bname, b in list(module._buffers.items()):
                if b is not None and b.is_floating_point():
                    module._buffers[bname] = b.to(dtype)
        self.pool.budget = max((self.nbytes(u) for u in pool_units), default=0)

    def unit_slots(self, path: str) -> list[str]:
        """The parameters a unit needs: those of its subtree and of modules it references without
        registering them (normfold's tied compressed head reads its embedding table that way)."""
        if path in self.slots:  # a single parameter (held for a whole pass)
            return [path]
        seen: set[int] = set()
        todo = [self.model.get_submodule(path) if path else self.model]
        while todo:
            m = todo.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            todo.extend(m.children())
            todo.extend(v for k, v in vars(m).items() if isinstance(v, nn.Module) and k != "_modules")
        return [full for mid in seen for full in self.of_module.get(mid, [])]

    def nbytes(self, path: str) -> int:
        """Bytes the unit's parameters take in the current dtype."""
        size = torch.tensor([], dtype=self.dtype).element_size()
        return sum(math.prod(self.slots[f][2]) * size for f in self.unit_slots(path))

    def load(self, path: str) -> int:
        """Materialize the unit's parameters (in the current dtype); returns their bytes. A unit in
        `lookup_rows` is an embedding looked up at those token ids only: just those rows are read (the rest
        of the table is uninitialised memory that nothing reads, so it is never touched: no resident pages)."""
        with self.reader.session():
            return self._load(path, self.lookup_rows.pop(path, None))

    def _load(self, path: str, rows: Tensor | None = None) -> int:
        n = 0
        wanted = []
        for full in self.unit_slots(path):
            module, pname, shape, names = self.slots[full]
            key = next((self.keymap[x] for x in names if x in self.keymap), None)
            if key is None:
                raise CheckpointError(f"{self.reader.dir} has no tensor for parameter {full!r}; the weights do "
                                      "not match the config (and the recorded structure)")
            stored_shape, stored_dtype = self.reader.info(key)
            if stored_shape != shape:
                raise CheckpointError(f"{self.reader.dir}: tensor {key!r} has shape {stored_shape} but the "
                                      f"model built from config.json expects {shape}")
            dtype = self.dtype if stored_dtype.is_floating_point else stored_dtype
            wanted.append((full, key, shape, stored_dtype, dtype))
        # buffers freed by the previous unit of the same shapes (the next block) are refilled; anything else in
        # the pool is dropped before new memory is taken, so the pool never adds to a larger unit's peak
        bufs = [self.pool.take(shape, dtype) if rows is None else None for _, _, shape, _, dtype in wanted]
        if any(b is None for b in bufs) and self.pool.bytes:
            self.pool.clear()
            _return_freed_memory()
        for (full, key, shape, stored_dtype, dtype), buf in zip(wanted, bufs):
            module, pname = self.slots[full][:2]
            if buf is None:
                buf = torch.empty(shape, dtype=dtype)
            if rows is not None and len(shape) == 2:
                self.reader.get_rows(key, rows, dtype, buf)
            elif dtype != stored_dtype:
                self.reader.get_as(key, dtype, out=buf)
            else:
                self.reader.get(key, out=buf)
            if rows is None:
                self.reusable.add(buf.data_ptr())
            module._parameters[pname] = nn.Parameter(buf, requires_grad=False)
            n += buf.numel() * buf.element_size()
        self.ledger.add(n)
        return n

    def free(self, path: str, n: int) -> None:
        for full in self.unit_slots(path):
            module, pname, shape, _ = self.slots[full]
            p = module._parameters[pname]
            data = p.data
            module._parameters[pname] = _placeholder(shape, p.dtype)
            if data.data_ptr() in self.reusable:
                self.reusable.discard(data.data_ptr())
                self.pool.give(data)
        self.ledger.sub(n)
        if not self.pool.bytes:
            _return_freed_memory()


class BufferPool:
    """Freed weight tensors kept for the next unit of the same shapes (the blocks of a stack all have one
    block's shapes): refilled in place by pread instead of freshly allocated, so a streamed pass does not
    page-fault over every weight it reads. Holds at most `budget` bytes (one block in practice)."""

    def __init__(self, budget: int = 0) -> None:
        self.budget, self.bytes, self.free = budget, 0, {}

    def take(self, shape: tuple, dtype: torch.dtype) -> Tensor | None:
        got = self.free.get((tuple(shape), dtype))
        if not got:
            return None
        t = got.pop()
        self.bytes -= t.numel() * t.element_size()
        return t

    def give(self, t: Tensor) -> None:
        n = t.numel() * t.element_size()
        if t.is_contiguous() and self.bytes + n <= self.budget:
            self.free.setdefault((tuple(t.shape), t.dtype), []).append(t)
            self.bytes += n

    def clear(self) -> None:
        self.free, self.bytes = {}, 0


def _return_freed_memory() -> None:
    """glibc keeps freed weights below its mmap threshold (up to 32 MB each) in its heap, and the
    heap then grows pass after pass (measured: +0.4 GB per pass on a 774M-parameter GPT-2);
    malloc_trim hands them back to the system. A no-op where there is no glibc."""
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


def checkpoint_keys(model: nn.Module, keys: list[str], wanted: set[str]) -> dict[str, str]:
    """Model parameter name → checkpoint key, with transformers' own renamings (legacy names such as
    ViT's `encoder.layer.0.attention.attention.query` for `layers.0.attention.q_proj`, GPT-NeoX's
    `embed_out`) and base-model prefix handling: the names `from_pretrained` would load under."""
    out = {k: k for k in keys}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:  # transformers 4.x: checkpoint names are the module names (up to the prefix)
        get_model_conversion_mapping = None
    prefix = getattr(model, "base_model_prefix", "") or None
    if get_model_conversion_mapping is None:
        for k in keys:
            if prefix and k.startswith(prefix + ".") and k not in wanted:
                out.setdefault(k[len(prefix) + 1:], k)
            elif prefix and f"{prefix}.{k}" in wanted:
                out.setdefault(f"{prefix}.{k}", k)
        return out
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = {k: True for k in wanted}
    for k in keys:
        new, pattern = rename_source_key(k, renamings, converters, prefix, meta)
        if pattern is None and new != k:
            out.setdefault(new, k)
        # Keys merged or split by a converter (fused qkv, stacked experts) are not loadable one by one:
        # their parameter stays unresolved and `load` names it.
    return out


# ---- units: the blocks of each layer stack, and what lies outside them ---------------------------------------

def _is_stack(m: nn.Module) -> bool:
    kids = list(m.children())
    return (isinstance(m, nn.ModuleList) and len(kids) >= 1 and len({type(k) for k in kids}) == 1
            and all(any(True for _ in k.children()) and any(True for _ in k.parameters()) for k in kids))


def find_units(model: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """(blocks, others, resident): blocks are the children of every layer stack (ModuleList of one
    block type); others are the largest subtrees outside the stacks that own parameters (embeddings,
    norms, heads); resident are modules owning parameters directly while also containing a stack
    (loaded for the whole pass; small in practice, e.g. a logit scale). A model without a stack is
    one unit: verified correctly, but with no memory saving."""
    blocks, others, resident = [], [], []

    def has_stack(m):
        return any(_is_stack(x) for x in m.modules())

    def visit(m: nn.Module, path: str) -> None:
        if _is_stack(m):
            blocks.extend(f"{path}.{k}" if path else k for k, _ in m.named_children())
            return
        if not has_stack(m):
            if any(True for _ in m.parameters()):
                others.append(path)
            return
        if any(p is not None for p in m._parameters.values()):
            resident.append(path)
        for k, child in m.named_children():
            visit(child, f"{path}.{k}" if path else k)

    visit(model, "")
    return blocks, others, resident


# ---- block outputs and stream mapping -----------------------------------------------------------------------

def _stream_in(args, kwargs) -> Tensor | None:
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


def to_stream(h: Tensor, like: Tensor, center: bool) -> Tensor:
    """The original's stream `h` (float64) as the model whose own stream at that point is `like`
    carries it, in `like`'s dtype. A converted model computes the original's stream up to a
    per-token shift (zero for the recentred Pre-RMSNorm stream; the original's own mean where a
    non-shift-invariant block reads the stream raw, as a Post-LN block 0 does): its centred part is
    the original's, its per-token mean the converted model's own. A Pre-CRMSNorm stream is the first
    d−1 coordinates of the centred stream (or those and a zero, padded to d)."""
    h = h.double()
    if not center:
        return h.to(like.dtype)
    if like.shape[-1] + 1 == h.shape[-1]:
        return center_last(h)[..., :-1].to(like.dtype)
    if like.shape == h.shape and h.shape[-1] > 1 and is_zero_last(like) and not is_zero_last(h):
        c = center_last(h)
        return torch.cat([c[..., :-1], torch.zeros_like(c[..., -1:])], dim=-1).to(like.dtype)
    return (center_last(h) + like.double().mean(dim=-1, keepdim=True)).to(like.dtype)


def _block_diff(name: str, test, ref) -> TensorDiff:
    t, r = _stream_out(test), _stream_out(ref)
    if t is None or r is None:
        return TensorDiff(name, float("inf"), float("inf"), 0.0)
    t, r = stream_view(t.double(), r.double())
    return TensorDiff.of(name, center_last(t), center_last(r))


# ---- one streamed pass --------------------------------------------------------------------------------------

@dataclass
class _Capture:
    args: tuple
    kwargs: dict
    out: object = None


class _Pass:
    """Hooks for one forward of a skeleton: load/free per unit; capture or force per block."""

    def __init__(self, streamer: Streamer, blocks, others, resident, *, capture=False, forced=None,
                 replace=None, replace_like=None, map_center=False) -> None:
        self.s = streamer
        self.blocks, self.others, self.resident = blocks, others, resident
        self.capture = capture  # record every block call's stream input / output (float64 reference)
        self.forced = forced  # {block: [_Capture]} of the reference: also run each block on those inputs
        self.replace = replace  # {block: [_Capture]}: skip blocks, return the reference outputs instead
        self.replace_like = replace_like  # {block: [stream output of this model's own run]} (its means)
        self.map_center = map_center
        self.captured: dict[str, list[_Capture]] = {b: [] for b in blocks}
        self.forced_out: dict[str, list[tuple]] = {b: [] for b in blocks}  # (reference call, output)
        self.free_in: dict[str, list[Tensor]] = {b: [] for b in blocks}
        self.free_out: dict[str, list[Tensor]] = {b: [] for b in blocks}  # stream outputs (tail pass)
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
            self._hook(model.get_submodule(path), path, block=False)
        for path in self.blocks:
            block = model.get_submodule(path)
            if self.replace is not None:
                calls = iter(self.replace[path])
                block.forward = _replaced_forward(calls, iter(self.replace_like[path]), self.map_center)
                continue
            self._hook(block, path, block=True)
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        for path in self.blocks:
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
        x = _stream_in(args, kwargs)
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
            a, kw = _with_stream(args, kwargs, to_stream(_stream_in(ref.args, ref.kwargs), x, self.map_center))
            self._inner = True
            try:
                with _only_normfold_hooks(mod):
                    out = mod(*a, **kw)
            finally:
                self._inner = False
            self.forced_out[path].append((ref, _detach(out)))


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


def _replaced_forward(calls, likes, center: bool):
    """A block's forward that returns the reference's output for this call, mapped to the stream
    the block receives (so everything after the blocks runs on the original's hidden states)."""
    def forward(*args, **kwargs):
        ref, like = next(calls), next(likes)
        return _replace_stream_out(_clone_struct(ref.out), to_stream(_stream_out(ref.out), like, center))

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


def _block_names(d: dict[str, list]) -> list[tuple[str, int]]:
    return [(b, k) for b, calls in d.items() for k in range(len(calls))]


def _name(block: str, k: int, n: int) -> str:
    return block if n == 1 else f"{block} (call {k})"


# ---- the check ----------------------------------------------------------------------------------------------

def verify_blockwise(original_dir: str | os.PathLike, converted_dir: str | os.PathLike, *, inputs: dict | None = None,
                     seed: int = 0, centered=None, progress: Callable[[str], None] | None = None,
                     fp64_tol: float | None = None) -> dict:
    """`normfold verify ORIGINAL CONVERTED`'s checks in bounded memory; returns the same dict as
    `verify.compare_models(...).to_dict()` plus per-block results (see the module docstring).

    `original_dir` / `converted_dir`: local model directories with safetensors weights (one file or
    an index); the converted one may carry `normfold.json`, whose structure is replayed. `inputs`:
    forward kwargs (default: the adapter's example inputs for `seed`). `progress(message)` is called
    as each pass starts. `fp64_tol` defaults to compare_models' (`verify.stored_weights_tolerance` of
    the stored dtype)."""
    from ..io import REPORT_FILE, inspect_converted

    original_dir, converted_dir = Path(original_dir), Path(converted_dir)
    for d in (original_dir, converted_dir):
        if not d.is_dir() or not (d / "config.json").is_file():
            raise CheckpointError(f"{d} is not a local model directory with config.json: block-wise verification "
                                  "reads local safetensors checkpoints. Download the model to a directory first, "
                                  "or verify in memory (`normfold verify --no-blockwise`).")
    # a normfold checkpoint: path policy, report schema, and its structure against config.json and the
    # weights' headers, all before anything is built (as normfold.load checks it)
    report = inspect_converted(converted_dir)[0] if os.path.lexists(converted_dir / REPORT_FILE) else None
    if centered is None:
        centered = tuple(report.centered_outputs) if report is not None and report.centered_outputs else CENTERED_OUTPUTS
    say = progress or (lambda _msg: None)

    o_read, c_read = CheckpointReader(original_dir), CheckpointReader(converted_dir)
    orig = build_skeleton(original_dir)
    conv = build_skeleton(converted_dir, report.structure if report is not None else None)
    if type(orig).__name__ != type(conv).__name__:
        raise NormfoldError(f"ORIGINAL is a {type(orig).__name__} but CONVERTED is a {type(conv).__name__}")
    o_dtype, c_dtype = o_read.dtype(), c_read.dtype()
    ledger = Ledger()
    o_s, c_s = Streamer(orig, o_read, o_dtype, ledger), Streamer(conv, c_read, c_dtype, ledger)
    if inputs is None:
        inputs = _example_inputs(orig, seed)
    o_units, c_units = find_units(orig), find_units(conv)
    blocks = o_units[0]
    if c_units[0] != blocks:
        raise CheckpointError(f"{converted_dir} has block stacks {c_units[0][:3]}... but {original_dir} has "
                              f"{blocks[:3]}...: not a conversion of it")
    tol = fp64_tol if fp64_tol is not None else stored_weights_tolerance(c_dtype)

    def run(streamer, units, dtype, **kw):
        streamer.set_dtype(dtype, pool_units=units[0])
        with _Pass(streamer, *units, **kw) as p:
            out = run_model(streamer.model, inputs)
        return p, out

    say("original in float64")
    p_o64, exact = run(o_s, o_units, FP64, capture=True)
    bad = [k for k, v in exact.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise NormfoldError(
            f"{original_dir}: the original model's outputs {bad[:3]} are not finite in float64 when run block "
            "by block. Either its weights hold NaN/Inf, or its code reads a weight outside the module that "
            "owns it (weights are loaded per module, and an unloaded weight reads as NaN). Check the "
            "weights, or verify in memory: `normfold verify ORIGINAL CONVERTED --no-blockwise`.")
    ref = p_o64.captured
    say("converted in float64, block by block on the original's hidden states")
    p_c64, out_c64 = run(c_s, c_units, FP64, forced=ref, map_center=True)
    say("converted in float64, heads on the original's last hidden states")
    _, out_tail = run(c_s, c_units, FP64, replace=ref, replace_like=p_c64.free_out, map_center=True)
    say(f"original in {_dt(o_dtype)}")
    p_ow, orig_w = run(o_s, o_units, o_dtype, forced=ref, map_center=False)
    say(f"converted in {_dt(c_dtype)}")
    p_cw, conv_w = run(c_s, c_units, c_dtype, forced=ref, map_center=True)

    fp64, failed = _fp64_section(ref, p_c64, out_c64, out_tail, exact, blocks, tol, centered)
    floor = tol if c_dtype == FP64 else ULP_FLOOR * dtype_eps(c_dtype)
    base = {d.name: d for d in diff_outputs(orig_w, exact, (), centered)}
    rows, working_ok = [], True
    for d in diff_outputs(conv_w, exact, (), centered):
        b_rel = base[d.name].max_rel if d.name in base else 0.0
        ok = d.max_rel <= WORKING_FACTOR * b_rel + floor
        working_ok &= ok
        rows.append({"name": d.name, "converted_rel_error": d.max_rel, "original_rel_error": b_rel, "ok": ok})
    wblocks = _working_blocks(ref, p_ow, p_cw, floor)
    direct = diff_outputs(conv_w, orig_w, (), centered)
    worst_direct = worst_of(direct)
    sizes = {"original": _sizes(o_s, o_units), "converted": _sizes(c_s, c_units)}
    return {
        "passed": bool(working_ok and fp64["passed"]),
        "dtype": _dt(c_dtype),
        "max_abs_error": worst_direct["max_abs_error"], "max_rel_error": worst_direct["max_rel_error"],
        "top1_agreement": top1_agreement(conv_w, orig_w),
        "fp64": fp64,
        "working": {"passed": working_ok, "rule": f"err(converted) <= {WORKING_FACTOR:g} * err(original) + "
                    f"{ULP_FLOOR:g} ulp, errors against the original in float64", "outputs": rows,
                    "blocks": wblocks},
        "baseline": {**worst_of(list(base.values())), "what": "original in its dtype vs itself in float64"},
        "inputs": describe_inputs(inputs),
        "blockwise": {"blocks": len(blocks), "failed_blocks": failed,
                      "peak_weight_bytes": ledger.peak, "loads": ledger.loads,
                      "original_dtype": _dt(o_dtype), **sizes},
    }


def _fp64_section(ref, p_c64, out_c64, out_tail, exact, blocks, tol, centered) -> tuple[dict, list[str]]:
    """float64: end to end, per block (on the original's inputs), the stream entering each stack
    (embeddings) and the outputs computed from the original's last hidden states (heads)."""
    d64 = diff_outputs(out_c64, exact, (), centered)
    block_rows, failed = [], []
    for b, k in _block_names(p_c64.forced_out):
        r, out = p_c64.forced_out[b][k]
        name = _name(b, k, len(ref[b]))
        d = _block_diff(name, out, r.out) if r is not None else TensorDiff(name, math.inf, math.inf, 0.0)
        block_rows.append({**asdict(d), "passed": d.max_rel <= tol})
        if d.max_rel > tol:
            failed.append(name)
    # a block the converted model did not call as often as the original did
    failed += [b for b in blocks if len(p_c64.forced_out[b]) < len(ref[b]) and b not in failed]
    emb_rows = []
    for b in _stack_heads(blocks):
        if ref[b] and p_c64.free_in[b]:
            d = _block_diff(f"stream into {b}", p_c64.free_in[b][0], _stream_in(ref[b][0].args, ref[b][0].kwargs))
            emb_rows.append({**asdict(d), "passed": d.max_rel <= tol})
    head_rows = [{**asdict(d), "passed": d.max_rel <= tol}
                 for d in diff_outputs(out_tail, exact, (), centered) if "hidden_states" not in d.name]
    worst = worst_of(d64)
    ok = worst["max_rel_error"] <= tol and not failed and all(r["passed"] for r in emb_rows + head_rows)
    return ({**worst, "tolerance": tol, "passed": ok, "outputs": [asdict(d) for d in d64],
             "blocks": block_rows, "embeddings": emb_rows, "heads": head_rows}, failed)


def _working_blocks(ref, p_ow, p_cw, floor) -> list[dict]:
    """Per block in the working dtype, both models on the float64 reference inputs (informative)."""
    rows = []
    for b, k in _block_names(p_cw.forced_out):
        r, out = p_cw.forced_out[b][k]
        o_calls = p_ow.forced_out.get(b, [])
        if r is None or k >= len(o_calls) or o_calls[k][0] is None:
            continue
        name = _name(b, k, len(ref[b]))
        c_rel = _block_diff(name, out, r.out).max_rel
        o_rel = _block_diff(name, o_calls[k][1], r.out).max_rel
        rows.append({"name": name, "converted_rel_error": c_rel, "original_rel_error": o_rel,
                     "ok": c_rel <= WORKING_FACTOR * o_rel + floor})
    return rows


def _sizes(streamer: Streamer, units) -> dict:
    streamer.set_dtype(FP64)
    per = [streamer.nbytes(u) for u in units[0] + units[1]]
    return {"largest_unit_bytes_fp64": max(per, default=0), "total_bytes_fp64": streamer.nbytes("")}


def _stack_heads(blocks: list[str]) -> list[str]:
    """The first block of each stack ('h.0', 'encoder.layers.0', 'decoder.layers.0')."""
    seen, out = set(), []
    for b in blocks:
        stack = b.rpartition(".")[0]
        if stack not in seen:
            seen.add(stack)
            out.append(b)
    return out


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _example_inputs(model: nn.Module, seed: int) -> dict:
    from ..adapters import find_adapter
    from ..adapters.base import default_inputs
    from ..errors import UnsupportedModelError

    gen = torch.Generator().manual_seed(seed)
    try:
        return find_adapter(model).example_inputs(model, gen)
    except UnsupportedModelError:
        return default_inputs(model, gen)
