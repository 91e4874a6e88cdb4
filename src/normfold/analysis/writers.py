"""Pass 1 of the analysis: the writers. Every op that computes x·W (+b) or reads a table (linear, Conv1D's
addmm, conv, embedding) and every parameter used as a value (cls tokens, position tables) is a candidate;
it is centrable when its weights are its own and every shift of its output is absorbed (shift.py).
LayerScale-style multipliers right after a writer are folded into it first."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import nn

from .. import algebra
from .graph import Graph, Node, where
from .rules import NormRule, Structural, WriterRule, rule_for, same_axis
from .shift import ShiftWalk


@dataclass
class WriterCall:
    node: Node  # the writing op (or the parameter node, for a parameter used as a value)
    key: str  # the writer's name: its module path, or the parameter's name
    paths: tuple[str, ...]  # what the converter centres (module paths / parameter names)
    axis: int  # output dim made zero-mean
    op: str
    module: str
    own_edges: frozenset = frozenset()  # (user name, position) edges of its parameters it accounts for
    problem: str | None = None
    # Scale folding: the writing op when `node` is a multiplier after it (LayerScale λ: y = (xW + b)·λ),
    # and the multiplier parameters folded into the writer before centring (W ← W·diag(λ), λ ← 1).
    writer: Node | None = None
    scales: tuple[str, ...] = ()
    own_scale_pos: int = 1


@dataclass
class WriterInfo:
    key: str
    op: str
    module: str
    paths: tuple[str, ...]
    centrable: bool
    problem: str | None = None
    tied_with: list[str] = field(default_factory=list)
    outputs: frozenset[int] = frozenset()
    calls: int = 1
    scales: tuple[str, ...] = ()  # per-channel multipliers folded into it first (LayerScale)


def param_aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter (tied weights have several), keyed by id."""
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def is_param(x) -> bool:
    return isinstance(x, Node) and x.op == "param"


