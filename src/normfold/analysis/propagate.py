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
from dataclasses import dataclass, field, replace

from torch import nn

from .. import algebra
from .graph import Graph, Node
from .rules import (
    ABSORBED,
    Cause,
    Dropout,
    GetItem,
    Meta,
    Mix,
    NormRule,
    NotZeroMean,
    Scale,
    Structural,
    Sum,
    WriterRule,
    ZeroMean,
    dim_arg,
    not_zero_mean,
    rule_for,
)
from .rules import same_axis as _same_axis

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


@dataclass
class NormCall:
    node: Node
    input_state: object
    readers: list[str]  # linear modules reading the output over its normalized dim
    reader_problem: str | None  # why the affine cannot move into the readers (None: it can)
    final: bool  # the output (also) leaves the model
    reader_ops: list[Node] = field(default_factory=list)
    beta_cancels: list[str] = field(default_factory=list)  # bias-less readers whose β term cancels


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
        from ..forward import CENTERED_OUTPUTS

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
            if not rule.transparent or not isinstance(rule, Structural) or rule.mapper is not _same_axis:
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
        if not _is_param(lam) or lam.value is None or lam.users != [mul] or mul.rank is None:
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
                cancels = [op.module for op in ops if _bias_free(self.modules.get(op.module)) and self.beta_cancels(op)]
                self.norm_calls.append(NormCall(node, self.states.get(node.arg(0).name), readers, problem, final, ops,
                                                list(dict.fromkeys(cancels))))
        self._check_shared_readers()

    def _check_shared_readers(self) -> None:
        """Folding γ into a reader changes every call of it: each of its calls must read this norm."""
        calls: dict[str, int] = {}
        for n in self.graph.nodes:
            rule = rule_for(n)
            if isinstance(rule, WriterRule) and n.module:
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
                    elif isinstance(rule, WriterRule) and rule.conv and pos == rule.input_pos and \
                            axis == rule.out_axis(user) and self._is_conv_reader(user, rule):
                        if user not in readers:  # a conv over the norm's channels (paper 002 A.3.2)
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

    def beta_cancels(self, reader: Node) -> bool:
        """Whether a constant vector c added to every row of `reader`'s output (a norm's β read through it:
        c = βW) cancels before anything sees it. True when every path leads to attention scores as the
        keys — q·(k + c) = q·k + q·c, the same for every key of a query — and the scores reach a softmax
        over the keys through sums (additive masks, ALiBi and relative position biases: any additive
        term), scalings constant along the keys and rearrangements. False if the keys are rotated per
        position (RoPE: R_j c differs per key j), normalized (QK-norm), scaled per key, returned (a
        cache), used as values, or the scores are multiplied by something varying along the keys."""
        stack, seen = [(reader, -2, False)], set()  # (node, axis, scores?): rows vary along axis, c does not
        while stack:
            node, axis, scores = stack.pop()
            if (node.name, axis, scores) in seen:
                continue
            seen.add((node.name, axis, scores))
            for user in node.users:
                for pos, src in user.inputs():
                    if src is not node:
                        continue
                    step = self._cancel_step(user, pos, axis, scores)
                    if step is None:
                        return False
                    if step is not ABSORBED:
                        stack.append((user,) + step)
        return True

    def _cancel_step(self, user: Node, pos, axis: int, scores: bool):
        if user.op == "output":
            return None
        rule = rule_for(user)
        if isinstance(rule, Meta):
            return ABSORBED
        if not scores:
            if user.op == "scaled_dot_product_attention":  # (q, k, v, mask, ...): keys at 1, tokens at -2
                return ABSORBED if pos == 1 and axis == -2 else None
            if user.op in ("matmul", "bmm") and pos == 1 and axis == -1:  # q @ kᵀ: keys along the last dim
                return (-1, True)
        elif user.op in ("softmax", "_softmax", "_safe_softmax", "log_softmax") and user.rank is not None:
            return ABSORBED if dim_arg(user.arg(1, "dim"), user.rank) == axis + user.rank else None
        if isinstance(rule, Dropout) and rule.active(user):
            return None
        if isinstance(rule, (Structural, Sum, Scale, GetItem)) and not isinstance(rule, Mix):
            nxt = rule.shift(user, pos, axis)
            if isinstance(nxt, int) and not isinstance(nxt, bool):
                return (nxt, scores)
        return None

    def _is_conv_reader(self, node: Node, rule: WriterRule) -> bool:
        """A ConvNd module reading the norm over its input channels with no zero padding (so a constant β
        input gives a constant output and folds into the bias: algebra.fold_affine_conv)."""
        module = self.modules.get(node.module)
        w = rule.weight(node)[0]
        return (module is not None and algebra.is_conv_reader(module) and w is not None
                and getattr(module, "weight", None) is w.value)

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


def _bias_free(module) -> bool:
    lay = algebra.layout_of(module) if module is not None else None
    return lay is not None and (not lay.bias or getattr(module, lay.bias, None) is None)


def _returns_one_tensor(module) -> bool:
    """Modules whose forward returns a single tensor, so a forward hook can recentre it."""
    if module is None:
        return False
    if isinstance(module, (nn.MultiheadAttention, nn.RNNBase, nn.Transformer)):
        return False
    return type(module).__module__.startswith("torch.nn.modules") or isinstance(module, nn.LayerNorm)

