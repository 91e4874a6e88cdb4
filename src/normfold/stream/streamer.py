"""Loading one unit's weights just before its forward and dropping them right after it (block-wise
verification): placeholders that hold no memory otherwise, freed block buffers refilled in place."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..compress.runtime import TiedCompressedHead
from ..errors import CheckpointError, NormfoldError
from ..nn import TiedHead
from .memory import BufferPool, Ledger, return_freed_memory
from .reader import CheckpointReader
from .readahead import ReadAhead
from .skeleton import checkpoint_keys, placeholder



class Streamer:
    """Loads the weights of one unit (a module) before its forward and drops them after it."""

    def __init__(self, model: nn.Module, reader: CheckpointReader, dtype: torch.dtype, ledger: Ledger,
                 readahead: bool = False) -> None:
        """`readahead`: while a block computes, the next block of its stack (`next_unit`, set by the pass) is read
        on a background thread (stream/readahead.py); the same bytes, so the same results."""
        self.model, self.reader, self.dtype, self.ledger = model, reader, dtype, ledger
        self.ahead = ReadAhead(reader) if readahead else None
        self.next_unit: dict[str, str] = {}  # block -> the block loaded after it (read ahead while it computes)
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
        self.skip: dict[str, str] = {}  # unit -> a parameter its next load leaves out (a head run in row chunks)
        self.reusable: set[int] = set()  # data pointers of loaded tensors filled whole (a pooled buffer can be refilled)
        self.on_free = None  # called with the elements of each unit done with (a pass's progress)
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
        self.end_read_ahead()
        self.pool.clear()
        self.reusable.clear()
        for module, pname, shape, _ in self.slots.values():
            p = module._parameters[pname]
            module._parameters[pname] = placeholder(shape, dtype if p.is_floating_point() else p.dtype)
        for module in self.model.modules():
            for bname, b in list(module._buffers.items()):
                if b is not None and b.is_floating_point():
                    module._buffers[bname] = b.to(dtype)
        self.pool.budget = max((self.nbytes(u) for u in pool_units), default=0)
        if self.ahead is not None:  # one unit's stored tensors, read ahead
            self.ahead.pool.budget = max((self.stored_nbytes(u) for u in pool_units), default=0)

    def end_read_ahead(self) -> None:
        """End of a pass (also on an error): no read in flight, no thread, no read-ahead buffers kept."""
        self.next_unit = {}
        if self.ahead is not None:
            self.ahead.close()

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

    def elements(self, path: str) -> int:
        """Elements of the unit's parameters (whatever their dtype)."""
        return sum(math.prod(self.slots[f][2]) for f in self.unit_slots(path))

    def nbytes(self, path: str) -> int:
        """Bytes the unit's parameters take in the current dtype."""
        size = torch.tensor([], dtype=self.dtype).element_size()
        return sum(math.prod(self.slots[f][2]) * size for f in self.unit_slots(path))

    def stored_nbytes(self, path: str) -> int:
        """Bytes the unit's parameters take as stored in the checkpoint."""
        n = 0
        for full in self.unit_slots(path):
            key = next((self.keymap[x] for x in self.slots[full][3] if x in self.keymap), None)
            try:
                shape, dtype = self.reader.info(key) if key is not None else ((), None)
            except NormfoldError:  # a dtype normfold does not read: the unit's own load says so, in its turn
                continue
            if dtype is not None:
                n += math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        return n

    def load(self, path: str) -> int:
        """Materialize the unit's parameters (in the current dtype); returns their bytes. A unit in
        `lookup_rows` is an embedding looked up at those token ids only: just those rows are read (the rest
        of the table is uninitialised memory that nothing reads, so it is never touched: no resident pages)."""
        with self.reader.session():
            return self._load(path, self.lookup_rows.pop(path, None), self.skip.pop(path, None))

    def _wanted(self, path: str, skip: str | None = None) -> list[tuple]:
        """(slot, checkpoint key, shape, stored dtype, dtype loaded) of the unit's parameters, checked against
        the checkpoint's headers."""
        wanted = []
        for full in self.unit_slots(path):
            if full == skip:
                continue
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
        return wanted

    def _load(self, path: str, rows: Tensor | None = None, skip: str | None = None) -> int:
        n = 0
        wanted = self._wanted(path, skip)
        # read ahead while the previous block computed (the same bytes): in the stored dtype they are the
        # parameters; cast, they are copied into this pass's pooled buffers and handed back for the next read
        ahead = self.ahead.take(path) if self.ahead is not None else None
        if ahead is not None and (rows is not None or skip is not None):  # not a whole unit: read as usual
            for t in ahead.values():
                self.ahead.pool.give(t)
            ahead = None
        # buffers freed by the previous unit of the same shapes (the next block) are refilled; anything else in
        # the pool is dropped before new memory is taken, so the pool never adds to a larger unit's peak
        bufs = [self.pool.take(shape, dtype) if rows is None and (ahead is None or dtype != stored) else None
                for _, _, shape, stored, dtype in wanted]
        if ahead is not None:
            for i, (full, _, shape, stored, dtype) in enumerate(wanted):
                raw = ahead[full]
                if dtype == stored:
                    bufs[i] = raw
                    continue
                if bufs[i] is None:
                    bufs[i] = torch.empty(shape, dtype=dtype)
                bufs[i].copy_(raw)
                self.ahead.pool.give(raw)
        if rows is None and skip is None:
            self._read_ahead(path)  # the next block, beside this one's compute (takes from the pool first)
        if self.pool.bytes:  # what this unit did not take (the stack ended): handed back
            self.pool.clear()
            return_freed_memory()
        for (full, key, shape, stored_dtype, dtype), buf in zip(wanted, bufs):
            module, pname = self.slots[full][:2]
            if buf is None:
                buf = torch.empty(shape, dtype=dtype)
            if ahead is None:  # (else filled above)
                if rows is not None and len(shape) == 2:
                    self.reader.get_rows(key, rows, dtype, buf)
                    n += len(rows) * buf[0].numel() * buf.element_size()  # the rest is never touched
                    module._parameters[pname] = nn.Parameter(buf, requires_grad=False)
                    continue
                if dtype != stored_dtype:
                    self.reader.get_as(key, dtype, out=buf)
                else:
                    self.reader.get(key, out=buf)
            self.reusable.add(buf.data_ptr())
            module._parameters[pname] = nn.Parameter(buf, requires_grad=False)
            n += buf.numel() * buf.element_size()
        self.ledger.add(n)
        return n

    def _read_ahead(self, path: str) -> None:
        """Start reading the unit loaded after `path` (its next block), if any, on the read-ahead thread."""
        nxt = self.next_unit.get(path) if self.ahead is not None else None
        if nxt is None:
            return
        try:
            wanted = self._wanted(nxt)
        except NormfoldError:
            return  # its own load raises this, in its turn
        self.ahead.start(nxt, [(full, key, shape, stored) for full, key, shape, stored, _ in wanted], self.pool.take)

    def row_chunked(self, path: str, module: nn.Module) -> str | None:
        """The weight slot of a head to run in row chunks, or None. A plain nn.Linear, nn.TiedHead or
        Pre-CRMSNorm TiedCompressedHead (its d−1 table) whose matrix, in this pass's dtype, is larger than the
        pool's budget (the largest block): a float64 pass over a float32 or 16-bit checkpoint would otherwise hold
        the whole table in float64 (the vocabulary × width embedding of a tied head: 0.64 GB at GPT-2-XL's
        shapes), and a pass in the stored dtype the whole stored table (0.32 GB there: it set the verification's
        peak, 109 MiB above the float64 passes', and faulted in fresh pages twice per run). Each output (row) of
        these heads reads only its own row of the matrix and of the per-row `bias` / `mean`."""
        if type(module) not in (nn.Linear, TiedHead, TiedCompressedHead) or "forward" in vars(module):
            return None
        weight = module.weight  # a TiedHead's is its table's (a placeholder now): find the slot holding it
        slot = next((f for f in self.unit_slots(path) if self.slots[f][0]._parameters[self.slots[f][1]] is weight),
                    None)
        if slot is None or len(self.slots[slot][2]) != 2:
            return None
        key = next((self.keymap[x] for x in self.slots[slot][3] if x in self.keymap), None)
        if key is None:
            return None  # the load names the missing tensor
        shape, stored = self.reader.info(key)
        size = torch.tensor([], dtype=self.dtype).element_size()
        if not stored.is_floating_point or math.prod(shape) * size <= self.pool.budget:
            return None
        return slot

    def run_rows(self, path: str, slot: str, forward, args, kwargs, chunk_bytes: int = 1 << 24) -> Tensor:
        """The head's forward over chunks of its matrix's rows (its outputs): each chunk read and cast into
        one reused buffer, the per-output parameters (`bias`, a tied head's `mean`) sliced alike, and the
        output columns gathered. Each output column is its own dot product, so the values are the whole
        matrix's up to the summation blocking of the matrix product."""
        module, pname, shape, names = self.slots[slot]
        key = next(self.keymap[x] for x in names if x in self.keymap)
        rows = shape[0]
        size = torch.tensor([], dtype=self.dtype).element_size()
        step = max(2, chunk_bytes // max(1, math.prod(shape[1:]) * size))
        per_row = [f for f in self.unit_slots(path) if f != slot and self.slots[f][1] in ("bias", "mean")
                   and self.slots[f][2][:1] == (rows,)]
        saved = {f: self.slots[f][0]._parameters[self.slots[f][1]] for f in per_row}
        buf = torch.empty((min(step, rows), *shape[1:]), dtype=self.dtype)
        nbytes = buf.numel() * size
        self.ledger.add(nbytes)
        chunks = []
        for a in range(0, rows, step):
            b = min(rows, a + step)
            if b == rows - 1 and b > a + 1:  # no one-row last chunk
                b = rows
            chunks.append((a, b))
            if b == rows:
                break
        # read-ahead: chunk j + 1 read (stored dtype) on the read-ahead thread while chunk j computes, two
        # chunk buffers in turn; cast into `buf` here, or used as they are in a pass in the stored dtype
        stored = self.reader.info(key)[1]
        ahead = self.ahead.reader_for_rows(key, stored, chunks, shape) if self.ahead is not None else None
        out = None
        try:
            for j, (a, b) in enumerate(chunks):
                if ahead is None:
                    w = self.reader.get_as(key, self.dtype, out=buf[:b - a] if b - a <= buf.shape[0] else None,
                                           rows=(a, b))
                else:
                    w = ahead.get(j)
                    if stored != self.dtype:
                        w = (buf[:b - a] if b - a <= buf.shape[0] else torch.empty_like(w, dtype=self.dtype)).copy_(w)
                module._parameters[pname] = nn.Parameter(w, requires_grad=False)
                for f in per_row:
                    m, pn = self.slots[f][:2]
                    m._parameters[pn] = nn.Parameter(saved[f][a:b], requires_grad=False)
                y = forward(*args, **kwargs)
                if out is None:
                    out = y.new_empty(*y.shape[:-1], rows)
                out[..., a:b] = y
        finally:
            if ahead is not None:
                ahead.close()
            for f, p in saved.items():
                m, pn = self.slots[f][:2]
                m._parameters[pn] = p
            module._parameters[pname] = placeholder(shape, self.dtype)
            self.ledger.sub(nbytes)
        return out

    def free(self, path: str, n: int) -> None:
        for full in self.unit_slots(path):
            module, pname, shape, _ = self.slots[full]
            p = module._parameters[pname]
            data = p.data
            module._parameters[pname] = placeholder(shape, p.dtype)
            if data.data_ptr() in self.reusable:
                self.reusable.discard(data.data_ptr())
                self.pool.give(data)
        self.ledger.sub(n)
        if not self.pool.bytes:
            return_freed_memory()
        if self.on_free is not None:
            self.on_free(self.elements(path))
