"""Exact randomness: each tower draws the global batch's shape and keeps its own rows.

Requires: ``ir.facts["analysis"].draws`` (the reproducible random ops, from
:mod:`replicate.passes._draws`), ``ir.facts["towers"]`` (per-class global batch size and
per-tower counts) and ``ir.facts["copies"]``; run after the rebatch pass, so a static shape
already holds the tower's count.

Produces, for each ``rows`` draw and each tower ``k`` holding ``n_k`` examples starting at
``offset_k``: the tower's copy of the random op becomes ``<copy>/global_draw``, drawing the
tower's shape with the batch dimension set back to the global batch size ``B``, with the
original seeds; under the copy's own name a ``Slice`` keeps rows
``[offset_k, offset_k + n_k)`` of that axis. Two kernels with equal seeds and equal shapes
give equal streams, step after step, so tower ``k`` sees exactly its rows of the draw one
device makes. An empty tower keeps zero rows. A draw inside TF1 while loops gets what the
global shape adds to the tower's and where its rows begin, computed once per step, through
``Enter`` nodes of each frame around it (:mod:`replicate.passes._frames`); the slice's size is
the tower's own shape tensor. A draw whose axis holds ``block`` rows per example takes rows
``[offset_k * block, (offset_k + n_k) * block)``; one whose axis holds ``outer`` copies of the
batch is viewed as ``[outer, B * block]`` and keeps the tower's rows of every copy, then takes
the tower's shape again. ``same`` draws need nothing here (the clone
pass kept their seeds). Offsets are computed once per batch class on the controller
(``replicate/draw/class_<c>/offset_<k>``). ``ir.facts["draws"]`` lists the ops rewritten.

Cost: every tower draws ``B`` rows instead of ``n_k`` (N times the random numbers of one
device, spread over N devices) and holds one ``B``-row buffer until the slice. Inside TF1
loops (and in conds and loops that are function bodies, :mod:`replicate.passes._body_draws`),
where that would repeat in every iteration, a draw the counter-based way can take draws only
the tower's rows from the tower's copy of its stream state (:mod:`replicate.passes._streams`).

A top-level draw whose shape is known but for the batch is cheaper: it is made once per step
outside the towers (``replicate/draw/<op>``, the draws taking turns on the towers' devices),
the draws of one shape, batch class and device are packed and cut by one ``SplitV``, and each
tower unpacks its rows on its own device. A ``param_rows`` draw (``tf.random.categorical`` of
the examples' logits) pads the tower's logits to their rows of the global batch, draws with
the original seeds and keeps its rows.

``body`` draws (a dropout mask inside a ``tf.cond`` branch under a training flag) are
rewritten inside the branches (:mod:`replicate.passes._body_draws`): each tower's copy of the
cond calls branches that take the other towers' example count and the tower's first row as
two more arguments.
"""

from __future__ import annotations

import logging

import numpy as np
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import dtypes, tensor_util

from replicate.graph.frames import in_branch
from replicate.graph.ir import IR, Node, node_of
from replicate.passes._body_draws import rewire_call, rewrite_branches, streams_of
from replicate.passes._frames import enter, frames
from replicate.passes._streams import in_frames, plan, state
from replicate.passes.pipeline import PassResult
from replicate.passes.split import tower_offsets

__all__ = ["Draw", "SCOPE"]

log = logging.getLogger(__name__)

SCOPE = "replicate/draw"


def _other_rows(ir: IR, towers, cls: int) -> list[str]:
    """For each tower, how many examples of batch class ``cls`` the other towers hold (``B -
    n_k``: what a global-shape draw adds to the tower's shape), once per class on the
    controller."""
    out = []
    for k, count in enumerate(towers.class_counts[cls]):
        name = f"{SCOPE}/class_{cls}/other_rows_{k}"
        if name not in ir.nodes:
            ir.add(name, "Sub", [towers.class_batch[cls], count], device=ir.nodes[node_of(count)].device,
                   attrs={"T": dtypes.int32})
        out.append(name)
    return out


