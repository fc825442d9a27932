"""Give every tower its own batch size where the graph baked in the global one.

Requires: ``ir.facts["analysis"]`` with the dataflow's rewrite ``plan``
(:class:`replicate.batchflow.plan.Plan`), ``ir.facts["towers"]`` (per-class counts) and
``ir.facts["copies"]`` from the clone pass.

Produces, per tower ``k`` with ``n_k`` examples of the class concerned:

- ``elements``: the tower's copy of an integer constant holding the batch size at a shape
  position (a reshape target, a ``Fill``'s dims, a tile multiple) holds ``n_k`` times the
  rows per example there — a private copy when other ops read the same constant;
- ``factors``: the element count a static ``Mean`` gradient divides by, scaled to ``n_k``;
- ``consts``: a constant with a batch-sized dimension inside gradient code or a loop keeps the
  tower's own rows (resized when uniform, sliced otherwise);
- ``splits``: a shared tensor computed outside the towers (a zero state) keeps its name and its
  global value; each tower reads its own rows of it (``SplitV`` on its device);
- ``slices``: any other shared tensor the towers compute at the global size is cut to the
  tower's rows in the tower;
- ``substitutes``: a fed scalar that holds the batch size where a shape needs the tower's
  count reads the tower's count there;
- ``attrs``: shape attributes whose batch dimension becomes ``n_k``;
- ``row_shapes``: a reshape of rows that are part batch, part shared (a sampled loss's gather
  gradient) reshapes to ``-1`` rows, not to the folded ``B + S``;
- ``slice_pads``: the gradient ``Pad`` of a slice of such rows gets paddings computed from
  the tower's own forward slice.

``ir.facts["rebatched"]`` lists what was rewritten.
"""

from __future__ import annotations

import logging

import numpy as np
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import dtypes

from replicate.batchflow import table
from replicate.errors import AnalysisError
from replicate.graph.ir import IR, node_of, parse_tensor
from replicate.passes.pipeline import PassResult

__all__ = ["Rebatch", "RELAXED_SHAPE_ATTRS"]

#: Shape attributes that only check values (never size anything): relaxed in the towers.
RELAXED_SHAPE_ATTRS = {"TensorArrayV3": "element_shape", "TensorArrayGatherV3": "element_shape",
                       "TensorArrayConcatV3": "element_shape_except0"}

#: Calls whose ``output_shapes`` list only states what shape inference may assume (a static
#: batch in it would contradict a tower's rows): relaxed in the towers.
RELAXED_CALL_SHAPES = frozenset({"If", "StatelessIf", "While", "StatelessWhile"})

log = logging.getLogger(__name__)

SCOPE = "replicate/rebatch"


