"""The shift walk: where a per-row shift of a tensor goes — absorbed by the norms it reaches, returned in an
output that may come back recentred (ok), or seen by some op (why not). Writers are centrable only when
every shift of their output is absorbed (propagate.py's pass 1); explicit Recenters use it too."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from .graph import Graph, Node, where
from .rules import ABSORBED, NormRule, rule_for

STREAM_OUTPUTS = ("*last_hidden_state",)


@dataclass
class ShiftResult:
    """Where a per-row shift of a tensor goes: absorbed by norms / returned in a stream output (ok), or
    seen by something (`why`)."""

    ok: bool
    why: str | None = None  # what sees it: "gelu in h.0.mlp", "the model output 'pooler_output'"
    outputs: frozenset[int] = frozenset()
    norms: frozenset[str] = frozenset()  # the norm ops that absorb it



def recentrable_outputs(graph: Graph, patterns: tuple[str, ...] = ()) -> frozenset[int]:
    """Output leaves that carry the stream and may come back recentred: hidden states (as verify
    accepts them), a last_hidden_state that is the raw stream (no final norm: CLIP's vision tower,
    as its adapter does), and the user's `patterns`. Pooled outputs, logits, embeddings: never."""
    from ..forward import CENTERED_OUTPUTS

    patterns = tuple(CENTERED_OUTPUTS) + STREAM_OUTPUTS + tuple(patterns)
    names = graph.output_names or []
    return frozenset(i for i, name in enumerate(names) if name is not None and any(
        name == p or fnmatch.fnmatchcase(name, p) for p in patterns))


class ShiftWalk:
    """Follows shifts through `graph`, memoising per (node, axis); `recentrable` are the output leaves a
    shift may reach."""

    def __init__(self, graph: Graph, recentrable: frozenset[int]):
        self.graph, self.recentrable = graph, recentrable
        self._shift: dict[tuple[str, int], ShiftResult] = {}

    def _output_name(self, i: int) -> str:
        names = self.graph.output_names or []
        return f"'{names[i]}'" if i < len(names) and names[i] else f"#{i}"

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
                bad = sorted(hits - self.recentrable)
                if bad:
                    return ShiftResult(False, f"the model output {self._output_name(bad[0])}, which would come back "
                                              "recentred (allow it with recentred_outputs=...)")
                outputs |= hits
            elif r == ABSORBED:
                if isinstance(rule_for(user), NormRule):
                    norms.add(user.name)
            elif r is None:
                return ShiftResult(False, f"{user.op} in {where(user)}")
            else:
                sub = self._shift[(user.name, r)]
                if not sub.ok:
                    return sub
                outputs |= sub.outputs
                norms |= sub.norms
        return ShiftResult(True, None, frozenset(outputs), frozenset(norms))
