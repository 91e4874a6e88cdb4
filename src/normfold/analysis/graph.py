"""A small dataflow graph the analysis runs on, built from a torch.export or torch.fx trace.

Both tracers produce fx graphs, but with different vocabularies (ATen overloads vs. modules,
functions and tensor methods). The front-ends below translate both into one: every node gets a
canonical op name ("linear", "add", "layer_norm", "view", ...) with ATen-style argument order,
the module path it ran in (from `nn_module_stack`), its output shape, and — for parameters — the
parameter object. The zero-mean rules (`rules.py`) are written once against this vocabulary.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn


@dataclass(eq=False)
class Node:
    """One value of the traced program.

    `op`: canonical op name, or one of 'input' (a model input), 'param', 'buffer', 'constant',
    'output' (the model's outputs: args[0] is the flat list of leaves).
    `target`: the input name or the parameter/buffer name for those kinds.
    `shape`: the output shape when the node is a single tensor, else None.
    """

    name: str
    op: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    module: str = ""
    module_type: str = ""
    shape: tuple[int, ...] | None = None
    target: str | None = None
    value: Any = None  # the nn.Parameter of a 'param' node
    users: list["Node"] = field(default_factory=list)
    index: int = 0  # position in topological order

    def arg(self, i: int, name: str | None = None, default: Any = None) -> Any:
        if i < len(self.args):
            return self.args[i]
        if name is not None and name in self.kwargs:
            return self.kwargs[name]
        return default

    def inputs(self) -> Iterator[tuple[int | str, "Node"]]:
        """(position, node) for every graph value this node reads; list elements share the position."""
        for i, a in enumerate(self.args):
            yield from ((i, n) for n in _nodes_in(a))
        for k, a in self.kwargs.items():
            yield from ((k, n) for n in _nodes_in(a))

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    def __repr__(self) -> str:  # keep pytest output readable
        return f"Node({self.name}: {self.op} in {self.module or '<root>'})"


def where(node: Node) -> str:
    """The place a node runs in, as messages name it."""
    return node.module or "the top-level forward"


def _nodes_in(a) -> Iterator[Node]:
    if isinstance(a, Node):
        yield a
    elif isinstance(a, (list, tuple)):
        for x in a:
            yield from _nodes_in(x)


@dataclass
class Graph:
    nodes: list[Node]
    tracer: str  # "torch.export" or "torch.fx"
    # Module path -> the module object (the traced model's named_modules()).
    modules: dict[str, nn.Module]
    # normfold.verify's name of each output leaf (filled by analyze on first use).
    output_names: list | None = None
    # Rebuilds the model's output structure from a list of its user-output leaves (to name them).
    unflatten: Callable[[list], Any] | None = None
    n_user_outputs: int = 0

    @property
    def output(self) -> Node:
        return self.nodes[-1]

    def finish(self) -> "Graph":
        for i, n in enumerate(self.nodes):
            n.index = i
            for _, src in n.inputs():
                if n not in src.users:  # identity comparison (eq=False)
                    src.users.append(n)
        # Dead code (e.g. `shape = inputs_embeds[:, :, -1]` never used) cannot see anything: drop it
        # from the users lists so it neither blocks a writer nor counts as a norm's consumer.
        live = {id(self.output)}
        for n in reversed(self.nodes):
            if id(n) in live:
                live.update(id(src) for _, src in n.inputs())
        for n in self.nodes:
            n.users = [u for u in n.users if id(u) in live]
        return self


def _shape_of(val) -> tuple[int, ...] | None:
    if isinstance(val, torch.Tensor):
        try:
            return tuple(int(s) for s in val.shape)
        except (TypeError, ValueError):  # symbolic sizes
            return None
    return None


def _innermost(stack) -> tuple[str, str]:
    if not stack:
        return "", ""
    path, typ = list(stack.values())[-1]
    typ = typ if isinstance(typ, str) else f"{typ.__module__}.{typ.__qualname__}"
    return _clean_path(path), typ


def _clean_path(path: str) -> str:
    """torch.export may spell paths as "L['self'].h[0].ln_1"; normalise to "h.0.ln_1"."""
    if not path:
        return ""
    path = path.replace("L['self'].", "").replace("L['self']", "")
    out = []
    for part in path.replace("]", "").replace("[", ".").split("."):
        if part:
            out.append(part.strip("'\""))
    return ".".join(out)


# ---- torch.export front-end ----------------------------------------------------------------------

def from_export(ep, model: nn.Module) -> Graph:
    """Translate an ExportedProgram (ATen training IR) into a Graph."""
    from torch.export.graph_signature import InputKind

    kinds = {spec.arg.name: spec for spec in ep.graph_signature.input_specs if hasattr(spec.arg, "name")}
    params = dict(model.named_parameters(remove_duplicate=False))
    nodes: dict[str, Node] = {}
    out: list[Node] = []

    def conv(a):
        if isinstance(a, torch.fx.Node):
            return nodes[a.name]
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        return a

    for fn in ep.graph.nodes:
        module, module_type = _innermost(fn.meta.get("nn_module_stack"))
        shape = _shape_of(fn.meta.get("val"))
        if fn.op == "placeholder":
            spec = kinds.get(fn.name)
            kind = getattr(spec, "kind", None)
            if kind == InputKind.PARAMETER:
                node = Node(fn.name, "param", target=spec.target, shape=shape, value=params.get(spec.target))
            elif kind == InputKind.BUFFER:
                node = Node(fn.name, "buffer", target=spec.target, shape=shape)
            elif kind in (InputKind.CONSTANT_TENSOR, getattr(InputKind, "CUSTOM_OBJ", None)):
                node = Node(fn.name, "constant", target=spec.target, shape=shape)
            else:
                node = Node(fn.name, "input", target=fn.name, shape=shape)
        elif fn.op == "output":
            node = Node(fn.name, "output", args=(list(conv(fn.args[0])),))
        elif fn.op == "get_attr":
            node = Node(fn.name, "get_attr", target=str(fn.target))
        else:
            node = Node(fn.name, _aten_name(fn.target), args=conv(tuple(fn.args)),
                        kwargs={k: conv(v) for k, v in fn.kwargs.items()},
                        module=module, module_type=module_type, shape=shape)
        nodes[fn.name] = node
        out.append(node)
    spec = ep.call_spec.out_spec
    graph = Graph(out, "torch.export", dict(model.named_modules(remove_duplicate=False)),
                  n_user_outputs=len(ep.graph_signature.user_outputs))
    if spec is not None:
        from torch.utils import _pytree as pytree

        graph.unflatten = lambda leaves: pytree.tree_unflatten(leaves, spec)
    return graph.finish()


# In-place arithmetic as the value it produces (the tracer routes later reads to the in-place node).
_INPLACE = {"add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div", "neg_": "neg"}


def _aten_name(target) -> str:
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "_opname", None)  # OpOverload: aten.add.Tensor -> "add"
    if name:
        return _INPLACE.get(name, name)
    return getattr(target, "__name__", str(target)).split(".")[0]


# ---- torch.fx front-end ------------------------------------------------------------------------------

def _fx_module_call(module: nn.Module, x_args: tuple) -> tuple[str, tuple] | None:
    """A leaf module of a symbolic trace, written as the ATen-style call it performs."""
    x = x_args[0] if x_args else None
    if isinstance(module, nn.Linear):
        return "linear", (x, module.weight, module.bias)
    if isinstance(module, nn.Embedding):
        return "embedding", (module.weight, x)
    if isinstance(module, nn.LayerNorm):
        return "layer_norm", (x, list(module.normalized_shape), module.weight, module.bias, module.eps)
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return f"conv{module.weight.dim() - 2}d", (x, module.weight, module.bias, module.stride, module.padding,
                                                  module.dilation, module.groups)
    if isinstance(module, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)):
        return "dropout", (x, module.p, module.training)
    if isinstance(module, nn.Identity):
        return "alias", (x,)
    if isinstance(module, nn.Flatten):
        return "flatten", (x, module.start_dim, module.end_dim)
    return None


_FX_FUNCTION_NAMES = {
    operator.add: "add", operator.iadd: "add", operator.sub: "sub", operator.isub: "sub",
    operator.mul: "mul", operator.imul: "mul", operator.truediv: "div", operator.itruediv: "div",
    operator.neg: "neg", operator.matmul: "matmul", operator.getitem: "getitem",
}
# Tensor methods / functions whose ATen twin takes its dims as one list argument.
_VARARG_DIMS = {"permute", "view", "reshape", "expand", "repeat"}
_CASTS = {"float", "double", "half", "bfloat16", "to", "type", "type_as", "cpu", "cuda"}


def from_fx(gm: torch.fx.GraphModule, model: nn.Module) -> Graph:
    """Translate a symbolic trace (after ShapeProp, so nodes carry tensor_meta) into a Graph."""
    modules = dict(gm.named_modules(remove_duplicate=False))
    param_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    nodes: dict[str, Node] = {}
    out: list[Node] = []
    param_nodes: dict[int, Node] = {}

    def param_node(p: nn.Parameter | None, where: str):
        if p is None:
            return None
        if id(p) not in param_nodes:
            node = Node(f"p_{param_names.get(id(p), where)}", "param", target=param_names.get(id(p), where),
                        shape=tuple(p.shape), value=p)
            param_nodes[id(p)] = node
            out.append(node)
        return param_nodes[id(p)]

    def conv(a):
        if isinstance(a, torch.fx.Node):
            return nodes[a.name]
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        if isinstance(a, slice):
            return slice(conv(a.start), conv(a.stop), conv(a.step))
        return a

    for fn in gm.graph.nodes:
        module, module_type = _innermost(fn.meta.get("nn_module_stack"))
        meta = fn.meta.get("tensor_meta")
        shape = tuple(int(s) for s in meta.shape) if hasattr(meta, "shape") else None
        args, kwargs = conv(tuple(fn.args)), {k: conv(v) for k, v in fn.kwargs.items()}
        if fn.op == "placeholder":
            node = Node(fn.name, "input", target=fn.name, shape=shape)
        elif fn.op == "output":
            structure = conv(fn.args[0])
            node = Node(fn.name, "output", args=(_flatten_output(structure),))
        elif fn.op == "get_attr":
            obj = _getattr_path(gm, fn.target)
            if isinstance(obj, nn.Parameter):
                nodes[fn.name] = param_node(obj, fn.target)
                continue
            kind = "buffer" if isinstance(obj, torch.Tensor) else "get_attr"
            node = Node(fn.name, kind, target=fn.target, shape=shape)
        elif fn.op == "call_module":
            sub = modules[fn.target]
            call = _fx_module_call(sub, args)
            path, typ = fn.target, f"{type(sub).__module__}.{type(sub).__qualname__}"
            if call is None:
                node = Node(fn.name, type(sub).__name__.lower(), args=args, kwargs=kwargs, module=path,
                            module_type=typ, shape=shape)
            else:
                name, cargs = call
                cargs = tuple(param_node(a, path) if isinstance(a, nn.Parameter) else a for a in cargs)
                node = Node(fn.name, name, args=cargs, module=path, module_type=typ, shape=shape)
        else:
            name, args, kwargs = _fx_call(fn, args, kwargs)
            node = Node(fn.name, name, args=args, kwargs=kwargs, module=module, module_type=module_type, shape=shape)
        nodes[fn.name] = node
        out.append(node)
    # Parameter nodes were appended where first used; keep them ahead of their users.
    out.sort(key=lambda n: (0 if n.op in ("param", "input", "buffer") else 1))
    out = [n for n in out if n.op != "output"] + [n for n in out if n.op == "output"]
    leaves = out[-1].args[0]
    graph = Graph(out, "torch.fx", dict(model.named_modules(remove_duplicate=False)), n_user_outputs=len(leaves))
    graph.unflatten = lambda values: _rebuild(structure, dict(zip(map(id, leaves), values)))
    return graph.finish()


def _rebuild(a, values: dict):
    """The fx output structure with each Node replaced by its value."""
    if isinstance(a, Node):
        return values[id(a)]
    if isinstance(a, (list, tuple)):
        return type(a)(_rebuild(x, values) for x in a)
    if isinstance(a, dict):
        return {k: _rebuild(v, values) for k, v in a.items()}
    return a


def _getattr_path(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _flatten_output(a) -> list:
    flat = []
    if isinstance(a, Node):
        flat.append(a)
    elif isinstance(a, (list, tuple)):
        for x in a:
            flat += _flatten_output(x)
    elif isinstance(a, dict):
        for x in a.values():
            flat += _flatten_output(x)
    return flat


def _fx_call(fn: torch.fx.Node, args: tuple, kwargs: dict) -> tuple[str, tuple, dict]:
    """Canonical name and ATen-style args of a call_function / call_method node."""
    if fn.op == "call_method":
        name = str(fn.target)
    else:
        name = _FX_FUNCTION_NAMES.get(fn.target) or _aten_name(fn.target)
    name = _INPLACE.get(name, name)
    if name in _CASTS:
        return "_to_copy", args[:1], {}
    if name == "getitem" and args and isinstance(args[0], Node) and args[0].shape is not None:
        return "tensor_getitem", args, kwargs  # x[..., 0] indexing, not tuple access
    if name in _VARARG_DIMS and len(args) > 1 and not isinstance(args[1], (list, tuple)):
        return name, (args[0], list(args[1:])), kwargs
    if name == "embedding" and fn.op == "call_function":  # F.embedding(input, weight) -> aten order
        return name, (args[1], args[0]) + tuple(args[2:]), kwargs
    if name == "dropout" and fn.op == "call_function":
        x = args[0]
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        train = args[2] if len(args) > 2 else kwargs.get("training", True)
        return name, (x, p, train), {}
    if name in ("cat", "concat", "concatenate"):
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        return "cat", (args[0], dim), {}
    if name == "truediv":
        name = "div"
    return name, args, kwargs