class Rebatch:
    """Per-tower batch sizes (no options: everything comes from the analysis' plan)."""

    name = "rebatch"

    def run(self, ir: IR) -> PassResult:
        analysis = ir.facts["analysis"]
        plan = analysis.plan
        if plan is None:
            return PassResult(ir, False)
        self.ir, self.towers, self.copies = ir, ir.facts["towers"], ir.facts["copies"]
        self.classes = analysis.flow.classes
        self.shared_inputs = analysis.shared_inputs
        done: list[str] = []
        for (name, elem), found in sorted(plan.elements.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
            p = found[0]
            vias = sorted({q.via for q in found if q.via is not None})
            self._per_tower_const(name, vias, lambda v, n, p=p, elem=elem: _set(v, elem, p.factor * n), p.cls)
            done.append(name)
        for name, (cls, per) in sorted(plan.factors.items()):
            self._per_tower_const(name, None, lambda v, n, per=per: np.asarray(v) * 0 + per * n, cls)
            done.append(name)
        for tensor, d in sorted(plan.consts.items()):
            name, _ = parse_tensor(tensor)
            self._per_tower_const(name, None, lambda v, n, k=None, d=d: v, d.cls, demand=d)
            done.append(name)
        for tensor, d in sorted(plan.splits.items()):
            self._split(tensor, d, per_tower=False)
            done.append(node_of(tensor))
        for tensor, d in sorted(plan.slices.items()):
            self._split(tensor, d, per_tower=True)
            done.append(node_of(tensor))
        for tensor, p in sorted(plan.substitutes.items()):
            self._substitute(tensor, p)
            done.append(node_of(tensor))
        for (name, attr), (dim, cls, factor) in sorted(plan.attrs.items()):
            self._attr(name, attr, dim, cls, factor)
            done.append(name)
        for name, row in sorted(plan.row_shapes.items()):
            self._row_shape(name, row)
            done.append(name)
        for name, forward in sorted(plan.slice_pads.items()):
            self._slice_pad(name, forward)
            done.append(name)
        done += self._relax_element_shapes({name for name, _ in plan.attrs},
                                           {v for v in analysis.classes.values() if v})
        relaxed = self._relax_call_shapes({v for v in analysis.classes.values() if v})
        if relaxed:
            log.info("rebatch: %d conds and loops no longer state the static batch", len(relaxed))
        ir.facts["rebatched"] = list(dict.fromkeys(done))
        log.info("rebatch: %d constants, tensors and attributes made per-tower", len(done))
        return PassResult(ir, bool(done))

    # ------------------------------------------------------------------ helpers
    def _static(self, cls: int) -> list[int]:
        counts = self.towers.class_static.get(self.classes.find(cls))
        if counts is None:
            raise AnalysisError("a constant holds a batch size but the batch size of its inputs is "
                                "dynamic; give every batch input the same static batch size")
        return counts

    def _per_tower_const(self, name: str, vias: list[str] | None, value_for, cls: int, demand=None) -> None:
        """Each tower's copy of Const ``name`` gets ``value_for(global value, n_k)``; a private
        copy read by the ``vias`` when other nodes of the tower read the constant too."""
        ir = self.ir
        counts = self._static(cls)
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
        value = np.asarray(ir.const_value(name))
        for k, copies in enumerate(self.copies):
            copy = copies.get(name)
            if copy is None:
                continue
            new = _rows(value, demand, offsets[k], counts[k]) if demand is not None else value_for(value, counts[k])
            mine = [copies[v] for v in vias or () if v in copies]
            readers = [c.name for c in ir.consumers(copy)]
            if mine and any(r not in mine for r in readers):
                target = ir.unique_name(f"{copy}/tower_value")
                ir.const(target, np.asarray(new, dtype=value.dtype), device=ir.nodes[copy].device)
                ir.set_control(target, ir.nodes[copy].control)     # same frame (a loop's pivot)
                ir.replace_uses(f"{copy}:0", f"{target}:0", only=mine)
                continue
            ir.set_const(copy, np.asarray(new, dtype=value.dtype))

    def _sizes(self, cls: int, rows: int, device: str) -> str:
        """The per-tower sizes of a batch-sized dimension with ``rows`` rows per example."""
        root = self.classes.find(cls)
        static = self.towers.class_static.get(root)
        name = f"{SCOPE}/sizes_{list(self.towers.class_counts).index(root)}_{rows}"
        if name in self.ir.nodes:
            return name
        if static is not None:
            return self.ir.const(name, [c * rows for c in static], dtypes.int32, device)
        counts = self.towers.class_counts[root]
        packed = self.ir.add(f"{name}/counts", "Pack", counts, device=device,
                             attrs={"T": dtypes.int32, "N": len(counts), "axis": 0}).name
        scale = self.ir.const(f"{name}/rows", rows, dtypes.int32, device)
        return self.ir.add(name, "Mul", [packed, scale], device=device, attrs={"T": dtypes.int32}).name

    def _split(self, tensor: str, d, per_tower: bool) -> None:
        """Towers read their own rows of ``tensor`` (the global original, or their own copy)."""
        ir = self.ir
        if d.outer != 1:
            # a concatenation of batches (a GAN's real and generated examples): each tower's
            # rows are not one piece of it
            above = ir.ancestors([node_of(tensor)])
            aside = [t for t in self.shared_inputs if node_of(t) in above]
            raise AnalysisError(
                f"'{tensor}' must be cut to each tower's examples, but it holds {d.outer} batches "
                "one after another (a concatenation, such as a GAN's real and generated examples)"
                + (f", and {' and '.join(repr(t) for t in sorted(aside))} "
                   f"{'was' if len(aside) == 1 else 'were'} not taken for batch inputs" if aside else "")
                + ": if every part holds as many examples, name the inputs of all of them with "
                "batch_inputs= (--batch-inputs), else compute each part's loss separately and add them")
        if d.rows is None:
            raise AnalysisError(f"'{tensor}' must be cut to each tower's examples, but its rows "
                                "per example are not known statically; give the batch input a "
                                "dynamic batch dimension")
        name, idx = parse_tensor(tensor)
        controller = ir.nodes[name].device
        sizes = self._sizes(d.cls, d.rows, controller)
        dtype = dtypes.as_dtype(ir.output_dtype(tensor))
        n = len(self.towers.devices)
        shared = None
        whole = None
        if not per_tower and table.vector_view_of(ir, name) is not None:
            # a single value or one per example (row), which only the feed tells: as many rows
            # as all the towers' together either way, each tower its own
            scope = ir.unique_name(f"{SCOPE}/{name}_{idx}/as_rows")
            rows = ir.add(f"{scope}/rows", "Sum", [sizes, ir.const(f"{scope}/axis", [0], dtypes.int32,
                                                                   controller)],
                          device=controller, attrs={"T": dtypes.int32, "Tidx": dtypes.int32,
                                                    "keep_dims": True}).name
            whole = ir.add(scope, "BroadcastTo", [_ref(tensor), rows], device=controller,
                           attrs={"T": dtype, "Tidx": dtypes.int32}).name
        for k, copies in enumerate(self.copies):
            own = copies.get(name)
            source = f"{own}:{idx}" if per_tower and own is not None else (whole or f"{name}:{idx}")
            device = ir.nodes[own].device if per_tower and own is not None else controller
            if per_tower or shared is None:
                base = f"{SCOPE}/{own if per_tower and own else name}_{idx}_{d.dim}"
                axis = ir.const(ir.unique_name(f"{base}/axis"), d.dim, dtypes.int32, device)
                node = ir.add(ir.unique_name(base), "SplitV", [_ref(source), sizes, axis], device=device,
                              attrs={"T": dtype, "Tlen": dtypes.int32, "num_split": n}).name
                shared = node if not per_tower else shared
            part = f"{node if per_tower else shared}:{k}"
            if own is not None:
                readers = [c.name for c, _ in ir.data_consumers(f"{own}:{idx}")
                           if c.name.split("/", 1)[0] == self.towers.prefixes[k] and not c.name.startswith(
                               f"{SCOPE}/")]
                ir.replace_uses(f"{own}:{idx}", part, only=readers)
            else:
                readers = [c.name for c, _ in ir.data_consumers(tensor)
                           if c.name.split("/", 1)[0] == self.towers.prefixes[k]]
                ir.replace_uses(tensor, part, only=readers)

    def _substitute(self, tensor: str, p) -> None:
        """The tower's reader of a fed batch-size scalar reads the tower's count instead."""
        ir = self.ir
        root = self.classes.find(p.cls)
        dtype = dtypes.as_dtype(ir.output_dtype(tensor))
        for k, copies in enumerate(self.copies):
            reader = copies.get(p.via)
            if reader is None:
                continue
            count = self.towers.class_counts[root][k]
            name = ir.unique_name(f"{SCOPE}/{node_of(tensor)}_{k}")
            value = ir.add(name, "Cast", [count], device=ir.nodes[reader].device,
                           attrs={"SrcT": dtypes.int32, "DstT": dtype}).name
            if p.factor != 1:
                factor = ir.const(f"{name}/factor", p.factor, dtype, ir.nodes[reader].device)
                value = ir.add(f"{name}/scaled", "Mul", [value, factor], device=ir.nodes[reader].device,
                               attrs={"T": dtype}).name
            ir.replace_uses(tensor, value, only=[reader])

    def _row_shape(self, name: str, row: tuple[int, ...]) -> None:
        """The tower's copy of Reshape ``name`` infers its row count (``[-1, *row]``)."""
        ir = self.ir
        for copies in self.copies:
            copy = copies.get(name)
            if copy is None:
                continue
            node = ir.nodes[copy]
            dtype = dtypes.as_dtype(node.attrs["Tshape"].type) if "Tshape" in node.attrs else dtypes.int32
            target = ir.const(ir.unique_name(f"{copy}/rows_shape"), [-1, *row], dtype, node.device)
            ir.set_input(copy, 1, target)

    def _slice_pad(self, name: str, forward: str) -> None:
        """The tower's copy of slice gradient ``name`` pads by the tower's forward slice:
        ``[begin, shape(input) - shape(output) - begin]`` per dimension."""
        ir = self.ir
        for copies in self.copies:
            copy, fwd = copies.get(name), copies.get(forward)
            if copy is None or fwd is None:
                raise AnalysisError(f"'{name}': the gradient of a sampled loss's slice and its "
                                    f"forward slice '{forward}' must both run in the towers")
            device = ir.nodes[copy].device
            slicer = ir.nodes[fwd]
            index = dtypes.as_dtype(slicer.attrs["Index"].type)
            begin = slicer.inputs[1]
            base = ir.unique_name(f"{copy}/tower_paddings")
            whole = ir.add(f"{base}/whole", "Shape", [slicer.inputs[0]], device=device,
                           attrs={"T": dtypes.as_dtype(slicer.attrs["T"].type), "out_type": index}).name
            cut = ir.add(f"{base}/cut", "Shape", [fwd], device=device,
                         attrs={"T": dtypes.as_dtype(slicer.attrs["T"].type), "out_type": index}).name
            rest = ir.add(f"{base}/rest", "Sub", [whole, cut], device=device, attrs={"T": index}).name
            after = ir.add(f"{base}/after", "Sub", [rest, begin], device=device, attrs={"T": index}).name
            paddings = ir.add(base, "Pack", [begin, after], device=device,
                              attrs={"T": index, "N": 2, "axis": 1}).name
            ir.set_input(copy, 1, paddings)

    def _relax_element_shapes(self, planned: set[str], static: set[int]) -> list[str]:
        """A tower's TensorArray keeps its rank but not its element dimensions that are a
        multiple of a static batch size, unless the analysis resized them: ``element_shape``
        only checks the elements written, and a static global batch in it (a ``dynamic_rnn``
        over a static batch) would refuse the tower's rows. Relaxing a check changes no value;
        the other dimensions stay (stacking an empty array needs them: an empty tower)."""
        relaxed = []
        if not static:
            return relaxed
        for name in sorted(n.name for n in self.ir if n.op in RELAXED_SHAPE_ATTRS):
            if name in planned:
                continue
            attr = RELAXED_SHAPE_ATTRS[self.ir.nodes[name].op]
            for copies in self.copies:
                copy = copies.get(name)
                if copy is None or attr not in self.ir.nodes[copy].attrs:
                    continue
                out = attr_value_pb2.AttrValue()
                out.CopyFrom(self.ir.nodes[copy].attrs[attr])
                batch = [d for d in out.shape.dim if d.size > 0 and any(d.size % s == 0 for s in static)]
                if out.shape.unknown_rank or not batch:
                    continue
                for d in batch:
                    d.size = -1
                self.ir.set_attr(copy, attr, out)
                relaxed.append(copy)
        return relaxed

    def _relax_call_shapes(self, static: set[int]) -> list[str]:
        """A tower's copy of a cond or loop keeps the ranks of its ``output_shapes`` but not
        the dimensions that equal a static batch size (``tf.cond`` over a static batch of 8
        states ``[8]``, which a tower of 3 contradicts when the graph is imported). It changes
        no value."""
        relaxed = []
        if not static:
            return relaxed
        for name in sorted(n.name for n in self.ir if n.op in RELAXED_CALL_SHAPES):
            for copies in self.copies:
                copy = copies.get(name)
                if copy is None or "output_shapes" not in self.ir.nodes[copy].attrs:
                    continue
                out = attr_value_pb2.AttrValue()
                out.CopyFrom(self.ir.nodes[copy].attrs["output_shapes"])
                known = [d for shape in out.list.shape for d in shape.dim if d.size in static]
                if not known:
                    continue
                for d in known:
                    d.size = -1
                self.ir.set_attr(copy, "output_shapes", out)
                relaxed.append(copy)
        return relaxed

    def _attr(self, name: str, attr: str, dim: int, cls: int, factor: int) -> None:
        counts = self._static(cls)
        for k, copies in enumerate(self.copies):
            copy = copies.get(name)
            if copy is None or attr not in self.ir.nodes[copy].attrs:
                continue
            out = attr_value_pb2.AttrValue()
            out.CopyFrom(self.ir.nodes[copy].attrs[attr])
            out.shape.dim[dim].size = factor * counts[k]
            self.ir.set_attr(copy, attr, out)


def _set(value: np.ndarray, elem: int | None, new: int) -> np.ndarray:
    out = np.array(value)
    if elem is None:
        return np.asarray(new, dtype=out.dtype)
    out.reshape(-1)[elem] = new
    return out


def _rows(value: np.ndarray, d, offset: int, count: int) -> np.ndarray:
    """The tower's rows of a constant with a batch-sized dimension: resized when uniform, else
    the rows of its examples (``block`` rows each, repeated ``outer`` times)."""
    value = np.asarray(value)
    shape = list(value.shape)
    inner, outer = d.block, d.outer
    flat = value.reshape(-1)
    if flat.size and np.all(flat == flat[0]):
        shape[d.dim] = outer * count * inner
        return np.full(shape, flat[0], dtype=value.dtype)
    batch = shape[d.dim] // (outer * inner)
    split = shape[:d.dim] + [outer, batch, inner] + shape[d.dim + 1:]
    taken = value.reshape(split).take(range(offset, offset + count), axis=d.dim + 1)
    shape[d.dim] = outer * count * inner
    return taken.reshape(shape)


def _ref(tensor: str) -> str:
    node, idx = parse_tensor(tensor)
    return node if idx == 0 else f"{node}:{idx}"
