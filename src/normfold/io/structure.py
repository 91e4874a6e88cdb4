"""Replaying a report's recorded `structure` on a stock model: validated first against the model's own module
tree (no getattr chains), then the norms swapped, Recenter hooks, added biases, tied heads, rotations and
the parts a target registers (`register_structure_part`: Pre-CRMSNorm's d−1 runtime)."""

from __future__ import annotations

from typing import Callable

import math

import torch
from torch import nn

from ..adapters.base import get, parent_and_leaf  # noqa: F401
from ..errors import CheckpointError, ReportSchemaError, first_line
from ..nn import norm_type
from ..nn.hooks import add_input_recenter, add_output_recenter
from ..report import Structure


def _norm_width(module: nn.Module) -> int | None:
    """The normalized width of a norm module (LayerNorm-like: `normalized_shape`, else a 1-D weight)."""
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, int):
        return shape
    if isinstance(shape, (tuple, list)) and shape and all(isinstance(d, int) for d in shape):
        return shape[-1]
    w = module._parameters.get("weight") if isinstance(module, nn.Module) else None
    return int(w.shape[-1]) if w is not None and w.dim() == 1 else None


def validate_structure(model: nn.Module, structure: Structure) -> None:
    """Check a report's structure against the model that config.json builds (on any device, meta included),
    before anything is changed: every path names a module / parameter of the model (through
    `named_modules()` / `named_parameters()`), each recorded norm is a norm of the recorded width, recorded
    shapes and dims fit the parameters. `ReportSchemaError` otherwise."""
    from ..adapters.base import submodule

    modules = dict(model.named_modules(remove_duplicate=False))
    params = dict(model.named_parameters(remove_duplicate=False))
    arch = type(model).__name__

    def module(path: str, where: str) -> nn.Module:
        if path not in modules or not path:
            raise ReportSchemaError(f"normfold.json: {where} names {path[:120]!r}, which is not a module of the "
                                    f"{arch} that config.json builds; the report does not belong to this model")
        return submodule(model, path)

    def param(path: str, where: str) -> torch.Tensor:
        if path not in params:
            raise ReportSchemaError(f"normfold.json: {where} names {path[:120]!r}, which is not a parameter of the "
                                    f"{arch} that config.json builds; the report does not belong to this model")
        return params[path]

    seen = set()
    for i, rec in enumerate(structure.norms):
        where = f"structure.norms[{i}]"
        m = module(rec.name, f"{where}.name")
        if rec.name in seen:
            raise ReportSchemaError(f"normfold.json: {where} records {rec.name!r} a second time")
        seen.add(rec.name)
        width = _norm_width(m)
        if width is None:
            raise ReportSchemaError(f"normfold.json: {where} records {rec.name!r} as a norm, but in {arch} it is a "
                                    f"{type(m).__name__}, not a norm")
        if not (math.isfinite(rec.eps) and 0 <= rec.eps < 1):
            raise ReportSchemaError(f"normfold.json: {where}.eps is {rec.eps}; a norm's eps lies in [0, 1)")
        if "width" in rec.options and rec.options["width"] != width:
            raise ReportSchemaError(f"normfold.json: {where}.options.width is {rec.options['width']}, but "
                                    f"{rec.name} of the {arch} that config.json builds is {width} wide")
        for j, path in enumerate(rec.folded_into):
            module(path, f"{where}.folded_into[{j}]")
    for key in ("recenter_after", "recenter_before", "added_bias"):
        for j, path in enumerate(getattr(structure, key)):
            m = module(path, f"structure.{key}[{j}]")
            if key == "added_bias":
                w = m._parameters.get("weight")
                if w is None or w.dim() != 2:
                    raise ReportSchemaError(f"normfold.json: structure.added_bias[{j}] names {path!r}, a "
                                            f"{type(m).__name__} without a matrix weight to add a bias beside")
    state_keys = set(model.state_dict(keep_vars=True))
    for j, name in enumerate(structure.untied):
        if name not in params and name not in state_keys:
            param(name, f"structure.untied[{j}]")
    comp = structure.compression or {}
    for name, shape in comp.get("shapes", {}).items():
        p = param(name, "structure.compression.shapes")
        if len(shape) != p.dim() or any(d not in (o, o - 1) or d < 0 for d, o in zip(shape, p.shape)):
            raise ReportSchemaError(f"normfold.json: structure.compression.shapes gives {name} shape {shape[:8]}, "
                                    f"which does not fit its shape {list(p.shape)} from config.json (each "
                                    "dimension stays or loses one coordinate)")
    for key in ("compress_after", "compress_before", "widen_after", "narrow_before"):
        for j, path in enumerate(comp.get(key, [])):
            module(path, f"structure.compression.{key}[{j}]")
    for key in ("writer_params", "reader_params"):
        for name, dim in comp.get(key, {}).items():
            p = param(name, f"structure.compression.{key}")
            if not -p.dim() <= dim < p.dim():
                raise ReportSchemaError(f"normfold.json: structure.compression.{key} gives {name} the axis {dim}; "
                                        f"it has {p.dim()}")
    for j, tie in enumerate(comp.get("tied_heads", [])):
        module(tie["head"], f"structure.compression.tied_heads[{j}].head")
        table = module(tie["table"], f"structure.compression.tied_heads[{j}].table")
        w = table._parameters.get("weight")
        if w is None or w.dim() != 2:
            raise ReportSchemaError(f"normfold.json: structure.compression.tied_heads[{j}].table names "
                                    f"{tie['table']!r}, which has no table (a matrix weight)")


