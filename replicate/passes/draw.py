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
device makes. An empty tower keeps zero rows. ``same`` draws need nothing here (the clone
pass kept their seeds). Offsets are computed once per batch class on the controller
(``replicate/draw/class_<c>/offset_<k>``). ``ir.facts["draws"]`` lists the ops rewritten.

Cost: every tower draws ``B`` rows instead of ``n_k`` (N times the random numbers of one
device, spread over N devices) and holds one ``B``-row buffer until the slice.

``body`` draws (a dropout mask inside a ``tf.cond`` branch under a training flag) are
rewritten inside the branches (:mod:`replicate.passes._body_draws`): each tower's copy of the
cond calls branches that take the global batch size and the tower's first row as two more
arguments.
"""

from __future__ import annotations

import logging

import numpy as np
from tensorflow.python.framework import dtypes

from replicate.ir import IR, Node
from replicate.passes._body_draws import rewire_call, rewrite_branches
from replicate.pipeline import PassResult

__all__ = ["Draw", "SCOPE"]

log = logging.getLogger(__name__)

SCOPE = "replicate/draw"


class Draw:
    """Rewrite of reproducible random draws (no options: everything comes from the facts)."""

    name = "draw"

    def run(self, ir: IR) -> PassResult:
        analysis = ir.facts["analysis"]
        towers = ir.facts["towers"]
        copies = ir.facts["copies"]
        rows = [d for d in analysis.draws.values() if d.kind in ("rows", "body")]
        offsets: dict[int, list[str]] = {}
        done = []
        for draw in rows:
            if draw.cls not in offsets:
                offsets[draw.cls] = self._offsets(ir, towers, draw.cls)
            for k in range(len(towers.prefixes)):
                copy = copies[k].get(draw.name)
                if copy is None:
                    continue
                if draw.kind == "body":
                    branches = rewrite_branches(ir, draw.name, draw)   # conds and loops
                    rewire_call(ir, copy, branches, towers.class_batch[draw.cls], offsets[draw.cls][k])
                else:
                    self._rows(ir, copy, draw, towers.class_batch[draw.cls],
                               towers.class_counts[draw.cls][k], offsets[draw.cls][k])
                done.append(copy)
        ir.facts["draws"] = done
        log.info("draw: %d random ops reproduce the single-device draw (%d tower copies)",
                 len(rows), len(done))
        return PassResult(ir, bool(done))

    @staticmethod
    def _offsets(ir: IR, towers, cls: int) -> list[str]:
        """Where each tower's examples start, on the controller."""
        scope = f"{SCOPE}/class_{cls}"
        counts = towers.class_counts[cls]
        device = ir.nodes[counts[0].split(":")[0]].device
        static = towers.class_static.get(cls)
        if static is not None:
            return [ir.const(f"{scope}/offset_{k}", int(sum(static[:k])), dtypes.int32, device)
                    for k in range(len(counts))]
        out = [ir.const(f"{scope}/offset_0", 0, dtypes.int32, device)]
        for k in range(1, len(counts)):
            out.append(ir.add(f"{scope}/offset_{k}", "AddV2", [out[-1], counts[k - 1]],
                              device=device, attrs={"T": dtypes.int32}).name)
        return out

    @staticmethod
    def _rows(ir: IR, copy: str, draw, batch: str, count: str, offset: str) -> None:
        node = ir.nodes[copy]
        shape = node.inputs[0]
        index = dtypes.as_dtype(ir.output_dtype(shape))
        out_type = dtypes.as_dtype(ir.output_dtype(f"{copy}:0"))
        dev = node.device
        base = f"{copy}/global_draw"
        onehot = np.zeros(draw.rank, dtype=index.as_numpy_dtype)
        onehot[draw.axis] = 1

        def cast(ref: str, name: str) -> str:
            if index == dtypes.int32:
                return ref
            return ir.add(f"{base}/{name}", "Cast", [ref], device=dev,
                          attrs={"SrcT": dtypes.int32, "DstT": index, "Truncate": False}).name

        def op(name: str, kind: str, inputs: list[str], dtype=index, **attrs) -> str:
            return ir.add(f"{base}/{name}", kind, inputs, device=dev, attrs={"T": dtype, **attrs}).name

        hot = ir.const(f"{base}/axis_mask", onehot, index, dev)
        axis = ir.const(f"{base}/axis", draw.axis, dtypes.int32, dev)
        local = ir.add(f"{base}/local_rows", "GatherV2", [shape, axis, axis], device=dev,
                       attrs={"Tparams": index, "Tindices": dtypes.int32, "Taxis": dtypes.int32}).name
        grow = op("grow", "Mul", [hot, op("missing", "Sub", [cast(batch, "batch"), local])])
        global_shape = op("shape", "AddV2", [shape, grow])
        one = ir.const(f"{base}/one", 1, index, dev)
        begin = op("begin", "Mul", [hot, cast(offset, "offset")])
        size = op("size", "Sub", [op("rows_plus_one", "Mul", [hot, op("count_plus_one", "AddV2",
                                                                      [cast(count, "count"), one])]),
                                  one])
        readers = list(ir.nodes[copy].inputs)
        ir.remove_many([copy])
        ir.add_node(Node(base, node.op, [global_shape] + readers[1:], list(node.control), dev,
                         dict(node.attrs)))
        ir.add(copy, "Slice", [base, begin, size], device=dev, attrs={"T": out_type, "Index": index})
