"""Loading one unit's weights just before its forward and dropping them right after it (block-wise
verification): placeholders that hold no memory otherwise, freed block buffers refilled in place."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import CheckpointError
from .memory import BufferPool, Ledger, return_freed_memory
from .reader import CheckpointReader
from .skeleton import checkpoint_keys, placeholder



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
            module._parameters[pname] = placeholder(shape, dtype if p.is_floating_point() else p.dtype)
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
            return_freed_memory()
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
            module._parameters[pname] = placeholder(shape, p.dtype)
            if data.data_ptr() in self.reusable:
                self.reusable.discard(data.data_ptr())
                self.pool.give(data)
        self.ledger.sub(n)
        if not self.pool.bytes:
            return_freed_memory()