class Draw:
    """Rewrite of reproducible random draws (no options: everything comes from the facts)."""

    name = "draw"

    def run(self, ir: IR) -> PassResult:
        analysis = ir.facts["analysis"]
        towers = ir.facts["towers"]
        copies = ir.facts["copies"]
        rows = [d for d in analysis.draws.values() if d.kind in ("rows", "body", "param_rows")]
        done = self._copied(ir, analysis, copies)
        offsets: dict[int, list[str]] = {}
        others: dict[int, list[str]] = {}
        groups: dict[tuple, list[tuple]] = {}     # once-per-step draws cut together
        for draw in rows:
            if draw.cls not in offsets:
                offsets[draw.cls] = tower_offsets(ir, towers, draw.cls)
                others[draw.cls] = _other_rows(ir, towers, draw.cls)
            mine = [c[draw.name] for c in copies if draw.name in c]
            if draw.kind == "rows" and self._once(ir, draw, copies, towers, offsets[draw.cls], groups):
                done += mine
                continue
            for k in range(len(towers.prefixes)):
                copy = copies[k].get(draw.name)
                if copy is None:
                    continue
                if draw.kind == "body":
                    streams = streams_of(ir, draw, towers.prefixes[k])
                    branches = rewrite_branches(ir, draw.name, draw, k, streams)   # conds and loops
                    guards = [state(ir, f"{towers.prefixes[k]}/{name}", p, ir.nodes[copy].device)[1]
                              for name, _, p in streams]
                    rewire_call(ir, copy, branches, others[draw.cls][k], offsets[draw.cls][k],
                                tuple(guards))
                elif draw.kind == "param_rows":
                    self._param_rows(ir, copy, towers.class_batch[draw.cls],
                                     towers.class_counts[draw.cls][k], offsets[draw.cls][k])
                else:
                    self._rows(ir, copy, draw, towers.class_batch[draw.cls],
                               others[draw.cls][k], offsets[draw.cls][k], towers.prefixes[k])
                done.append(copy)
        for key, members in groups.items():
            self._cut(ir, towers, key, members, copies)
        ir.facts["draws"] = done
        log.info("draw: %d random ops reproduce the single-device draw (%d tower copies)",
                 len(rows), len(done))
        return PassResult(ir, bool(done))

    @staticmethod
    def _copied(ir: IR, analysis, copies) -> list[str]:
        """Calls whose bodies draw the same values in every tower ("same" draws in functions)
        call each tower's own copy of the functions on the way: a random kernel belongs to an
        instantiation of its function, and a call nested in a body may share one between
        towers (measured: weight noise in a cond in a defun, 0.3 off one device)."""
        done = []
        for draw in analysis.draws.values():
            if draw.kind != "same" or not draw.inner:
                continue
            for k, copy in enumerate(c.get(draw.name) for c in copies):
                if copy is not None:
                    rewire_call(ir, copy, rewrite_branches(ir, draw.name, draw, k))
                    done.append(copy)
        return done

    @staticmethod
    def _once(ir: IR, draw, copies: list[dict[str, str]], towers, offsets: list[str],
              groups: dict[tuple, list[tuple]]) -> bool:
        """A top-level draw of a shape known but for the batch: drawn once per step outside
        the towers (``replicate/draw/<op>``; the draws take turns on the towers' devices), and
        recorded in ``groups`` by shape, batch class and device for :meth:`_cut`, which gives
        each tower's copy its rows. The global shape is made once per shape and batch class.
        False when it does not apply."""
        mine = [(k, c[draw.name]) for k, c in enumerate(copies) if draw.name in c]
        if not mine or draw.block != 1 or draw.outer != 1 or frames(ir, mine[0][1]):
            return False
        if in_branch(ir, mine[0][1]):
            return False    # in a TF1 cond's branch, drawn only when taken (review 38: moved
                            # out, it drew every step, 0.2-0.55 off once the flag was False)
        first = ir.nodes[mine[0][1]]
        dims = ir.static_shape(f"{draw.name}:0")
        if dims is None or any(d is None for i, d in enumerate(dims) if i != draw.axis):
            return False
        index = dtypes.as_dtype(ir.output_dtype(first.inputs[0]))
        out_type = dtypes.as_dtype(ir.output_dtype(f"{first.name}:0"))
        scope = f"{SCOPE}/class_{draw.cls}"
        device = ir.nodes[node_of(offsets[0])].device
        rank, axis = len(dims), draw.axis
        hot = np.zeros(rank, dtype=index.as_numpy_dtype)
        hot[axis] = 1
        tag = f"{index.name}_{rank}_{axis}"

        def cached(name: str, make) -> str:
            return name if name in ir.nodes else make(name)

        def const(name: str, value) -> str:
            return cached(f"{scope}/{name}", lambda n: ir.const(n, value, index, device))

        def as_index(ref: str, name: str) -> str:
            if index == dtypes.int32:
                return ref
            return cached(f"{scope}/{name}_{index.name}", lambda n: ir.add(
                n, "Cast", [ref], device=device,
                attrs={"SrcT": dtypes.int32, "DstT": index, "Truncate": False}).name)

        def along_axis(name: str, scalar: str, base: str) -> str:
            """``base`` with ``scalar`` added at the batch axis."""
            return cached(f"{scope}/{name}", lambda n: ir.add(n, "AddV2", [base, ir.add(
                f"{n}/at_axis", "Mul", [const(f"axis_mask_{tag}", hot), scalar], device=device,
                attrs={"T": index}).name], device=device, attrs={"T": index}).name)

        rest = [0 if i == axis else d for i, d in enumerate(dims)]
        shape = along_axis(f"shape_{'x'.join(map(str, rest))}_{tag}", as_index(
            towers.class_batch[draw.cls], "batch"), const(f"rest_{'x'.join(map(str, rest))}_{tag}", rest))
        source = ir.unique_name(f"{SCOPE}/{draw.name}")
        # the draws take turns on the towers' devices, so that no device makes them all
        devices = list(dict.fromkeys(ir.nodes[copy].device for _, copy in mine))
        where = devices[sum(len(g) for g in groups.values()) % len(devices)]
        ir.add_node(Node(source, first.op, [shape] + list(first.inputs[1:]), list(first.control),
                         where, dict(first.attrs)))
        # a driver may fetch it by name: the rewire pass names the global draw so
        ir.facts.setdefault("global_draws", {})[draw.name] = source
        key = (draw.cls, axis, out_type, tuple(rest), where)
        groups.setdefault(key, []).append((source, draw.name, mine))
        return True

    @staticmethod
    def _cut(ir: IR, towers, key: tuple, members: list[tuple], copies: list[dict[str, str]]) -> None:
        """Cut the once-per-step draws of one shape and batch class into the towers' rows. One
        draw: a ``SplitV``. Several (an unrolled LSTM's dropout at every step): they are packed,
        cut by one ``SplitV`` and unpacked on each tower's device, so each tower receives one
        tensor instead of one per draw (measured at 4 logical devices and 80 draws: a
        cross-device edge per tower and draw cost more than the towers' own draws)."""
        cls, axis, out_type, _, device = key
        scope = f"{SCOPE}/class_{cls}"
        counts = towers.class_counts[cls]
        controller = ir.nodes[node_of(counts[0])].device
        sizes = f"{scope}/split_sizes"
        if sizes not in ir.nodes:
            ir.add(sizes, "Pack", counts, device=controller, attrs={"T": dtypes.int32, "N": len(counts), "axis": 0})
        cut_axis = axis if len(members) == 1 else axis + 1
        along = f"{scope}/split_axis_{cut_axis}"
        if along not in ir.nodes:
            ir.const(along, cut_axis, dtypes.int32, controller)
        source = members[0][0]
        if len(members) > 1:
            source = ir.add(ir.unique_name(f"{source}/packed"), "Pack", [s for s, _, _ in members], device=device,
                            attrs={"T": out_type, "N": len(members), "axis": 0}).name
        split = ir.add(f"{source}/rows", "SplitV", [source, sizes, along], device=device,
                       attrs={"T": out_type, "Tlen": dtypes.int32, "num_split": len(counts)}).name
        unpacked: dict[int, str] = {}
        for i, (_, original, mine) in enumerate(members):
            for k, copy in mine:
                if len(members) == 1:
                    rows = f"{split}:{k}"
                else:
                    if k not in unpacked:
                        unpacked[k] = ir.add(f"{split}/{towers.prefixes[k]}", "Unpack", [f"{split}:{k}"],
                                             device=towers.devices[k],
                                             attrs={"T": out_type, "num": len(members), "axis": 0}).name
                    rows = f"{unpacked[k]}:{i}"
                Draw._take(ir, copy, rows, out_type, copies[k], original)

    @staticmethod
    def _take(ir: IR, copy: str, rows: str, out_type, names: dict[str, str], original: str) -> None:
        """Tower copy ``copy`` of draw ``original`` becomes its rows ``rows`` of the global draw."""
        node = ir.nodes[copy]
        readers = ir.consumers(copy)
        # The rows take the copy's own shape again (a view, no copy): Grappler then proves the
        # mask's shape equal to the activation's it multiplies and drops the gradient's
        # broadcast reductions (BroadcastGradientArgs, Sum, Reshape per draw and tower: 2,400
        # more nodes per step in an unrolled LSTM with 80 draws on 4 towers without it).
        attrs = {"T": out_type, "Tshape": dtypes.as_dtype(ir.output_dtype(node.inputs[0]))}
        if node.control or any(copy in r.control for r in readers):
            ir.remove_many([copy])      # the copy's name is read: it names the view
            ir.add(copy, "Reshape", [rows, node.inputs[0]], list(node.control), node.device, attrs=attrs)
            return
        view = ir.add(f"{copy}/rows", "Reshape", [rows, node.inputs[0]], device=node.device, attrs=attrs).name
        ir.replace_uses(copy, view)
        ir.remove_many([copy])
        del names[original]

    @staticmethod
    def _param_rows(ir: IR, copy: str, batch: str, count: str, offset: str) -> None:
        """A ``param_rows`` draw: the tower's parameter rows padded with zero rows to the
        global batch, at the tower's offset (``<copy>/global_param``), drawn with the original
        seeds (``<copy>/global_draw``); under the copy's name a ``Slice`` keeps the tower's rows."""
        node = ir.nodes[copy]
        dev, i32, base = node.device, dtypes.int32, f"{copy}/global_draw"
        param_type = dtypes.as_dtype(ir.output_dtype(node.inputs[0]))
        out_type = dtypes.as_dtype(ir.output_dtype(f"{copy}:0"))
        zero = ir.const(f"{base}/zero", 0, i32, dev)
        to_end = ir.add(f"{base}/rows_to_end", "Sub", [batch, offset], device=dev, attrs={"T": i32}).name
        after = ir.add(f"{base}/rows_after", "Sub", [to_end, count], device=dev, attrs={"T": i32}).name
        values = ir.add(f"{base}/pad_values", "Pack", [offset, after, zero, zero], device=dev,
                        attrs={"T": i32, "N": 4, "axis": 0}).name
        pads = ir.add(f"{base}/paddings", "Reshape", [values, ir.const(f"{base}/pad_shape", [2, 2], i32, dev)],
                      device=dev, attrs={"T": i32, "Tshape": i32}).name
        param = ir.add(f"{copy}/global_param", "Pad", [node.inputs[0], pads], device=dev,
                       attrs={"T": param_type, "Tpaddings": i32}).name
        ir.remove_many([copy])
        ir.add_node(Node(base, node.op, [param] + list(node.inputs[1:]), list(node.control), dev,
                         dict(node.attrs)))
        begin = ir.add(f"{base}/begin", "Pack", [offset, zero], device=dev,
                       attrs={"T": i32, "N": 2, "axis": 0}).name
        size = ir.add(f"{base}/size", "Pack", [count, ir.const(f"{base}/all", -1, i32, dev)], device=dev,
                      attrs={"T": i32, "N": 2, "axis": 0}).name
        ir.add(copy, "Slice", [base, begin, size], device=dev, attrs={"T": out_type, "Index": i32})

    @staticmethod
    def _rows_once(ir: IR, copy: str, node: Node, index, out_type, chain, others: str,
                   offset: str, axis: int, rank: int, block: int) -> None:
        """A draw whose axis holds ``block`` rows per example of one copy of the batch: what
        the global shape adds to the tower's (the other towers' ``B - n_k`` examples, ``block``
        rows each, at the axis) and where the tower's rows begin are computed once per step
        outside any loop and entered into the draw's frames, so that a draw in a loop costs two
        ops per iteration more than one device's (the global shape's add, the slice). The
        slice's size is the tower's own shape tensor, so Grappler knows the rows have the
        activation's shape (see :meth:`_take`)."""
        dev, i32, base = node.device, dtypes.int32, f"{copy}/global_draw"
        shape = node.inputs[0]
        hot = np.zeros(rank, dtype=np.int32)
        hot[axis] = block
        axis_rows = ir.const(f"{base}/rows_per_example_at_axis", hot, i32, dev)

        def vector(name: str, scalar: str) -> str:
            ref = ir.add(f"{base}/{name}", "Mul", [axis_rows, scalar], device=dev, attrs={"T": i32}).name
            if index != i32:
                ref = ir.add(f"{base}/{name}_{index.name}", "Cast", [ref], device=dev,
                             attrs={"SrcT": i32, "DstT": index, "Truncate": False}).name
            return enter(ir, ref, chain, f"{base}/{name}", dev, index)

        grow, begin = vector("grow", others), vector("begin", offset)
        global_shape = ir.add(f"{base}/shape", "AddV2", [shape, grow], device=dev, attrs={"T": index}).name
        ir.remove_many([copy])
        ir.add_node(Node(base, node.op, [global_shape] + list(node.inputs[1:]), list(node.control), dev,
                         dict(node.attrs)))
        ir.add(copy, "Slice", [base, begin, shape], device=dev, attrs={"T": out_type, "Index": index})

    @staticmethod
    def _rows(ir: IR, copy: str, draw, batch: str, others: str, offset: str, tower: str) -> None:
        node = ir.nodes[copy]
        shape = node.inputs[0]
        index = dtypes.as_dtype(ir.output_dtype(shape))
        out_type = dtypes.as_dtype(ir.output_dtype(f"{copy}:0"))
        dev = node.device
        base = f"{copy}/global_draw"
        rank, axis_at = draw.rank, draw.axis
        block, outer = draw.block, draw.outer
        # Inside a TF1 loop every new node must run in the draw's frame: constants follow a
        # control edge from the shape, the controller's values come in through Enter nodes.
        chain = frames(ir, copy)
        anchor = [node_of(shape)] if chain else []
        p = plan(node.op, node.attrs, draw.axis, outer, block, draw.width) if chain else None
        if p is not None:       # in a loop: only the tower's rows, from its stream state
            in_frames(ir, copy, p, chain, batch, offset, tower)
            return

        def const(name: str, value, dtype=index) -> str:
            if f"{base}/{name}" in ir.nodes:          # the same constant asked for again
                return f"{base}/{name}"
            proto = tensor_util.make_tensor_proto(value, dtype=dtype)
            return ir.add(f"{base}/{name}", "Const", control=anchor, device=dev,
                          attrs={"value": attr_value_pb2.AttrValue(tensor=proto),
                                 "dtype": dtype}).name

        def cast(ref: str, name: str) -> str:
            ref = enter(ir, ref, chain, f"{base}/{name}", dev)
            if index == dtypes.int32:
                return ref
            return ir.add(f"{base}/{name}", "Cast", [ref], device=dev,
                          attrs={"SrcT": dtypes.int32, "DstT": index, "Truncate": False}).name

        def op(name: str, kind: str, inputs: list[str], dtype=index, **attrs) -> str:
            return ir.add(f"{base}/{name}", kind, inputs, device=dev, attrs={"T": dtype, **attrs}).name

        def onehot(at: int, size: int) -> str:
            hot = np.zeros(size, dtype=index.as_numpy_dtype)
            hot[at] = 1
            return const(f"axis_mask_{size}", hot)

        def sizes(at: int, size: int, rows: str) -> str:
            """-1 on every axis but ``at``, ``rows`` there (a Slice's size)."""
            one = const(f"one_{size}", 1)
            return op(f"size_{size}", "Sub", [op(f"rows_plus_one_{size}", "Mul", [
                onehot(at, size), op(f"count_plus_one_{size}", "AddV2", [rows, one])]), one])

        if outer == 1:
            Draw._rows_once(ir, copy, node, index, out_type, chain, others, offset, axis_at, rank, block)
            return
        axis = const("axis", axis_at, dtypes.int32)
        local = ir.add(f"{base}/local_rows", "GatherV2", [shape, axis, const("zero", 0, dtypes.int32)],
                       device=dev,
                       attrs={"Tparams": index, "Tindices": dtypes.int32, "Taxis": dtypes.int32}).name
        # The axis holds `outer` copies of the batch, `block` rows per example in each.
        glob = cast(batch, "batch")
        if block * outer != 1:
            glob = op("global_rows", "Mul", [glob, const("rows_per_example", block * outer)])
        grow = op("grow", "Mul", [onehot(axis_at, rank), op("missing", "Sub", [glob, local])])
        global_shape = op("shape", "AddV2", [shape, grow])
        first = cast(offset, "offset")
        if block != 1:
            first = op("first_row", "Mul", [first, const("block", block)])
        readers = list(ir.nodes[copy].inputs)
        ir.remove_many([copy])
        ir.add_node(Node(base, node.op, [global_shape] + readers[1:], list(node.control), dev,
                         dict(node.attrs)))
        # `outer` copies one after the other: view the axis as [outer, rows of one copy], keep
        # the tower's rows of every copy, and give the draw the tower's shape again.
        copies = const("copies", [outer])
        per_copy = op("copy_rows", "FloorDiv", [glob, const("outer", outer)])
        parts = op("view_dims", "ConcatV2", [global_shape, copies, op("per_copy", "Reshape", [
            per_copy, const("vector", [1], dtypes.int32)], Tshape=dtypes.int32),
            const("concat_axis", 0, dtypes.int32)], N=3, Tidx=dtypes.int32)
        order = list(range(axis_at)) + [rank, rank + 1] + list(range(axis_at + 1, rank))
        view = ir.add(f"{base}/view_shape", "GatherV2", [parts, const("view_order", order, dtypes.int32),
                                                         const("zero", 0, dtypes.int32)], device=dev,
                      attrs={"Tparams": index, "Tindices": dtypes.int32, "Taxis": dtypes.int32}).name
        viewed = ir.add(f"{base}/view", "Reshape", [base, view], device=dev,
                        attrs={"T": out_type, "Tshape": index}).name
        mine = op("tower_rows", "FloorDiv", [local, const("outer_again", outer)])
        begin = op("begin", "Mul", [onehot(axis_at + 1, rank + 1), first])
        kept = ir.add(f"{base}/kept", "Slice", [viewed, begin, sizes(axis_at + 1, rank + 1, mine)],
                      device=dev, attrs={"T": out_type, "Index": index}).name
        ir.add(copy, "Reshape", [kept, shape], device=dev, attrs={"T": out_type, "Tshape": index})