# Parts of a recorded `Structure` that a higher layer knows how to rebuild (a target's own modules and
# hooks): field name -> apply(model, part). `normfold.compress` registers "compression"; io imports none
# of them, so the layers stay one-way.
STRUCTURE_PARTS: dict[str, Callable[[nn.Module, object], None]] = {}


def register_structure_part(field_name: str, apply: Callable[[nn.Module, object], None]) -> None:
    """Make `apply_structure` (and so `normfold.load`) call `apply(model, structure.<field_name>)` when that
    part of the recorded structure is non-empty."""
    STRUCTURE_PARTS[field_name] = apply


def apply_structure(model: nn.Module, structure: Structure, *, real_rotations: bool = False) -> nn.Module:
    """Rebuild normfold's modules on a stock model: swap the recorded norms (taking their values from
    the loaded LayerNorms), re-attach Recenter ops and create added biases.

    The structure is validated first (`validate_structure`: paths through the module tree only, widths);
    nothing is changed when it does not fit the model. `real_rotations`: the explicit rotations' Q are
    built for real, in float64, even when the model's parameters are on the meta device (block-wise
    verification's skeletons: parameters loaded per unit, buffers real, cast to each pass's dtype)."""
    from ..adapters.base import submodule

    validate_structure(model, structure)
    try:
        for rec in structure.norms:
            ln = submodule(model, rec.name)
            cls = norm_type(rec.type)
            new = cls.from_layernorm(ln, keep_weight=rec.weight, keep_bias=rec.bias, **rec.options)
            head, _, leaf = rec.name.rpartition(".")
            setattr(submodule(model, head), leaf, new)
        for path in structure.recenter_after:
            add_output_recenter(submodule(model, path))
        for path in structure.recenter_before:
            add_input_recenter(submodule(model, path))
        for path in structure.added_bias:
            module = submodule(model, path)
            if getattr(module, "bias", None) is None:
                out_features = module.weight.shape[0]
                module.bias = nn.Parameter(torch.zeros(out_features, dtype=module.weight.dtype,
                                                       device=module.weight.device))
        apply_tied_heads(model, structure.tied_heads)
        if structure.rotation:
            _apply_rotation_hooks(model, structure.rotation, real_rotations)
        for path in structure.rotation.get("online", []) if structure.rotation else []:  # online Hadamard inputs
            from ..algebra import layout_of
            from ..nn.online import add_input_hadamard

            module = dict(model.named_modules()).get(str(path))
            if module is None:
                raise CheckpointError(f"normfold.json: online rotation at {path!r}, which is not a module of this model")
            lay = layout_of(module)
            if lay is None or lay.in_dim is None:
                raise CheckpointError(f"normfold.json: online rotation at {path}, which is not a linear module")
            try:
                add_input_hadamard(module, int(getattr(module, lay.weight).shape[lay.in_dim]))
            except ValueError as exc:
                raise CheckpointError(f"normfold.json: online rotation at {path}: {exc}") from None
        if structure.rotation and structure.rotation.get("query_key", {}).get("online"):
            _apply_qk_rotation(model, structure.rotation["query_key"])
        for field_name, apply_part in STRUCTURE_PARTS.items():  # e.g. Pre-CRMSNorm's resized writers/readers
            part = getattr(structure, field_name, None)
            if part:
                apply_part(model, part)
    except (ValueError, TypeError, KeyError, LookupError) as exc:  # e.g. an option value the module refuses
        raise ReportSchemaError(f"normfold.json: its structure cannot be rebuilt on {type(model).__name__}: "
                                f"{first_line(exc)}") from None
    return model


