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

This module runs the passes and is the context the op rules ask (`state`, `where`, `cause_of`); pass 1
is writers.py, the shift walk it relies on shift.py, the readers of pass 3 readers.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .graph import Graph, Node, where
from .readers import NormCall, beta_cancels, bias_free, mark_shared_readers, norm_readers
from .rules import Cause, NormRule, NotZeroMean, ZeroMean, not_zero_mean, rule_for
from .shift import STREAM_OUTPUTS, ShiftResult, ShiftWalk, recentrable_outputs
from .writers import WriterCall, WriterInfo, WriterPass, param_aliases

__all__ = ["Options", "Propagation", "NormCall", "ShiftResult", "WriterCall", "WriterInfo", "SOURCE_KINDS",
           "STREAM_OUTPUTS"]

SOURCE_KINDS = ("input", "param", "buffer", "constant", "get_attr")


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



class Propagation:
    """Runs the three passes over `graph` for `model`; results in `states`, `writers`, `norm_calls`."""

    def __init__(self, graph: Graph, model: nn.Module, options: Options = Options()):
        self.graph, self.model, self.options = graph, model, options
        self.modules = graph.modules
        self.aliases = param_aliases(model)
        self.states: dict[str, object] = {}
        self.calls: dict[str, WriterCall] = {}  # node name -> the writer call it performs
        self.writers: dict[str, WriterInfo] = {}
        self.recenters: dict[str, str | None] = {}  # module -> problem (None: may be recentred)
        self.recenter_outputs: dict[str, frozenset[int]] = {}
        self.norm_calls: list[NormCall] = []
        self.recentrable_outputs = recentrable_outputs(graph, options.recentred_outputs)
        self.shift = ShiftWalk(graph, self.recentrable_outputs)

    @classmethod
    def empty(cls, model: nn.Module, options: Options = Options()) -> "Propagation":
        """For a model without LayerNorms: nothing to trace."""
        return cls(Graph([Node("output", "output", args=([],))], "none", dict(model.named_modules())), model, options)

    # ---- context the rules use ---------------------------------------------------------------------
    def state(self, x):
        return self.states.get(x.name) if isinstance(x, Node) else None

    def where(self, node: Node) -> str:
        return where(node)

    def num_outputs(self, node: Node) -> int:
        return max([u.arg(1) + 1 for u in node.users if u.op == "getitem" and isinstance(u.arg(1), int)] or [1])

    def cause_of(self, node: Node) -> Cause:
        src = next((s for _, s in node.inputs() if s.op not in SOURCE_KINDS), None)
        if src is not None and src.module and not _inside(node.module, src.module):
            return Cause(f"the output of {node.op} after {src.module} (not zero-mean)", node.name)
        return Cause(f"the output of {node.op} in {self.where(node)} (not zero-mean)", node.name)

    # ---- pass 1: writers (writers.py) --------------------------------------------------------------------
    def find_writers(self) -> None:
        found = WriterPass(self.graph, self.aliases, self.shift, self.options.center_embeddings).run()
        self.calls, self.writers = found.calls, found.writers

    def shift_of(self, start: Node, axis: int, only=None) -> ShiftResult:
        """Follow a per-row shift of `start` along `axis` to norms that absorb it / ops that see it."""
        return self.shift.shift_of(start, axis, only)

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

    # ---- pass 3: norms (readers.py) -----------------------------------------------------------------------
    def judge_norms(self) -> None:
        for node in self.graph.nodes:
            if isinstance(rule_for(node), NormRule):
                ops, problem, final = norm_readers(node, self.modules)
                readers = list(dict.fromkeys(op.module for op in ops))
                cancels = [op.module for op in ops if bias_free(self.modules.get(op.module)) and beta_cancels(op)]
                self.norm_calls.append(NormCall(node, self.states.get(node.arg(0).name), readers, problem, final, ops,
                                                list(dict.fromkeys(cancels))))
        mark_shared_readers(self.graph, self.norm_calls, self.norm_name)

    def beta_cancels(self, reader: Node) -> bool:
        return beta_cancels(reader)

    def run(self) -> "Propagation":
        self.find_writers()
        self.forward()
        self.judge_norms()
        return self


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def _returns_one_tensor(module) -> bool:
    """Modules whose forward returns a single tensor, so a forward hook can recentre it."""
    if module is None:
        return False
    if isinstance(module, (nn.MultiheadAttention, nn.RNNBase, nn.Transformer)):
        return False
    return type(module).__module__.startswith("torch.nn.modules") or isinstance(module, nn.LayerNorm)

