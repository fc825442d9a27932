"""Turn the dataflow's obligations into a rewrite plan, or into reasons it cannot be exact.

A *demand* (a shared tensor that must be tower-sized) is met, in order of preference:

- at the tensor itself when it is computed once outside the towers' loops from shared values
  (a zero state, a ``ones([batch, steps])`` weight, a constant): the original keeps its name
  and its value and each tower reads its own rows of it (``split``) — so a driver that feeds
  the zero state by name still controls every tower;
- at its producer: a ``Fill``/random op/``Tile``/``Reshape``/``BroadcastTo`` gets the tower's
  count in its shape operand (a *position*), a ``Range`` over the batch size numbers the
  tower's rows, a constant inside gradient code is resized (``const``), and identities,
  elementwise ops and loop plumbing pass the demand on to their inputs;
- otherwise each tower computes the single-device value and keeps its rows (``slice``).

A demanded placeholder or iterator output is a batch input (``promote``); a demanded variable
cannot be resized and is a reason. A *position* is met by rewriting the integer constant that
holds the batch size there (``element``), or a fed scalar (``substitute``); anything else is a
reason. ``Mean`` gradients with a static element count get their divisor scaled (``factor``).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
from tensorflow.core.framework import types_pb2

from replicate.batchflow import table
from replicate.batchflow.context import Context, Demand, Position
from replicate.batchflow.facts import Plan, Reason
from replicate.batchflow.lattice import MIXED, PART, RED, Sym
from replicate.batchflow.roles import forward_op_of
from replicate.batchflow.rules.layout import map_reshape
from replicate.graph import ops
from replicate.graph.ir import IR, node_of, parse_tensor, tensor_name

__all__ = ["Plan", "resolve", "frame_depths"]

log = logging.getLogger(__name__)

def frame_depths(ir: IR, order: list[str]) -> dict[str, int]:
    """How many TF1 loop frames each region node is inside (0 outside every loop)."""
    depth: dict[str, int] = {}
    for name in order:
        node = ir.nodes[name]
        deps = [node_of(r) for r in node.inputs] + list(node.control)
        base = max((depth.get(d, 0) for d in deps if ir.nodes.get(d) is None
                    or ir.nodes[d].op not in ("NextIteration", "RefNextIteration")), default=0)
        if node.op in ("Enter", "RefEnter"):
            base += 1
        elif node.op in ("Exit", "RefExit"):
            base = max(0, base - 1)
        depth[name] = base
    return depth


#: Ops whose gradient, taken on some rows of their output, is those rows' share of the whole.
#: (Not a concatenation or a stack along the rows: their gradients cut the rows at the
#: global offsets, which a tower's rows do not have.)
_ROW_BY_ROW = frozenset({"ReadVariableOp", "Tile", "BroadcastTo", "Cast", "Reshape", "ExpandDims",
                         "Squeeze", "Fill", "ZerosLike", "OnesLike", "Shape",
                         "StridedSlice", "Slice", "GatherV2", "Transpose"})


class _Resolver:
    def __init__(self, ctx: Context, plan: Plan, depths: dict[str, int], scopes: list[str]):
        self.ctx, self.ir, self.plan, self.depths, self.scopes = ctx, ctx.ir, plan, depths, scopes
        self.seen: set[tuple] = set()

    def reason(self, node: str, what: str, fix: str) -> None:
        if not any(r.node == node and r.what == what for r in self.plan.reasons):
            self.plan.reasons.append(Reason(node, what, fix))

    def unsplittable(self, node: str, what: str, fix: str) -> None:
        self.reason(node, what, fix)
        if not any(r.node == node and r.what == what for r in self.plan.unsplittable):
            self.plan.unsplittable.append(Reason(node, what, fix))

    def resized(self, ref: str, d: Demand, index: bool = False) -> None:
        self.plan.resized.setdefault(ref, (d.dim, d.cls, d.block, d.outer, index))

    # ---------------------------------------------------------------- demands
    def demand(self, d: Demand) -> None:
        key = (d.tensor, d.dim)
        if key in self.seen:
            return
        self.seen.add(key)
        ctx, ir = self.ctx, self.ir
        fact = ctx.fact(d.tensor)
        if fact is not None and fact.kind == PART:
            return
        name, idx = parse_tensor(d.tensor)
        if fact is not None and fact.kind == MIXED:
            # its rows are no tower's share of a global tensor: cutting it to the tower's count
            # failed at run time (every rewrite must run); it stays as the tower computes it
            self.reason(fact.src or name, f"'{d.tensor}' mixes examples ({fact.why}) where a "
                        "batch-sized shape is needed", "compute it per example")
            return
        node = ir.nodes[name]
        view = table.vector_view_of(ir, name)
        if view is not None:
            # fed without a shape, it lines up with the batch: a mask fed per example must be
            # split, a weight fed as one number must not, and only the feed tells. Each tower
            # reads its rows of the view broadcast to the batch (rebatch): right for both,
            # where the rows per example are known; else a reason (a refusal there stopped
            # a single weight beside tokens of a dynamic length that used to run: review 13)
            if d.rows is not None and d.outer == 1:
                self.plan.splits[d.tensor] = d
                self.resized(d.tensor, d)
            else:
                fed = node_of(ir.nodes[view].inputs[0])
                self.reason(fed, f"'{fed}' has no static shape and lines up with rows of the "
                            f"batch in '{d.by}' whose number per example is known only at run "
                            "time: fed one value per row it must be split, fed a single value "
                            "it must not, and only the feed tells which",
                            "give the placeholder its shape: shape=[None] for a value per row, "
                            "shape=[] for a single value")
            return
        if name not in ctx.region_names:
            if node.op in ops.BATCH_SOURCE_OPS and (d.block, d.outer) != (1, 1):
                # a fed tensor with several rows per example (labels flattened with their
                # time steps): the split cuts fed tensors by examples, so it would get the
                # example counts as rows (the rewrite failed at step 1)
                self.unsplittable(name, f"'{d.tensor}' is fed with several rows per example "
                                  f"(it pairs row for row with '{d.by}', whose examples span "
                                  f"{d.block if d.outer == 1 else 'several'} rows each); "
                                  "replicate splits fed tensors by examples",
                                  "feed it with one row per example ([batch, steps]) and "
                                  "flatten it in the graph (tf.reshape(y, [-1]))")
            elif node.op in ops.BATCH_SOURCE_OPS:
                self.plan.promote.setdefault(d.tensor, d)
            elif node.op in ops.VARIABLE_OPS:
                self.unsplittable(name, f"variable '{name}' has the batch size in its shape (dimension "
                            f"{d.dim}) and is used per example", "keep per-example state in a "
                            "tensor fed each step, or give the variable one row per tower")
            else:
                self.plan.slices[d.tensor] = d
            return
        forward = not ctx.in_gradient(node) and self.depths.get(name, 0) == 0
        if node.op in ("ReadVariableOp",) or (node.op in ("Identity",) and node.inputs
                                              and ir.nodes[node_of(node.inputs[0])].op in ops.VARIABLE_OPS):
            variable = node_of(node.inputs[0])
            if self._trained(variable):
                self.unsplittable(name, f"variable read '{name}' has the batch size in its shape and "
                                  "is trained per example", "keep per-example state in a "
                                  "non-trainable variable or a tensor fed each step")
            elif node.op != "ReadVariableOp":
                self.unsplittable(name, f"reference variable '{variable}' holds one row per example "
                                  "and is read per example: on one device an assignment to it also "
                                  "changes the values the gradient code kept from this read (they "
                                  "share the variable's buffer), which towers reading their rows "
                                  "cannot reproduce", "create the state variables with "
                                  "use_resource=True (reads are then values)")
            elif forward:
                # per-example state kept in a resource variable (a stateful RNN): each tower
                # reads its own rows of the one read; writes of merged rows run once (_evict)
                self.plan.splits[d.tensor] = d
                self.resized(d.tensor, d)
            else:
                self.unsplittable(name, f"variable read '{name}' has the batch size in its shape and "
                                  "is used per example inside a loop or gradient code",
                                  "read the state once, outside loops")
            return
        if forward and (fact is None or fact.kind != RED) and not self._positional(name):
            self._rows_from_each_other(d.tensor, name)
            self.plan.splits[d.tensor] = d
            self.resized(d.tensor, d)
            return
        self._producer(d, node, idx)

    def _rows_from_each_other(self, tensor: str, name: str) -> None:
        """A reason when the shared ``tensor`` the towers cut into rows is computed from a
        trained variable by an op that is not row by row (:meth:`_row_mixer`): each tower
        would run that op's gradient on its rows only (a softmax over a tiled parameter's
        rows: claimed exact, the parameter 0.32 off in an independent review)."""
        mixer = self._row_mixer(name)
        if mixer is not None and self.ir.nodes[mixer].op in ("ConcatV2", "Pack"):
            # its gradient cuts the rows at the global offsets: a tower's step cannot run
            self.unsplittable(mixer, f"'{mixer}' joins copies of a trained value into the rows of "
                              f"'{tensor}', which the towers each take some of: its gradient "
                              "cuts them at the whole batch's offsets",
                              "tile the value instead (tf.tile(p, [batch, 1]))")
        elif mixer is not None:
            self.reason(mixer, f"'{mixer}' ({self.ir.nodes[mixer].op}) computes the rows of "
                        f"'{tensor}' from each other, from a trained variable, and the towers "
                        "each take some of those rows: its gradient would be computed per "
                        "tower on its rows", "compute it from each example's own values, or "
                        "train this graph on one device")

    def _row_mixer(self, name: str, limit: int = 200) -> str | None:
        """An op on the way from a trained variable to the shared tensor ``name`` (computed
        once, each tower taking its rows) that is not row by row -- its gradient needs every
        row -- or None. Row by row: elementwise ops, identities, tiles and broadcasts, casts,
        reshapes and slices (:data:`_ROW_BY_ROW`); integer shape arithmetic is skipped."""
        ir, work, seen, mixer = self.ir, [name], set(), None
        trained = False
        while work and len(seen) < limit:
            cur = work.pop()
            if cur in seen or cur not in ir.nodes:
                continue
            seen.add(cur)
            node = ir.nodes[cur]
            if node.op in ops.VARIABLE_OPS:
                trained = trained or self._trained(cur)
                continue
            if node.op == "Const" or not node.inputs or \
                    ir.output_dtype(f"{cur}:0") in (types_pb2.DT_INT32, types_pb2.DT_INT64):
                continue            # shape arithmetic (a repeat's sizes) carries no rows
            if mixer is None and node.op not in _ROW_BY_ROW and node.op not in table.UNARY \
                    and node.op not in table.BROADCAST and node.op not in table.PASS_THROUGH:
                mixer = cur
            work.extend(node_of(r) for r in node.inputs)
        return mixer if trained else None

    def _trained(self, variable: str) -> bool:
        """True when an optimizer update or a scatter writes ``variable`` (a trained parameter
        whose gradient would have to be assembled from the towers' rows)."""
        for consumer in self.ir.consumers(variable):
            if consumer.op in ops.APPLY_OPS or "Scatter" in consumer.op:
                return True
        return False

    def _positional(self, name: str) -> bool:
        """True when a shared value's cone holds a ``Range``: its values are row numbers,
        which a split would not renumber."""
        work, seen = [name], set()
        while work:
            cur = work.pop()
            if cur in seen or cur not in self.ctx.region_names:
                continue
            seen.add(cur)
            if self.ir.nodes[cur].op == "Range":
                return True
            work.extend(node_of(r) for r in self.ir.nodes[cur].inputs)
        return False

    def _producer(self, d: Demand, node, idx: int) -> None:
        ctx, op = self.ctx, node.op
        sub = lambda ref, dim: self.demand(dataclasses.replace(d, tensor=tensor_name(*parse_tensor(ref)), dim=dim))  # noqa: E731
        rows = d.rows
        if op == "Const":
            self.plan.consts[d.tensor] = d
        elif op in table.SHAPE_SOURCES:
            self.position(Position(node.inputs[table.SHAPE_SOURCES[op]], d.dim, d.cls, rows or 0, node.name, node.name))
        elif op == "Range":
            self.position(Position(node.inputs[1], None, d.cls, rows or 0, node.name, node.name))
            self.resized(d.tensor, d, index=True)
            return
        elif op == "Tile":
            shape = ctx.shape(node.inputs[0])
            if shape is not None and d.dim < len(shape) and shape[d.dim] == 1:
                self.position(Position(node.inputs[1], d.dim, d.cls, rows or 0, node.name, node.name))
            else:
                sub(node.inputs[0], d.dim)
        elif op == "BroadcastTo":
            self.position(Position(node.inputs[1], d.dim, d.cls, rows or 0, node.name, node.name))
            self._broadcast_inputs(d, node, node.inputs[:1], sub)
        elif op == "Reshape":
            self.position(Position(node.inputs[1], d.dim, d.cls, rows or 0, node.name, node.name))
            src = ctx.shape(node.inputs[0])
            out = ctx.shape(d.tensor)
            found = map_reshape(out, d.dim, d.outer, d.block, ctx.static_batch(d.cls), src) \
                if src is not None and out is not None else None
            if found is None:
                self.reason(node.name, "a shared value reshaped to the batch size cannot be "
                            "resized per tower", "give the batch input a dynamic batch dimension")
            else:
                j, outer, inner = found
                self.demand(Demand(tensor_name(*parse_tensor(node.inputs[0])), j, d.cls, inner, outer, node.name))
        elif op in ("ExpandDims", "Squeeze", "Transpose"):
            mapped = self._unshift(node, d.dim)
            if mapped is None:
                self.plan.slices[d.tensor] = d
            else:
                sub(node.inputs[0], mapped)
        elif op in table.DEMAND_PASS or op in table.PASS_THROUGH:
            sub(node.inputs[idx if op in ("IdentityN",) else 0], d.dim)
        elif op in ("Merge", "RefMerge"):
            for ref in node.inputs:
                sub(ref, d.dim)
        elif op in table.BROADCAST or op in table.SAME_SHAPE or op in ("Select", "SelectV2"):
            self._broadcast_inputs(d, node, node.inputs, sub)
        elif op in ("ConcatV2", "Pack"):
            n = int(node.attr("N", len(node.inputs)))
            axis = int(node.attr("axis", 0)) if op == "Pack" else None
            for ref in node.inputs[:n]:
                dim = d.dim - (1 if axis is not None and 0 <= axis <= d.dim else 0)
                sub(ref, dim)
        elif op == "Slice" and self._slice(d, node, sub):
            pass
        elif op == "MatMul" and d.dim in (0, 1):
            # the rows of the product are the rows of a, its columns the columns of b
            transpose = bool(node.attr("transpose_a" if d.dim == 0 else "transpose_b", False))
            sub(node.inputs[d.dim], 1 - d.dim if transpose else d.dim)
        elif self.depths.get(node.name, 0) > 0:
            self.reason(node.name, f"'{d.tensor}' inside a TF1 while loop has the global batch size "
                        "where each tower needs its own", "give the batch input a dynamic batch "
                        "dimension")
            return
        else:
            if not ctx.in_gradient(node):
                self._rows_from_each_other(d.tensor, node.name)
            self.plan.slices[d.tensor] = d
        self.resized(d.tensor, d)

    def _slice(self, d: Demand, node, sub) -> bool:
        """``Slice(x, begin, size)`` keeping every row along the demanded dimension: the size
        there is a position and ``x``'s dimension is demanded too."""
        begin = self.ctx.int_value(node.inputs[1])
        if begin is None or d.dim >= len(begin) or begin[d.dim] != 0:
            return False
        self.position(Position(node.inputs[2], d.dim, d.cls, d.rows or 0, node.name, node.name))
        sub(node.inputs[0], d.dim)
        return True

    def _broadcast_inputs(self, d: Demand, node, refs, sub) -> None:
        out_rank = self.ctx.rank(d.tensor)
        for ref in refs:
            rank = self.ctx.rank(ref)
            if rank is None or out_rank is None:
                continue
            dim = d.dim - (out_rank - rank)
            shape = self.ctx.shape(ref)
            if 0 <= dim < rank and shape[dim] != 1:
                fact = self.ctx.fact(ref)
                if fact is None or fact.kind != PART:
                    sub(ref, dim)

    def _unshift(self, node, dim: int) -> int | None:
        if node.op == "Transpose":
            perm = self.ctx.int_value(node.inputs[1])
            return perm[dim] if perm is not None and dim < len(perm) else None
        rank = self.ctx.rank(node.inputs[0])
        if rank is None:
            return None
        if node.op == "ExpandDims":
            axes = self.ctx.axes(node.inputs[1], rank + 1)
            return None if axes is None or axes[0] == dim else dim - (axes[0] < dim)
        shape = self.ctx.shape(node.inputs[0])
        dims = node.attr("squeeze_dims", []) or [i for i, s in enumerate(shape) if s == 1]
        gone = sorted({x + rank if x < 0 else x for x in dims})
        kept = [i for i in range(rank) if i not in gone]
        return kept[dim] if dim < len(kept) else None

    # ---------------------------------------------------------------- positions
    def position(self, p: Position) -> None:
        key = (p.tensor, p.element, p.via, "position")
        if key in self.seen:
            return
        self.seen.add(key)
        ctx, ir = self.ctx, self.ir
        value = ctx.int_value(p.tensor)
        elem = 0 if p.element is None else p.element
        if value is not None and elem < len(value) and (isinstance(value[elem], Sym) or value[elem] == -1):
            return
        name, _ = parse_tensor(p.tensor)
        node = ir.nodes[name]
        batch = ctx.static_batch(p.cls)
        if node.op == "Const":
            const = node.attr("value")
            flat = np.atleast_1d(const).reshape(-1)
            if elem >= flat.size or batch is None or not p.factor or int(flat[elem]) != p.factor * batch:
                self.reason(name, f"constant '{name}' should hold the batch size at element {elem} "
                            f"but holds {int(flat[elem]) if elem < flat.size else '?'}",
                            "give the batch input a dynamic batch dimension")
                return
            found = self.plan.elements.setdefault((name, p.element if const.ndim else None), [])
            if all(q.via != p.via for q in found):
                found.append(p)
            return
        down = lambda ref, **kw: dataclasses.replace(  # noqa: E731
            p, tensor=tensor_name(*parse_tensor(ref)), via=name, **kw)
        if node.op in table.VALUE_PASS:
            self.position(down(node.inputs[0]))
        elif node.op in ("ExpandDims", "Reshape") and ctx.rank(node.inputs[0]) == 0 and elem == 0:
            self.position(down(node.inputs[0], element=None))
        elif node.op == "Reshape" and ctx.shape(node.inputs[0]) is not None:
            self.position(down(node.inputs[0]))         # the flat order stays
        elif node.op == "Transpose" and self._transposed(node, elem) is not None:
            self.position(down(node.inputs[0], element=self._transposed(node, elem)))
        elif node.op == "Pack" and int(node.attr("axis", 0)) == 0 and ctx.rank(node.inputs[0]) == 1 \
                and isinstance((ctx.shape(node.inputs[0]) or [None])[0], int):
            # rows of vectors (a tile's gradient stacks its multiples over the input's shape)
            row, col = divmod(elem, ctx.shape(node.inputs[0])[0])
            self.position(down(node.inputs[row], element=col))
        elif node.op == "Pack":
            self.position(down(node.inputs[elem], element=None))
        elif node.op in ("ConcatV2",):
            n = int(node.attr("N", len(node.inputs) - 1))
            offset = 0
            for ref in node.inputs[:n]:
                length = (ctx.shape(ref) or [None])[0] if ctx.rank(ref) == 1 else 1
                if length is None:
                    break
                if offset <= elem < offset + length:
                    self.position(down(ref, element=elem - offset if ctx.rank(ref) == 1 else None))
                    return
                offset += length
            self.reason(name, f"'{name}' holds the batch size in a shape built at run time",
                        "give the batch input a dynamic batch dimension")
        elif node.op in ("Slice", "StridedSlice", "GatherV2", "Gather") and ctx.rank(node.inputs[0]) == 1:
            start = ctx.int_value(node.inputs[1])
            if start is None or not isinstance(start[0], int):
                self.reason(name, f"'{name}' holds the batch size", "give the batch input a dynamic batch dimension")
                return
            at = start[elem] if node.op.startswith("Gather") else start[0] + elem
            self.position(down(node.inputs[0], element=at))
        elif node.op == "Shape":
            self.demand(Demand(tensor_name(*parse_tensor(node.inputs[0])), elem, p.cls, p.factor or None, 1, name))
        elif node.op in ("Placeholder", "PlaceholderWithDefault") and ctx.rank(p.tensor) == 0:
            self.plan.substitutes[p.tensor] = p
        elif node.op == "Mul" and ctx.rank(p.tensor) == 0:
            consts = [ctx.int_value(r) for r in node.inputs]
            for ref, other in zip(node.inputs, reversed(consts)):
                if other is not None and isinstance(other[0], int) and other[0] > 0 \
                        and p.factor % other[0] == 0:
                    self.position(down(ref, factor=p.factor // other[0]))
                    return
            self.reason(name, f"'{name}' computes the batch size from values replicate cannot "
                        "rewrite per tower", "give the batch input a dynamic batch dimension")
        elif node.op == "Placeholder" and ctx.sparse.get(tensor_name(name)) == "shape":
            self.reason(name, f"'{name}' is the dense shape of a sparse placeholder whose rank is "
                        "not given; each tower needs its own batch size in it",
                        "give tf.compat.v1.sparse_placeholder its shape (shape=[None, None] for "
                        "a batch of id lists)")
        else:
            self.reason(name, f"'{name}' ({node.op}) holds the batch size where each tower needs its "
                        "own count", "give the batch input a dynamic batch dimension")

    def _transposed(self, node, elem: int) -> int | None:
        """The flat index in ``Transpose`` ``node``'s input of its output's flat ``elem``."""
        shape, perm = self.ctx.shape(node.inputs[0]), self.ctx.int_value(node.inputs[1])
        if shape is None or perm is None or None in shape or not all(isinstance(p, int) for p in perm) \
                or len(perm) != len(shape):
            return None
        out = [shape[p] for p in perm]
        index = np.unravel_index(elem, out)
        source = [0] * len(shape)
        for k, p in enumerate(perm):
            source[p] = int(index[k])
        return int(np.ravel_multi_index(source, shape))

    # ---------------------------------------------------------------- mean gradients
    def mean_factors(self) -> None:
        """Static ``Mean`` gradients divide by the folded element count: scale it per tower."""
        ctx, ir = self.ctx, self.ir
        for prefix in self.scopes:
            for name, node in ir.nodes.items():
                if not name.startswith(prefix + "/") or node.op not in ("RealDiv", "Div", "TrueDiv") \
                        or "_grad/" not in name:
                    continue
                forward = forward_op_of(ir, prefix, name)
                if forward is None or ir.nodes[forward].op != "Mean":
                    continue
                fact, data = ctx.facts.get(f"{forward}:0"), ctx.fact(ir.nodes[forward].inputs[0])
                if fact is None or fact.kind != RED or fact.src != forward or data is None or data.kind != PART:
                    continue
                divisor = self._const_through_cast(node.inputs[1])
                if divisor is None:
                    continue
                shape_in, shape_out = ctx.shape(ir.nodes[forward].inputs[0]), ctx.shape(f"{forward}:0")
                batch = ctx.static_batch(data.cls)
                if shape_in is None or shape_out is None or None in shape_in or None in shape_out or not batch:
                    continue
                count = int(np.prod(shape_in)) // max(1, int(np.prod(shape_out)))
                value = float(np.asarray(ir.nodes[divisor].attr("value")).reshape(-1)[0])
                if value == float(count) and count % batch == 0:
                    self.plan.factors[divisor] = (data.cls, count / batch)

    def _const_through_cast(self, ref: str) -> str | None:
        for _ in range(3):
            node = self.ir.nodes.get(node_of(ref))
            if node is None:
                return None
            if node.op == "Const":
                return node.name
            if node.op not in ("Cast", "Identity") or not node.inputs:
                return None
            ref = node.inputs[0]
        return None


def resolve(ctx: Context, depths: dict[str, int], scopes: list[str]) -> Plan:
    """The rewrite plan for everything ``ctx`` recorded."""
    plan = Plan()
    resolver = _Resolver(ctx, plan, depths, scopes)
    for d in list(ctx.demands.values()):
        resolver.demand(d)
    for p in list(ctx.positions.values()):
        resolver.position(p)
    for (node, attr), (dim, cls, factor) in ctx.attr_positions.items():
        plan.attrs[(node, attr)] = (dim, cls, factor)
    plan.row_shapes.update(ctx.row_shapes)
    plan.slice_pads.update(ctx.slice_pads)
    for node in [*ctx.row_shapes, *ctx.slice_pads, *ctx.slice_pads.values()]:
        if depths.get(node):
            resolver.unsplittable(node, "rows that are part batch, part shared (a sampled loss) "
                                  "are reshaped or sliced inside a loop", "compute the sampled loss "
                                  "outside the loop")
    for node, (what, fix) in ctx.refusals.items():
        resolver.unsplittable(node, what, fix)
    for node, what in ctx.notes:
        # a shape inside a body: each tower's copy would keep the global batch's size and fail
        # where one device runs (a static batch's dropout under a training flag: review 21)
        resolver.unsplittable(node, f"{what}, which every tower's copy of the function would "
                              "keep: the tower's rows do not fit it", "give the batch input a "
                              "dynamic batch dimension ([None, ...]), or build the graph with TF1 "
                              "control flow (tf.compat.v1.disable_control_flow_v2()), whose conds "
                              "and loops replicate resizes")
    resolver.mean_factors()
    return plan
