"""The op rules: how each op carries the zero-mean property, as a registry keyed by canonical op name.

Two questions are asked of every op (see propagate.py for the passes that ask them):

- forward: if the inputs are zero-mean along some axis (once certain writers are centred), is
  the output? Structural ops (view, permute, dropout in eval, dtype casts, ...) move the axis;
  sums (add, sub, cat) need ALL operands zero-mean along the same axis; scaling by something
  constant along the axis keeps it; everything else (activations, softmax, products, ...) makes
  the output not zero-mean — and says so, naming the op and its module.
- shift: centring a writer subtracts a per-row constant (along the writer's output axis) from its
  output. Does that change reach the op's output as a per-row constant too (and along which axis),
  is it absorbed (a LayerNorm over that axis: LN(x + k) = LN(x)), or does the op see it (None)?
  A writer may only be centred when every path from it ends in an absorbing norm or a model
  output (which is then returned recentred).

Axes are negative dims (-1 = last), so broadcasting aligns them for free.
Writers (linear, conv, embedding, ...) and norms are marker rules; propagate.py handles them
because they need the model (parameters, modules, layouts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .graph import Node

ABSORBED = "absorbed"  # shift result: the op does not see a per-row shift of this input


# ---- states -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cause:
    """Why a tensor is not zero-mean: a sentence naming the op and module, and where it arose."""

    text: str
    node: str = ""  # the node whose output is the culprit
    kind: str = "op"
    module: str = ""


@dataclass(frozen=True)
class ZeroMean:
    """Zero-mean along `axis` for every input, once `writers` are centred (and `recenters` added).
    `assumes`: norms whose output counts as zero-mean only for their current values (γ constant,
    β = 0), not for every weight value (training would break it)."""

    axis: int
    writers: frozenset[str] = frozenset()
    recenters: frozenset[str] = frozenset()
    assumes: frozenset[str] = frozenset()


@dataclass(frozen=True)
class NotZeroMean:
    causes: tuple[Cause, ...]
    writers: frozenset[str] = frozenset()  # centrable parts it also contains (for the report)


@dataclass(frozen=True)
class Zero:
    """An all-zero tensor (zeros_like accumulators): zero-mean along every dim, adds nothing."""


@dataclass(frozen=True)
class Multi:
    """The states of a multi-output op (split, chunk, ...), read by getitem."""

    items: tuple


State = ZeroMean | NotZeroMean | Zero | Multi | None
MAX_CAUSES = 6


def writers_of(states) -> frozenset[str]:
    out: frozenset[str] = frozenset()
    for s in states:
        if isinstance(s, (ZeroMean, NotZeroMean)):
            out |= s.writers
    return out


def not_zero_mean(causes, states=()) -> NotZeroMean:
    seen, uniq = set(), []
    for c in causes:
        if c.text not in seen:
            seen.add(c.text)
            uniq.append(c)
    return NotZeroMean(tuple(uniq[:MAX_CAUSES]), writers_of(states))


def conjoin(states: list, node: Node, ctx) -> State:
    """AND over the operands of a sum: zero-mean iff all are, along the same axis."""
    states = [s for s in states if not isinstance(s, Zero)]
    if not states:
        return Zero()
    causes = [c for s in states if isinstance(s, NotZeroMean) for c in s.causes]
    if any(not isinstance(s, (ZeroMean, NotZeroMean)) for s in states):
        causes.append(ctx.cause_of(node))
    if causes:
        return not_zero_mean(causes, states)
    axes = {s.axis for s in states}
    if len(axes) > 1:
        return not_zero_mean([Cause(f"a sum in {ctx.where(node)} of tensors zero-mean along different dims "
                                    f"({', '.join(map(str, sorted(axes)))})", node.name, "axis")], states)
    return ZeroMean(axes.pop(), writers_of(states), frozenset().union(*(s.recenters for s in states)),
                    frozenset().union(*(s.assumes for s in states)))


# ---- axis helpers -------------------------------------------------------------------------------------

def pos_axis(axis: int, rank: int) -> int:
    return axis + rank


def dim_arg(d, rank: int) -> int:
    return d + rank if d < 0 else d


def reshape_axis(in_shape, out_shape, axis: int) -> int | None:
    """The output dim that carries input dim `axis` unchanged through a reshape, if any: the same size,
    and the same number of elements before it (then every row along it maps to a row)."""
    if in_shape is None or out_shape is None:
        return None
    p = pos_axis(axis, len(in_shape))
    if not 0 <= p < len(in_shape):
        return None
    before, size = math.prod(in_shape[:p]), in_shape[p]
    for q in range(len(out_shape)):
        if out_shape[q] == size and math.prod(out_shape[:q]) == before:
            return q - len(out_shape)
    return None


def const_along(x, axis: int, out_rank: int) -> bool:
    """True if operand `x` is constant along output axis `axis` (a scalar, or a broadcast size-1 dim)."""
    if not isinstance(x, Node):
        return True
    if x.shape is None:
        return False
    k = -axis
    return len(x.shape) < k or x.shape[len(x.shape) - k] == 1


# ---- rules ------------------------------------------------------------------------------------------------

class Rule:
    """Default: the op is not known to preserve zero mean, and it sees shifts of its inputs."""

    kind = "kill"
    doc = "output is not zero-mean; a shift of any input changes it"
    transparent = False  # same numbers, rearranged: a norm's linear readers may sit behind it

    def forward(self, node: Node, ctx) -> State:
        states = [ctx.state(src) for _, src in node.inputs()]
        return not_zero_mean([ctx.cause_of(node)], states)

    def shift(self, node: Node, pos, axis: int):
        return None


class Meta(Rule):
    """Ops that read only shapes/dtypes (size, metadata asserts): no value flows through them."""

    kind = "ignore"
    doc = "reads only metadata (shape, dtype): ignored"

    def forward(self, node, ctx):
        return None

    def shift(self, node, pos, axis):
        return ABSORBED


class Zeros(Rule):
    """zeros / zeros_like / new_zeros: a fresh all-zero tensor."""

    kind = "zero"
    doc = "an all-zero tensor: zero-mean along every dim, neutral in sums"

    def forward(self, node, ctx):
        return Zero()

    def shift(self, node, pos, axis):
        return ABSORBED  # reads only the shape of its argument


class Structural(Rule):
    """One tensor in, the same numbers rearranged out: the zero-mean axis moves (or is destroyed)."""

    kind = "keep"
    doc = "keeps the state; the zero-mean axis follows the data (killed if the op splits/slices it)"
    transparent = True

    def __init__(self, mapper, meta_args: tuple = ()):
        self.mapper = mapper
        self.meta_args = meta_args  # positions that only contribute metadata (type_as's other)

    def forward(self, node: Node, ctx) -> State:
        src = node.arg(0)
        s = ctx.state(src)
        if isinstance(s, Zero):
            return s
        if isinstance(s, ZeroMean):
            axis = self.mapper(node, s.axis)
            if axis is None:
                return not_zero_mean([Cause(f"{node.op} in {ctx.where(node)}, which splits or slices the zero-mean "
                                            f"feature dim", node.name, "axis")], [s])
            return replace(s, axis=axis)
        if isinstance(s, NotZeroMean):
            return s
        return not_zero_mean([ctx.cause_of(node)])

    def shift(self, node: Node, pos, axis: int):
        if pos in self.meta_args:
            return ABSORBED
        return self.mapper(node, axis) if pos == 0 else None


def same_axis(node, axis):
    return axis


def _reshape(node, axis):
    return reshape_axis(node.arg(0).shape, node.shape, axis)


def _expand(node, axis):
    src = node.arg(0)
    if src.shape is None or node.shape is None or -axis > len(src.shape):
        return None
    return axis if src.shape[axis] == node.shape[axis] else None


def _permute(node, axis):
    dims = [dim_arg(d, node.rank) for d in node.arg(1, "dims")]
    p = pos_axis(axis, node.rank)
    return dims.index(p) - node.rank if p in dims else None


def _transpose(node, axis):
    rank = node.rank
    if node.op in ("t", "numpy_T") or rank is None:
        d0, d1 = 0, 1
    else:
        d0, d1 = dim_arg(node.arg(1, "dim0"), rank), dim_arg(node.arg(2, "dim1"), rank)
    p = pos_axis(axis, rank)
    p = d1 if p == d0 else d0 if p == d1 else p
    return p - rank


def _select(node, axis):
    src = node.arg(0)
    in_rank = src.rank
    d, p = dim_arg(node.arg(1, "dim"), in_rank), pos_axis(axis, in_rank)
    if d == p:
        return None
    return axis if d < p else axis + 1


def _slice(node, axis):
    src = node.arg(0)
    in_rank = src.rank
    d, p = dim_arg(node.arg(1, "dim", 0), in_rank), pos_axis(axis, in_rank)
    if d != p:
        return axis
    return axis if node.shape is not None and node.shape[p] == src.shape[p] else None  # a full slice


def _index(node, axis):
    """aten.index.Tensor(x, [idx or None per dim]): fine when only dims before the axis are indexed
    and the dims from the axis on are untouched."""
    src = node.arg(0)
    p = pos_axis(axis, src.rank)
    indices = list(node.arg(1, "indices") or [])
    if any(ix is not None for ix in indices[p:]):
        return None
    same_tail = node.shape is not None and tuple(node.shape[axis:]) == tuple(src.shape[axis:])
    return axis if same_tail else None


def _tensor_getitem(node, axis):
    """x[...] from a symbolic trace: plain slices/ints/None before the axis, full slices from it on."""
    src = node.arg(0)
    idx = node.arg(1)
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(i is Ellipsis for i in idx):
        k = idx.index(Ellipsis)
        fill = src.rank - (len([i for i in idx if i is not None]) - 1)
        idx = idx[:k] + (slice(None),) * fill + idx[k + 1:]
    p = pos_axis(axis, src.rank)
    dim = 0
    for i in idx:
        if i is None:
            if dim > p:
                return None
            continue
        if dim >= p and i != slice(None):
            return None
        dim += 1
    if node.shape is None or tuple(node.shape[axis:]) != tuple(src.shape[axis:]):
        return None
    return axis


def _gather(node, axis):
    """gather(x, dim, index) picking whole rows: dim is not the axis and the index is constant along it
    (a constant fill, or an expand of a size-1 dim: HF's "select token k" pattern)."""
    src, index = node.arg(0), node.arg(2, "index")
    p = pos_axis(axis, src.rank)
    if dim_arg(node.arg(1, "dim"), src.rank) == p or not isinstance(index, Node):
        return None
    if index.op in ("full_like", "full", "new_full", "zeros_like", "zeros"):  # one constant index
        return axis
    if index.op in ("expand", "expand_as", "broadcast_to", "repeat") and isinstance(index.arg(0), Node):
        base = index.arg(0)
        if base.shape is not None and len(base.shape) == index.rank and base.shape[p] == 1:
            return axis
    return None


def _unbind_like(node, axis):
    """split/chunk keep the rank; unbind drops the split dim."""
    src = node.arg(0)
    default = 0
    dim = node.arg(2, "dim", default) if node.op in ("split", "split_with_sizes", "tensor_split") else \
        node.arg(1, "dim", default) if node.op == "unbind" else node.arg(2, "dim", default)
    d, p = dim_arg(dim, src.rank), pos_axis(axis, src.rank)
    if d == p:
        return None
    if node.op == "unbind" and d > p:
        return axis + 1
    return axis


def _spatial(node, axis):
    """Resampling / average pooling over the trailing k spatial dims of (N, C, *spatial): the output
    at each position is a combination of input positions whose weights are the same for every channel
    (interpolation, antialias filters, averaging windows), so zero mean along N or C survives and a
    per-row shift along C stays one. Along a spatial dim (the feature axis resampled) it does not."""
    src = node.arg(0)
    rank = src.rank if isinstance(src, Node) else None
    if rank is None or node.rank != rank:
        return None
    k = _spatial_dims(node.op, rank)
    p = pos_axis(axis, rank)
    return axis if 0 <= p < rank - k else None


def _spatial_dims(op: str, rank: int) -> int:
    for k in (1, 2, 3):
        if f"{k}d" in op:
            return k
    return rank - 2  # fx's F.interpolate / avg pools: every dim after (N, C)


def _reduce(node, axis):
    """mean / sum over dims other than the zero-mean one (mean pooling over tokens): each output row is
    a sum of input rows, so zero mean along the axis and per-row shifts along it survive."""
    src = node.arg(0)
    rank = src.rank if isinstance(src, Node) else None
    dims = node.arg(1, "dim")
    if rank is None or dims is None or node.rank is None:
        return None  # a full reduction
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims:
        return None
    dims = sorted(dim_arg(d, rank) for d in dims)
    p = pos_axis(axis, rank)
    if p in dims:
        return None
    if node.rank == rank:  # keepdim
        return axis
    return p - sum(d < p for d in dims) - node.rank


class Mix(Structural):
    """A linear map along non-feature dims with the same weights for every channel (resampling, pooling,
    mean over tokens): keeps the state like a structural op, but its weights need not sum to one (sum,
    padded average pools), so a norm's affine cannot move past it: not transparent to reader search."""

    kind = "mix positions"
    doc = "linear along non-feature dims, same weights per channel: keeps the state (not along the feature dim)"
    transparent = False


class Dropout(Structural):
    """Identity in eval mode (or p = 0); in training its random elementwise mask breaks zero mean."""

    kind = "keep (eval)"
    doc = "identity in eval mode; in training mode the random mask breaks zero mean"

    def __init__(self):
        super().__init__(same_axis)

    @staticmethod
    def active(node: Node) -> bool:
        p, train = node.arg(1, "p", 0.5), node.arg(2, "train", True)
        return bool(train) and float(p) > 0

    def forward(self, node, ctx):
        if self.active(node):
            s = ctx.state(node.arg(0))
            return not_zero_mean([Cause(f"dropout in training mode in {ctx.where(node)} (p={node.arg(1)}: its "
                                        "random mask breaks zero mean; analyze the model in eval mode)",
                                        node.name, "dropout", ctx.where(node))], [s])
        return super().forward(node, ctx)

    def shift(self, node, pos, axis):
        return None if self.active(node) else super().shift(node, pos, axis)


class Sum(Rule):
    """add / sub / rsub: zero-mean iff every operand is (along the same axis); shifts pass through."""

    kind = "and"
    doc = "zero-mean iff every operand is, along the same dim; a shift of an operand passes through"

    def forward(self, node, ctx):
        states = []
        for x in (node.arg(0), node.arg(1, "other")):
            if isinstance(x, Node):
                s = ctx.state(x)
                if isinstance(s, ZeroMean) and const_along(x, s.axis, node.rank):
                    s = not_zero_mean([Cause(f"a sum in {ctx.where(node)} broadcasting {x.name} along its "
                                             "zero-mean dim", node.name, "axis")])
                states.append(s)
            elif isinstance(x, (int, float)) and x != 0:
                states.append(not_zero_mean([Cause(f"the constant {x:g} added in {ctx.where(node)}",
                                                   node.name, "constant")]))
        return conjoin(states, node, ctx)

    def shift(self, node, pos, axis):
        return axis if pos in (0, 1, "other") else None


class Cat(Rule):
    kind = "and"
    doc = "zero-mean iff every piece is, along a dim other than the concatenated one"

    def forward(self, node, ctx):
        tensors = list(node.arg(0, "tensors"))
        states = [ctx.state(t) for t in tensors]
        out = conjoin(states, node, ctx)
        if isinstance(out, ZeroMean) and self.shift(node, 0, out.axis) is None:
            return not_zero_mean([Cause(f"cat along the zero-mean feature dim in {ctx.where(node)}",
                                        node.name, "axis")], states)
        return out

    def shift(self, node, pos, axis):
        if pos not in (0, "tensors"):
            return None
        d = dim_arg(node.arg(1, "dim", 0), node.rank)
        return None if d == pos_axis(axis, node.rank) else axis


class Scale(Rule):
    """mul / div by something constant along the zero-mean axis (a scalar, a per-row factor)."""

    kind = "scale"
    doc = "keeps the state when the other factor is constant along the zero-mean dim"

    def operands(self, node):
        a, b = node.arg(0), node.arg(1, "other")
        if node.op == "div":  # only the numerator may be the zero-mean one
            return [(0, a, b)]
        return [(0, a, b), (1, b, a)]

    def forward(self, node, ctx):
        for _, x, other in self.operands(node):
            s = ctx.state(x) if isinstance(x, Node) else None
            if isinstance(s, Zero) or isinstance(s, ZeroMean) and const_along(other, s.axis, node.rank):
                return s
        states = [ctx.state(x) for x in node.args[:2] if isinstance(x, Node)]
        causes = [c for st in states if isinstance(st, NotZeroMean) for c in st.causes]
        return not_zero_mean(causes or [ctx.cause_of(node)], states)

    def shift(self, node, pos, axis):
        for p, x, other in self.operands(node):
            if p == pos and const_along(other, axis, node.rank):
                return axis
        return None


class Neg(Structural):
    kind = "scale"
    doc = "negation keeps the state"
    transparent = False

    def __init__(self):
        super().__init__(same_axis)


class RowMix(Rule):
    """A @ V (matmul/bmm with a non-parameter right side, attention): rows of the output are linear
    combinations of rows of V, so the output is zero-mean along -1 iff V is."""

    kind = "mix rows"
    doc = "A @ V: zero-mean along the last dim iff V is (attention outputs, matmul without weights)"

    def __init__(self, value_pos: int):
        self.value_pos = value_pos

    def forward(self, node, ctx):
        v = node.arg(self.value_pos)
        s = ctx.state(v) if isinstance(v, Node) else None
        if isinstance(s, ZeroMean) and s.axis == -1 and v.rank and v.rank >= 2:
            return replace(s, axis=-1)
        return Rule.forward(self, node, ctx)

    def shift(self, node, pos, axis):
        v = node.arg(self.value_pos)
        return -1 if pos == self.value_pos and axis == -1 and v.rank and v.rank >= 2 else None


class Split(Structural):
    kind = "keep"
    doc = "each piece keeps the state when the split dim is not the zero-mean one"

    def __init__(self):
        super().__init__(_unbind_like)

    def forward(self, node, ctx):
        s = ctx.state(node.arg(0))
        n = ctx.num_outputs(node)
        if isinstance(s, ZeroMean):
            axis = self.mapper(node, s.axis)
            if axis is not None:
                return Multi((replace(s, axis=axis),) * n)
        return Multi((super().forward(node, ctx),) * n)


class GetItem(Rule):
    kind = "keep"
    doc = "an element of a split keeps its state"
    transparent = True

    def forward(self, node, ctx):
        s = ctx.state(node.arg(0))
        if isinstance(s, Multi) and isinstance(node.arg(1), int) and node.arg(1) < len(s.items):
            return s.items[node.arg(1)]
        return Rule.forward(self, node, ctx)

    def shift(self, node, pos, axis):
        return axis if pos == 0 else None


# ---- markers handled by propagate.py ---------------------------------------------------------------

class WriterRule(Rule):
    """An op that computes x·W (+ b) or looks up W[ids]: centring W over its output axis makes the
    output zero-mean for every input (paper 001 Lemma 3.1; conv: over output channels).

    `weight_out_dim`: the weight's output axis in this op's convention (linear: 0, addmm: 1);
    convs write their zero-mean axis at the channel dim."""

    kind = "writer"
    doc = "output is zero-mean once its weights are centred (allowed if nothing but norms sees the change)"

    def __init__(self, input_pos: int, weight_pos: int, bias_pos: int | None = None, weight_out_dim: int = 0,
                 conv: bool = False, groups_pos: int | None = None, transposable: bool = False):
        self.input_pos, self.weight_pos, self.bias_pos = input_pos, weight_pos, bias_pos
        self.weight_out_dim, self.conv, self.groups_pos = weight_out_dim, conv, groups_pos
        self.transposable = transposable

    def weight(self, node: Node) -> tuple[Node | None, int, Node | None]:
        """(the weight's parameter node, its output dim, the transpose node in between if any). For
        mm/matmul the right side may be W.T of a 2-D parameter (x @ self.weight.T, as Falcon writes it)."""
        w = node.arg(self.weight_pos)
        if not isinstance(w, Node) or w.op == "param" or len(w.users) != 1 or not isinstance(w.arg(0), Node) \
                or w.arg(0).op != "param":
            return (w if isinstance(w, Node) and w.op == "param" else None), self.weight_out_dim, None
        if self.transposable and w.op in ("t", "transpose", "numpy_T") and w.rank == 2:
            return w.arg(0), 1 - self.weight_out_dim, w
        # A slice of the weight along an input dim (BLOOM's pretraining_tp: F.linear(x_i, W[:, i])):
        # each slice of a weight centred over its output dim is centred too.
        if w.op in ("slice", "narrow") and dim_arg(w.arg(1, "dim", 0), w.rank) != self.weight_out_dim:
            return w.arg(0), self.weight_out_dim, w
        return None, self.weight_out_dim, None

    def out_axis(self, node: Node) -> int:
        if not self.conv:
            return -1
        x, w = node.arg(self.input_pos), node.arg(self.weight_pos)
        batched = x.rank == w.rank
        return (1 if batched else 0) - node.rank

    def shift(self, node, pos, axis):
        return None  # x + k·1 read by x·W changes by k·(1ᵀW): not a per-row shift


class NormRule(Rule):
    """layer_norm(x, shape, γ, β): absorbs shifts along the normalized last dim; its output is
    γ⊙n + β, zero-mean only without affine (or γ constant and β = 0)."""

    kind = "norm"
    doc = "absorbs a per-row shift of its input; output zero-mean only without affine"
    input_pos, weight_pos, bias_pos = 0, 2, 3

    def shift(self, node, pos, axis):
        shape = node.arg(1, "normalized_shape")
        return ABSORBED if pos == 0 and axis == -1 and len(shape) == 1 else None


# ---- the table --------------------------------------------------------------------------------------------

RULES: dict[str, Rule] = {}


def register_rule(rule: Rule, *ops: str) -> None:
    """Teach the analysis an op (canonical name: ATen op name, or the fx function/method name)."""
    for op in ops:
        RULES[op] = rule


register_rule(Meta(), "_assert_tensor_metadata", "_assert_scalar", "sym_size", "sym_numel", "sym_stride", "size",
              "dim", "numel", "getattr", "_assert_async", "sym_constrain_range_for_size", "empty_like", "ones_like",
              "full_like", "rand_like", "randn_like", "new_ones", "new_empty", "new_full")
register_rule(Zeros(), "zeros", "zeros_like", "new_zeros")
register_rule(Structural(same_axis), "alias", "clone", "contiguous", "detach", "lift_fresh_copy", "_to_copy", "to",
              "identity")
register_rule(Structural(same_axis, meta_args=(1, "other")), "type_as")
register_rule(Structural(_reshape), "view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze",
              "unsqueeze", "view_as", "reshape_as")
register_rule(Structural(_expand), "expand", "expand_as", "broadcast_to")
register_rule(Structural(_permute), "permute")
register_rule(Structural(_transpose), "transpose", "t", "swapaxes", "numpy_T")
register_rule(Structural(_select), "select")
register_rule(Structural(_slice), "slice", "narrow")
register_rule(Structural(_index), "index")
register_rule(Structural(_gather), "gather")
register_rule(Structural(_tensor_getitem), "tensor_getitem")
register_rule(Mix(_spatial), "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
              "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
              "upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d",
              "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa", "interpolate", "upsample",
              "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
              "adaptive_avg_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d")
register_rule(Mix(_reduce), "mean", "sum")
register_rule(Dropout(), "dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout")
register_rule(Sum(), "add", "sub", "rsub")
register_rule(Cat(), "cat")
register_rule(Scale(), "mul", "div")
register_rule(Neg(), "neg")
register_rule(RowMix(1), "bmm")
register_rule(RowMix(2), "scaled_dot_product_attention")
register_rule(Split(), "split", "split_with_sizes", "chunk", "unbind", "tensor_split")
register_rule(GetItem(), "getitem")
register_rule(WriterRule(input_pos=0, weight_pos=1, bias_pos=2, weight_out_dim=0), "linear")
register_rule(WriterRule(input_pos=1, weight_pos=2, bias_pos=0, weight_out_dim=1), "addmm")
register_rule(WriterRule(input_pos=0, weight_pos=1, weight_out_dim=1, transposable=True), "mm", "matmul")
register_rule(WriterRule(input_pos=1, weight_pos=0, weight_out_dim=1), "embedding")
for _k in (1, 2, 3):
    register_rule(WriterRule(input_pos=0, weight_pos=1, bias_pos=2, weight_out_dim=0, conv=True, groups_pos=6),
                  f"conv{_k}d")
register_rule(WriterRule(input_pos=0, weight_pos=1, bias_pos=2, weight_out_dim=0, conv=True, groups_pos=8),
              "convolution")
register_rule(NormRule(), "layer_norm")

DEFAULT_RULE = Rule()
MATMUL_MIX = RowMix(1)


def rule_for(node: Node) -> Rule:
    rule = RULES.get(node.op, DEFAULT_RULE)
    # matmul/mm with a non-parameter right side mixes rows (attention probs @ V); with a weight it writes.
    if isinstance(rule, WriterRule) and node.op in ("mm", "matmul") and rule.weight(node)[0] is None:
        return MATMUL_MIX
    return rule
