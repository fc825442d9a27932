"""Rewrite constants that bake the global batch size into each tower's own batch size.

Requires: ``ir.facts["analysis"]`` with a static batch size and its ``rebatch`` plan (found by
the analyze pass, see :mod:`replicate.passes._static`), ``ir.facts["towers"]`` with static
per-tower counts, and ``ir.facts["copies"]`` from the clone pass.

Produces: in each tower whose count ``n_k`` differs from the global batch ``B``, the copies of
the planned constants rewritten: shapes have their leading element scaled by ``n_k / B``
(reshape targets, tile multiples, fill dims, folded shapes of per-example tensors), the
element-count factor of a ``Mean`` gradient likewise, uniform tensors (a folded
``zeros_like`` of a per-example tensor) are resized along axis 0, and shape attributes
(``ops.SHAPE_ATTRS``) get leading dimension ``n_k``. With a dynamic batch size there is
nothing to do.
"""

from __future__ import annotations

import logging

import numpy as np
from tensorflow.core.framework import attr_value_pb2

from replicate.ir import IR
from replicate.pipeline import PassResult

__all__ = ["Rebatch"]

log = logging.getLogger(__name__)


class Rebatch:
    """Static batch-size rewrite (no options)."""

    name = "rebatch"

    def run(self, ir: IR) -> PassResult:
        analysis = ir.facts["analysis"]
        towers = ir.facts["towers"]
        batch = analysis.static_batch
        if batch is None or towers.static_counts is None:
            return PassResult(ir, False)
        plan = analysis.rebatch
        rewrites = 0
        for k, copies in enumerate(ir.facts["copies"]):
            count = towers.static_counts[k]
            if count == batch:
                continue
            for name, how in plan.items():
                if name not in copies:
                    continue
                copy = copies[name]
                value = ir.const_value(name)
                if how == "shape":
                    value = np.array(value)
                    value[0] = value[0] // batch * count
                    ir.set_const(copy, value)
                elif how == "fill":
                    value = np.array(value)
                    shape = (value.shape[0] // batch * count,) + value.shape[1:]
                    ir.set_const(copy, np.full(shape, value.reshape(-1)[0], dtype=value.dtype))
                elif how == "factor":
                    ir.set_const(copy, np.array(value) * count / batch)
                else:
                    ir.set_attr(copy, how, _resize(ir.nodes[name].attrs[how], count))
                rewrites += 1
        ir.facts["rebatched"] = sorted(plan)
        log.info("rebatch: %d constants and attributes rewritten for static batch %d", rewrites, batch)
        return PassResult(ir, rewrites > 0)


def _resize(attr: attr_value_pb2.AttrValue, count: int) -> attr_value_pb2.AttrValue:
    out = attr_value_pb2.AttrValue()
    out.CopyFrom(attr)
    out.shape.dim[0].size = count
    return out