class WriterPass:
    """Finds the writer calls of `graph` (`calls`: node name -> call) and judges each writer (`writers`)."""

    def __init__(self, graph: Graph, aliases: dict[int, list[str]], shift: ShiftWalk, center_embeddings: bool = True):
        self.graph, self.modules, self.aliases, self.shift = graph, graph.modules, aliases, shift
        self.center_embeddings = center_embeddings
        self.calls: dict[str, WriterCall] = {}
        self.writers: dict[str, WriterInfo] = {}

    def run(self) -> "WriterPass":
        claimed: set[str] = set()  # multiplier parameters folded into a writer
        for node in self.graph.nodes:
            rule = rule_for(node)
            if isinstance(rule, WriterRule):
                call = self._scaled(self._writer_call(node, rule))
                self.calls[call.node.name] = call
                if call.writer is not None:
                    claimed.add(call.node.arg(call.own_scale_pos).name)
        for node in self.graph.nodes:
            if node.op == "param" and node.name not in claimed:
                edges = self._value_edges(node)
                if edges:
                    self.calls[node.name] = self._param_writer(node, edges)
        groups: dict[str, list[WriterCall]] = {}
        for call in self.calls.values():
            groups.setdefault(call.key, []).append(call)
        for key, calls in groups.items():
            self.writers[key] = self._judge(key, calls)
        return self

    def _writer_call(self, node: Node, rule: WriterRule) -> WriterCall:
        w, out_dim, via = rule.weight(node)
        b = node.arg(rule.bias_pos) if rule.bias_pos is not None else None
        axis = rule.out_axis(node) if node.rank else -1
        edges = {(node.name, p) for p in (rule.weight_pos, rule.bias_pos) if p is not None}
        if via is not None:
            edges.add((via.name, 0))
        base = dict(node=node, axis=axis, op=node.op, module=node.module, own_edges=frozenset(edges))
        if not is_param(w) or (b is not None and not is_param(b)):
            return WriterCall(key=f"{node.module}:{node.name}", paths=(), **base,
                              problem="its weights are computed, not parameters")
        if rule.groups_pos is not None and (node.arg(rule.groups_pos, "groups", 1) or 1) != 1:
            return WriterCall(key=node.module or node.name, paths=(), **base,
                              problem="it is a grouped convolution (centring all output channels together does "
                                      "not make each output zero-mean)")
        if rule.conv and node.op == "convolution" and node.arg(6, "transposed", False):
            return WriterCall(key=node.module or node.name, paths=(), **base, problem="it is a transposed convolution")
        # Centre through the module that owns the weight (usually the op's own module; a weight used
        # functionally elsewhere, e.g. sliced by BLOOM's pretraining_tp, still belongs to it).
        owner = self._alias_for(w, node.module).rpartition(".")[0]
        module = self.modules.get(owner)
        lay = algebra.layout_of(module) if module is not None else None
        if (lay is not None and lay.out_dim == out_dim and getattr(module, lay.weight, None) is w.value
                and (b is None or (lay.bias and getattr(module, lay.bias, None) is b.value))):
            return WriterCall(key=owner, paths=(owner,), **base)
        # Functional use of parameters: a parameter can be centred on its own over its last dim,
        # which is the output dim for x @ W (in, out), addmm and embedding tables.
        if w.value is not None and out_dim == w.value.dim() - 1:
            paths = tuple(self._alias_for(p, node.module) for p in (w, b) if p is not None)
            return WriterCall(key=paths[0], paths=paths, **base)
        return WriterCall(key=f"{node.module}:{node.name}", paths=(), **base,
                          problem="its weight is not held by a module normfold knows how to centre "
                                  "(register its layout with normfold.algebra.register_layout)")

    def _scaled(self, call: WriterCall) -> WriterCall:
        """Scale folding (LayerScale, DeiT-III/CaiT γ, a learned per-channel residual scale): when the
        writer's output goes only (through eval dropout / aliases) into `y * λ` with λ a parameter that
        varies along the output axis only and is used nowhere else, the product is the writer's output
        with W ← W·diag(λ), b ← b⊙λ: fold λ in (λ ← 1) and centre the product. Scalars need no folding
        (a per-row scale keeps zero mean)."""
        if call.problem or not call.paths:
            return call
        cur, axis = call.node, call.axis
        for _ in range(8):
            if len(cur.users) != 1:
                return call
            user = cur.users[0]
            if user.op == "mul":
                break
            rule = rule_for(user)
            if not rule.transparent or not isinstance(rule, Structural) or rule.mapper is not same_axis:
                return call
            if [p for p, src in user.inputs() if src is cur] != [0] or rule.shift(user, 0, axis) != axis:
                return call
            cur = user
        else:
            return call
        mul = cur.users[0]
        positions = [p for p, src in mul.inputs() if src is cur]
        if len(positions) != 1 or positions[0] not in (0, 1):
            return call
        pos = 1 - positions[0]
        lam = mul.arg(pos)
        if not is_param(lam) or lam.value is None or lam.users != [mul] or mul.rank is None:
            return call
        shape = tuple(lam.value.shape)
        if lam.value.numel() <= 1 or len(shape) > mul.rank:
            return call
        k = len(shape) + axis  # λ's dim aligned with the output axis (right-aligned broadcasting)
        if k < 0 or shape[k] != lam.value.numel() or mul.shape is None or mul.shape[axis] != shape[k]:
            return call
        name = self._alias_for(lam, mul.module)
        return replace(call, node=mul, writer=call.node, scales=(name,),
                       own_edges=call.own_edges | {(mul.name, pos)}, own_scale_pos=pos)

    def _value_edges(self, param: Node) -> list[tuple[Node, object]]:
        """Uses of a parameter as a tensor value (not as the weight/bias/γ/β of a writer or norm)."""
        out = []
        for user in param.users:
            rule = rule_for(user)
            claimed = ()
            if isinstance(rule, WriterRule):
                claimed = (rule.weight_pos, rule.bias_pos)
            elif isinstance(rule, NormRule):
                claimed = (rule.weight_pos, rule.bias_pos)
            for pos, src in user.inputs():
                if src is param and pos not in claimed:
                    out.append((user, pos))
        return out

    def _param_writer(self, node: Node, edges) -> WriterCall:
        module = edges[0][0].module
        key = self._alias_for(node, module)
        return WriterCall(node=node, key=key, paths=(key,), axis=-1, op="parameter", module=module,
                          own_edges=frozenset((u.name, p) for u, p in edges))

    def _alias_for(self, param: Node, module: str) -> str:
        """The name of `param` whose owner is closest to the module using it (tied weights have several)."""
        names = self.aliases.get(id(param.value), [param.target])

        def score(name: str) -> int:
            owner = name.rpartition(".")[0]
            return len(owner) if (module == owner or module.startswith(owner + ".") or not owner) else -1

        return max(names, key=score)

    def _judge(self, key: str, calls: list[WriterCall]) -> WriterInfo:
        first = calls[0]
        info = WriterInfo(key=key, op=first.op, module=first.module, paths=first.paths, centrable=True,
                          calls=len(calls), scales=tuple(dict.fromkeys(s for c in calls for s in c.scales)))
        if len({c.scales for c in calls}) > 1:
            info.problem, info.centrable = "its calls are scaled by different multipliers", False
            return info
        problem = next((c.problem for c in calls if c.problem), None)
        if problem is None and not self.center_embeddings and first.op in ("embedding", "parameter"):
            problem = "embeddings are not centred (center_embeddings=False)"
        if problem is None:
            problem, info.tied_with = self._other_uses(calls)
        outputs: frozenset[int] = frozenset()
        if problem is None:
            for call in calls:
                res = self.shift.shift_of(call.node, call.axis, only=self._value_edges(call.node) if call.op == "parameter"
                                    else None)
                outputs |= res.outputs
                if not res.ok:
                    problem = f"its output also reaches {res.why}"
                    break
        info.problem, info.centrable, info.outputs = problem, problem is None, outputs
        return info

    def _other_uses(self, calls: list[WriterCall]) -> tuple[str | None, list[str]]:
        """Uses of the writer's parameters outside its own calls: fine if they sit in another module that
        holds its own name for the parameter (tied weights: the converter unties them)."""
        own = frozenset().union(*(c.own_edges for c in calls))
        tied: list[str] = []
        params = []
        for c in calls:
            if c.op == "parameter":
                params.append(c.node)
            else:
                wnode = c.writer or c.node
                rule = rule_for(wnode)
                params += [rule.weight(wnode)[0]] + ([wnode.arg(rule.bias_pos)] if rule.bias_pos is not None else [])
                if c.writer is not None:
                    params.append(c.node.arg(c.own_scale_pos))
        seen = set()
        for pnode in params:
            if not isinstance(pnode, Node) or pnode.name in seen:
                continue
            seen.add(pnode.name)
            names = self.aliases.get(id(pnode.value), [pnode.target])
            for user in pnode.users:
                for pos, src in user.inputs():
                    if src is not pnode or (user.name, pos) in own:
                        continue
                    mine = [n for n in names if n.rpartition(".")[0] == user.module]
                    if mine and not any(n in c.paths or n.rpartition(".")[0] in c.paths for c in calls for n in mine):
                        tied += [n for n in mine if n not in tied]
                        continue
                    return f"its weight is also used by {user.op} in {where(user)}", tied
        return None, tied