def _apply_rotation_hooks(model: nn.Module, rotation: dict, real: bool = False) -> None:
    """The explicit stream rotations of a rotated checkpoint (normfold.rotate), Q rebuilt from kind + seed (in
    the parameters' dtype; `real`: float64, also on a meta model)."""
    from ..algebra import rotation_matrix
    from ..nn.online import add_input_rotation, add_output_rotation

    modules = dict(model.named_modules())
    widths = {int(getattr(m, "normalized_shape", (0,))[-1]) for m in modules.values() if hasattr(m, "normalized_shape")}
    explicit = rotation.get("explicit", [])
    if not isinstance(explicit, list):
        raise CheckpointError("normfold.json: structure.rotation.explicit must be a list")
    for e in explicit:
        try:
            if not isinstance(e, dict) or set(e) - {"path", "where", "width", "transpose"}:
                raise ValueError("unknown or missing fields")
            width = int(e["width"])
            if width not in widths:  # also bounds the d×d matrix built below
                raise ValueError(f"width {width} is not the width of any norm of this model")
            module = modules[str(e["path"])]
            ref = next(iter(model.parameters()), None)
            if ref is not None and ref.is_meta and not real:  # checking a report against the config's meta
                # model: shapes only
                q = torch.empty(width, width, device="meta")
            else:
                with torch.device("cpu"):
                    q, _ = rotation_matrix(str(rotation["kind"]), width, int(rotation.get("seed", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"normfold.json: bad explicit rotation entry {e!r}: {exc}") from None
        dtype = torch.float64 if real else ref.dtype if ref is not None else torch.float32
        q = (q.T if e.get("transpose") else q).contiguous().to(dtype)
        if e.get("where") == "output":
            add_output_rotation(module, q)
        elif e.get("where") == "input":
            add_input_rotation(module, q)
        else:
            raise CheckpointError(f"normfold.json: explicit rotation at {e.get('path')}: unknown place {e.get('where')!r}")


def _apply_qk_rotation(model: nn.Module, info: dict) -> None:
    """The per-head query/key rotation after the rotary positions (normfold.rotate.rotate_query_key), R rebuilt
    from head_dim + seed."""
    from ..algebra.rotation import head_rotation
    from ..nn.attention import add_qk_rotation

    modules = dict(model.named_modules())
    try:
        hd, seed, paths = int(info["head_dim"]), int(info.get("seed", 0)), list(info["online"])
        if not 0 < hd <= 4096:
            raise ValueError(f"head_dim {hd}")
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"normfold.json: bad query/key rotation record: {exc}") from None
    ref = next(iter(model.parameters()), None)
    for path in paths:
        module = modules.get(str(path))
        if module is None:
            raise CheckpointError(f"normfold.json: query/key rotation at {path!r}, which is not a module of this model")
        with torch.device("cpu"):
            r, _ = head_rotation(hd, seed)
        try:
            add_qk_rotation(module, r.to(ref.dtype if ref is not None and ref.is_floating_point() else torch.float32))
        except ValueError as exc:
            raise CheckpointError(f"normfold.json: query/key rotation at {path}: {exc}") from None


def apply_tied_heads(model: nn.Module, records: list[dict]) -> None:
    """Replace each recorded head by an `nn.TiedHead` reading the recorded embedding table (its mean,
    scale and bias are filled from the checkpoint; an existing bias Parameter is reused, so aliases of
    it stay shared). Paths are resolved through named_modules() only."""
    from ..nn import TiedHead

    if not records:
        return
    modules = dict(model.named_modules())
    for rec in records:
        head, table = modules.get(rec["head"]), modules.get(rec["table"])
        if not isinstance(head, nn.Linear) or not isinstance(table, nn.Embedding):
            raise CheckpointError(f"normfold.json records a head {rec['head']!r} tied to the table {rec['table']!r}, "
                                  f"but this model has no such linear head / embedding ({type(head).__name__}, "
                                  f"{type(table).__name__})")
        w = table.weight
        if tuple(head.weight.shape) != tuple(w.shape):
            raise CheckpointError(f"normfold.json ties {rec['head']} {tuple(head.weight.shape)} to {rec['table']} "
                                  f"{tuple(w.shape)}: the shapes differ")
        bias = head.bias if rec["bias"] else None
        if rec["bias"] and bias is None:
            bias = nn.Parameter(torch.zeros(w.shape[0], dtype=w.dtype), requires_grad=False)
        mean = torch.zeros(w.shape[0], dtype=w.dtype)
        scale = torch.ones(w.shape[1], dtype=w.dtype) if rec["scale"] else None
        parent, leaf = parent_and_leaf(model, rec["head"])
        setattr(parent, leaf, TiedHead(table, mean, scale, bias))
