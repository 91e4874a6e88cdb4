"""Pass 3 of the analysis: each norm's readers. The linear (or conv) modules that read a norm's output over
its normalized dim, through views, eval dropout and token selection, take its γ/β when folded; a reader
called on other inputs too cannot. `beta_cancels` finds bias-free readers whose β term cancels in a
softmax over keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from .. import algebra
from .graph import Graph, Node, where
from .rules import ABSORBED, Dropout, GetItem, Meta, Mix, Scale, Structural, Sum, WriterRule, dim_arg, rule_for


@dataclass
class NormCall:
    node: Node
    input_state: object
    readers: list[str]  # linear modules reading the output over its normalized dim
    reader_problem: str | None  # why the affine cannot move into the readers (None: it can)
    final: bool  # the output (also) leaves the model
    reader_ops: list[Node] = field(default_factory=list)
    beta_cancels: list[str] = field(default_factory=list)  # bias-less readers whose β term cancels


def norm_readers(node: Node, modules: dict[str, nn.Module]) -> tuple[list[Node], str | None, bool]:
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
                    if _is_linear_reader(user, rule, modules):
                        if user not in readers:
                            readers.append(user)
                        continue
                elif isinstance(rule, WriterRule) and rule.conv and pos == rule.input_pos and \
                        axis == rule.out_axis(user) and _is_conv_reader(user, rule, modules):
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
                problem = problem or f"its output also feeds {user.op} in {where(user)}"
    return readers, problem, final


def mark_shared_readers(graph: Graph, norm_calls: list[NormCall], norm_name: Callable[[Node], str]) -> None:
    """Folding γ into a reader changes every call of it: each of its calls must read this norm."""
    calls: dict[str, int] = {}
    for n in graph.nodes:
        rule = rule_for(n)
        if isinstance(rule, WriterRule) and n.module:
            calls[n.module] = calls.get(n.module, 0) + 1
    reads: dict[str, list[tuple[NormCall, Node]]] = {}
    for nc in norm_calls:
        for op in nc.reader_ops:
            reads.setdefault(op.module, []).append((nc, op))
    for module, lst in reads.items():
        norms = {norm_name(nc.node) for nc, _ in lst}
        if len(norms) > 1 or len({op.name for _, op in lst}) < calls.get(module, 0):
            for nc, _ in lst:
                nc.reader_problem = nc.reader_problem or f"its reader {module} is also called on other inputs"


def beta_cancels(reader: Node) -> bool:
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
                step = _cancel_step(user, pos, axis, scores)
                if step is None:
                    return False
                if step is not ABSORBED:
                    stack.append((user,) + step)
    return True


def _cancel_step(user: Node, pos, axis: int, scores: bool):
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


def _is_conv_reader(node: Node, rule: WriterRule, modules: dict[str, nn.Module]) -> bool:
    """A ConvNd module reading the norm over its input channels with no zero padding (so a constant β
    input gives a constant output and folds into the bias: algebra.fold_affine_conv)."""
    module = modules.get(node.module)
    w = rule.weight(node)[0]
    return (module is not None and algebra.is_conv_reader(module) and w is not None
            and getattr(module, "weight", None) is w.value)


def _is_linear_reader(node: Node, rule: WriterRule, modules: dict[str, nn.Module]) -> bool:
    module = modules.get(node.module)
    if module is None or not algebra.is_linear_reader(module):
        return False
    lay = algebra.layout_of(module)
    w, out_dim, _ = rule.weight(node)
    return w is not None and getattr(module, lay.weight, None) is w.value and lay.out_dim == out_dim


def bias_free(module) -> bool:
    lay = algebra.layout_of(module) if module is not None else None
    return lay is not None and (not lay.bias or getattr(module, lay.bias, None) is None)
