"""The passes: which writers can be centred, which tensors are then zero-mean, and each norm's verdict.

1. Writers. Every op that computes x·W (+b) or reads a table (linear, Conv1D's addmm, conv,
   embedding) and every parameter used as a value (cls tokens, position tables) is a candidate.
   Centring it subtracts a per-row constant from its output; that is allowed only if every path
   from its output ends in a LayerNorm over that axis (LN(x + k) = LN(x)) or in a model output
   (returned recentred, like hidden states). Its weights must also be its own: a weight tied to a
   reader elsewhere (lm_head) is untied by the converter, but a module called somewhere else, or a
   weight used functionally, cannot be centred for one use only.
2. Forward. In graph order, each tensor gets a state: zero-mean along a dim once a set of writers
   is centred, or not zero-mean with the causes named (rules.py).
3. Norms. A LayerNorm is foldable when its input is zero-mean along the normalized last dim. Its
   readers are the linear modules that read its output (through views, dropout, token selection).

Paper 002's Algorithm 1 is the same forward pass, but marks every LayerNorm output as centred and
never checks whether a writer's output reaches anything but norms; both are fixed here.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from torch import nn

from .. import algebra
from .graph import Graph, Node
from .rules import ABSORBED, Cause, Meta, NormRule, NotZeroMean, WriterRule, ZeroMean, not_zero_mean, rule_for

SOURCE_KINDS = ("input", "param", "buffer", "constant", "get_attr")
STREAM_OUTPUTS = ("*last_hidden_state",)


@dataclass(frozen=True)
class Options:
    """center_embeddings: embedding tables and parameters added to the stream (cls tokens, position
    tables) may be centred (paper 002 Table 7's "centered embedding" column; False = its plain column).
    recenter: allow an explicit Recenter after a module whose output joins the stream but cannot be
    made zero-mean by weights (BLOOM's embedding LayerNorm); such conversions are not stock-reloadable.
    recentred_outputs: output names/patterns that may come back recentred, besides '*hidden_states[i]'
    and '*last_hidden_state': outputs carrying the stream itself.
    structural: judge norms by structure only: a LayerNorm output counts as zero-mean only without
    affine, not when its γ happens to be constant and β zero (verdicts that hold for any weight
    values, as training-time reparametrization needs)."""

    center_embeddings: bool = True
    recenter: bool = False
    structural: bool = False
    recentred_outputs: tuple[str, ...] = ()


@dataclass
class ShiftResult:
    """Where a per-row shift of a tensor goes: absorbed by norms / returned in a stream output (ok), or
    seen by something (`why`)."""

    ok: bool
    why: str | None = None  # what sees it: "gelu in h.0.mlp", "the model output 'pooler_output'"
    outputs: frozenset[int] = frozenset()
    norms: frozenset[str] = frozenset()  # the norm ops that absorb it


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


@dataclass
class NormCall:
    node: Node
    input_state: object
    readers: list[str]  # linear modules reading the output over its normalized dim
    reader_problem: str | None  # why the affine cannot move into the readers (None: it can)
    final: bool  # the output (also) leaves the model
    reader_ops: list[Node] = field(default_factory=list)


class Propagation:
    """Runs the three passes over `graph` for `model`; results in `states`, `writers`, `norm_calls`."""

    def __init__(self, graph: Graph, model: nn.Module, options: Options = Options()):
        self.graph, self.model, self.options = graph, model, options
        self.modules = graph.modules
        self.aliases = _aliases(model)
        self.states: dict[str, object] = {}
        self._shift: dict[tuple[str, int], ShiftResult] = {}
        self.calls: dict[str, WriterCall] = {}  # node name -> the writer call it performs
        self.writers: dict[str, WriterInfo] = {}
        self.recenters: dict[str, str | None] = {}  # module -> problem (None: may be recentred)
        self.recenter_outputs: dict[str, frozenset[int]] = {}
        self.norm_calls: list[NormCall] = []
        self.recentrable_outputs = self._recentrable_outputs()

    def _recentrable_outputs(self) -> frozenset[int]:
        """Output leaves that carry the stream and may come back recentred: hidden states (as verify
        accepts them), a last_hidden_state that is the raw stream (no final norm: CLIP's vision tower,
        as its adapter does), and the user's patterns. Pooled outputs, logits, embeddings: never."""
        from ..verify import CENTERED_OUTPUTS

        patterns = tuple(CENTERED_OUTPUTS) + STREAM_OUTPUTS + self.options.recentred_outputs
        names = self.graph.output_names or []
        return frozenset(i for i, name in enumerate(names) if name is not None and any(
            name == p or fnmatch.fnmatchcase(name, p) for p in patterns))

    def _output_name(self, i: int) -> str:
        names = self.graph.output_names or []
        return f"'{names[i]}'" if i < len(names) and names[i] else f"#{i}"

    @classmethod
    def empty(cls, model: nn.Module, options: Options = Options()) -> "Propagation":
        """For a model without LayerNorms: nothing to trace."""
        return cls(Graph([Node("output", "output", args=([],))], "none", dict(model.named_modules())), model, options)

    # ---- context the rules use ---------------------------------------------------------------------
    def state(self, x):
        return self.states.get(x.name) if isinstance(x, Node) else None

    def where(self, node: Node) -> str:
        return node.module or "the top-level forward"

    def num_outputs(self, node: Node) -> int:
        return max([u.arg(1) + 1 for u in node.users if u.op == "getitem" and isinstance(u.arg(1), int)] or [1])

    def cause_of(self, node: Node) -> Cause:
        src = next((s for _, s in node.inputs() if s.op not in SOURCE_KINDS), None)
        if src is not None and src.module and not _inside(node.module, src.module):
            return Cause(f"the output of {node.op} after {src.module} (not zero-mean)", node.name)
        return Cause(f"the output of {node.op} in {self.where(node)} (not zero-mean)", node.name)

    # ---- pass 1: writers --------------------------------------------------------------------------------
    def find_writers(self) -> None:
        for node in self.graph.nodes:
            rule = rule_for(node)
            if isinstance(rule, WriterRule):
                self.calls[node.name] = self._writer_call(node, rule)
            elif node.op == "param":
                edges = self._value_edges(node)
                if edges:
                    self.calls[node.name] = self._param_writer(node, edges)
        groups: dict[str, list[WriterCall]] = {}
        for call in self.calls.values():
            groups.setdefault(call.key, []).append(call)
        for key, calls in groups.items():
            self.writers[key] = self._judge(key, calls)

    def _writer_call(self, node: Node, rule: WriterRule) -> WriterCall:
        w, out_dim, via = rule.weight(node)
        b = node.arg(rule.bias_pos) if rule.bias_pos is not None else None
        axis = rule.out_axis(node) if node.rank else -1
        edges = {(node.name, p) for p in (rule.weight_pos, rule.bias_pos) if p is not None}
        if via is not None:
            edges.add((via.name, 0))
        base = dict(node=node, axis=axis, op=node.op, module=node.module, own_edges=frozenset(edges))
        if not _is_param(w) or (b is not None and not _is_param(b)):
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
                          calls=len(calls))
        problem = next((c.problem for c in calls if c.problem), None)
        if problem is None and not self.options.center_embeddings and first.op in ("embedding", "parameter"):
            problem = "embeddings are not centred (center_embeddings=False)"
        if problem is None:
            problem, info.tied_with = self._other_uses(calls)
        outputs: frozenset[int] = frozenset()
        if problem is None:
            for call in calls:
                res = self.shift_of(call.node, call.axis, only=self._value_edges(call.node) if call.op == "parameter"
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
                rule = rule_for(c.node)
                params += [rule.weight(c.node)[0]] + ([c.node.arg(rule.bias_pos)] if rule.bias_pos is not None else [])
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
                    return f"its weight is also used by {user.op} in {self.where(user)}", tied
        return None, tied

    # ---- shift walk ------------------------------------------------------------------------------------
    def _shift_edges(self, node: Node, axis: int, only=None):
        edges = only if only is not None else [(u, pos) for u in node.users for pos, src in u.inputs() if src is node]
        for user, pos in edges:
            if user.op == "output":
                yield user, pos, "output"
            else:
                yield user, pos, rule_for(user).shift(user, pos, axis)

    def shift_of(self, start: Node, axis: int, only=None) -> ShiftResult:
        """Follow a per-row shift of `start` along `axis` to norms that absorb it / ops that see it."""
        stack = [(start, axis, only)]
        while stack:
            node, a, edges = stack[-1]
            key = (node.name, a) if edges is None else None
            if key is not None and key in self._shift:
                stack.pop()
                continue
            todo = [(u, r, None) for u, _, r in self._shift_edges(node, a, edges)
                    if isinstance(r, int) and not isinstance(r, bool) and (u.name, r) not in self._shift]
            if todo:
                stack.extend(todo)
                continue
            result = self._combine(node, a, edges)
            stack.pop()
            if key is None:
                return result
            self._shift[key] = result
        return self._shift[(start.name, axis)]

    def _combine(self, node: Node, axis: int, edges) -> ShiftResult:
        outputs: set[int] = set()
        norms: set[str] = set()
        out_node = self.graph.output
        for user, pos, r in self._shift_edges(node, axis, edges):
            if r == "output":
                hits = {i for i, leaf in enumerate(out_node.args[0]) if leaf is node}
                bad = sorted(hits - self.recentrable_outputs)
                if bad:
                    return ShiftResult(False, f"the model output {self._output_name(bad[0])}, which would come back "
                                              "recentred (allow it with recentred_outputs=...)")
                outputs |= hits
            elif r == ABSORBED:
                if isinstance(rule_for(user), NormRule):
                    norms.add(user.name)
            elif r is None:
                return ShiftResult(False, f"{user.op} in {self.where(user)}")
            else:
                sub = self._shift[(user.name, r)]
                if not sub.ok:
                    return sub
                outputs |= sub.outputs
                norms |= sub.norms
        return ShiftResult(True, None, frozenset(outputs), frozenset(norms))

    # ---- pass 2: forward ----------------------------------------------------------------------------------
    def forward(self) -> None:
        for node in self.graph.nodes:
            if node.op == "output":
                continue
            s = self._forward_one(node)
            if isinstance(s, NotZeroMean) and self.options.recenter:
                s = self._maybe_recenter(node, s)
            self.states[node.name] = s

    def _forward_one(self, node: Node):
        call = self.calls.get(node.name)
        if call is not None:
            info = self.writers[call.key]
            if info.centrable:
                return ZeroMean(call.axis, frozenset({call.key}))
            what = f"the parameter {call.key}" if call.op == "parameter" else f"the output of {call.key} ({call.op})"
            return not_zero_mean([Cause(f"{what}, which cannot be centred: {info.problem}", node.name, "writer")])
        if node.op == "input":
            return not_zero_mean([Cause(f"the model input '{node.target}' (not zero-mean)", node.name, "input")])
        if node.op in ("buffer", "constant"):
            return not_zero_mean([Cause(f"the {node.op} {node.target} (normfold centres parameters only)",
                                        node.name, node.op)])
        if node.op in ("param", "get_attr"):
            return None  # only read as a weight / not a tensor
        rule = rule_for(node)
        if isinstance(rule, NormRule):
            return self._norm_output(node)
        return rule.forward(node, self)

    def _norm_output(self, node: Node):
        gamma, beta = node.arg(2, "weight"), node.arg(3, "bias")
        g = gamma.value if isinstance(gamma, Node) else None
        b = beta.value if isinstance(beta, Node) else None
        const_gamma = g is None or bool((g == g.reshape(-1)[0]).all())
        zero_beta = b is None or not bool(b.ne(0).any())
        if isinstance(gamma, Node) and g is None or isinstance(beta, Node) and b is None:
            const_gamma = zero_beta = False  # affine from a computed tensor
        name = self.norm_name(node)
        if const_gamma and zero_beta and len(node.arg(1)) == 1:
            if g is None and b is None:
                return ZeroMean(-1)
            if not self.options.structural:
                return ZeroMean(-1, assumes=frozenset({name}))
            return not_zero_mean([Cause(f"the affine output of {name} (γ⊙n+β: zero-mean for its current values, "
                                        "γ constant and β = 0, but not for every value)", node.name, "affine")])
        return not_zero_mean([Cause(f"the affine output of {name} (γ⊙n+β is not zero-mean)", node.name, "affine")])

    def norm_name(self, node: Node) -> str:
        module = self.modules.get(node.module)
        if isinstance(module, nn.LayerNorm):
            return node.module
        return f"{node.module or '<top-level>'} (F.layer_norm)"

    def _maybe_recenter(self, node: Node, state: NotZeroMean):
        """With recenter=True: a module output that is not zero-mean but only flows into norms/outputs
        may get an explicit Recenter (x - mean(x)) after its module (a forward hook, so every call of the
        module is recentred: it must be called once), when that makes two or more norms foldable."""
        module = node.module
        if not module or node.rank is None or not _returns_one_tensor(self.modules.get(module)):
            return state
        outputs = self._module_outputs().get(module, [])
        if outputs != [node]:
            return state  # not the module's (single) output
        if module not in self.recenters:
            res = self.shift_of(node, -1)
            self.recenter_outputs[module] = res.outputs
            # A Recenter costs what one LayerNorm's centring costs: worth it only for two or more norms.
            self.recenters[module] = None if res.ok and len(res.norms) >= 2 else "not worth it"
        if self.recenters[module] is not None:
            return state
        return ZeroMean(-1, frozenset(), frozenset({module}))

    def _module_outputs(self) -> dict[str, list[Node]]:
        """Per module path, the nodes computed inside it whose value is used outside it (its outputs)."""
        if not hasattr(self, "_outs"):
            self._outs: dict[str, list[Node]] = {}
            for n in self.graph.nodes:
                if n.module and any(u.op == "output" or not _inside(u.module, n.module) for u in n.users):
                    self._outs.setdefault(n.module, []).append(n)
        return self._outs

    # ---- pass 3: norms --------------------------------------------------------------------------------------
    def judge_norms(self) -> None:
        for node in self.graph.nodes:
            if isinstance(rule_for(node), NormRule):
                ops, problem, final = self._readers(node)
                readers = list(dict.fromkeys(op.module for op in ops))
                self.norm_calls.append(NormCall(node, self.states.get(node.arg(0).name), readers, problem, final, ops))
        self._check_shared_readers()

    def _check_shared_readers(self) -> None:
        """Folding γ into a reader changes every call of it: each of its calls must read this norm."""
        calls: dict[str, int] = {}
        for n in self.graph.nodes:
            rule = rule_for(n)
            if isinstance(rule, WriterRule) and not rule.conv and n.module:
                calls[n.module] = calls.get(n.module, 0) + 1
        reads: dict[str, list[tuple[NormCall, Node]]] = {}
        for nc in self.norm_calls:
            for op in nc.reader_ops:
                reads.setdefault(op.module, []).append((nc, op))
        for module, lst in reads.items():
            norms = {self.norm_name(nc.node) for nc, _ in lst}
            if len(norms) > 1 or len({op.name for _, op in lst}) < calls.get(module, 0):
                for nc, _ in lst:
                    nc.reader_problem = nc.reader_problem or f"its reader {module} is also called on other inputs"

    def _readers(self, node: Node) -> tuple[list[Node], str | None, bool]:
        """Linear ops reading the norm's output over its normalized dim (through views, eval dropout,
        token selection); the first other consumer if any; whether the output leaves the model."""
        readers: list[Node] = []
        problem, final = None, False
        todo, seen = [(node, -1)], set()
        while todo:
            cur, axis = todo.pop()
            if (cur.name, axis) in seen:
                continue
            seen.add((cur.name, axis))
            for user in cur.users:
                for pos, src in user.inputs():
                    if src is not cur:
                        continue
                    if user.op == "output":
                        final = True
                        continue
                    rule = rule_for(user)
                    if isinstance(rule, Meta):  # reads the shape only
                        continue
                    if isinstance(rule, WriterRule) and not rule.conv and pos == rule.input_pos and axis == -1:
                        if self._is_linear_reader(user, rule):
                            if user not in readers:
                                readers.append(user)
                            continue
                    elif rule.transparent:
                        nxt = rule.shift(user, pos, axis)
                        if nxt == ABSORBED:  # metadata only (type_as's reference tensor)
                            continue
                        if isinstance(nxt, int) and not isinstance(nxt, bool):
                            todo.append((user, nxt))
                            continue
                    problem = problem or f"its output also feeds {user.op} in {self.where(user)}"
        return readers, problem, final

    def _is_linear_reader(self, node: Node, rule: WriterRule) -> bool:
        module = self.modules.get(node.module)
        if module is None or not algebra.is_linear_reader(module):
            return False
        lay = algebra.layout_of(module)
        w, out_dim, _ = rule.weight(node)
        return w is not None and getattr(module, lay.weight, None) is w.value and lay.out_dim == out_dim

    def run(self) -> "Propagation":
        self.find_writers()
        self.forward()
        self.judge_norms()
        return self


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def _is_param(x) -> bool:
    return isinstance(x, Node) and x.op == "param"


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def _returns_one_tensor(module) -> bool:
    """Modules whose forward returns a single tensor, so a forward hook can recentre it."""
    if module is None:
        return False
    if isinstance(module, (nn.MultiheadAttention, nn.RNNBase, nn.Transformer)):
        return False
    return type(module).__module__.startswith("torch.nn.modules") or isinstance(module, nn.LayerNorm)

