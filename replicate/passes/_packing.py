"""Helper of the aggregate pass: aggregate many dense gradients through a few flat buffers.

Per tower, gradients that share a dtype, a weighting and a destination device are flattened
and concatenated into one buffer, weighted once, summed across towers once, then split and
reshaped back. Fewer, larger transfers and ops; the arithmetic per element is unchanged
(one weighted sum), so the result is the same as aggregating each gradient alone.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np
from tensorflow.python.framework import dtypes

from replicate.batchflow.facts import Frontier, Towers
from replicate.graph.ir import IR, parse_tensor
from replicate.passes._combine import combine

__all__ = ["pack", "MAX_BUFFER_ELEMENTS"]

log = logging.getLogger(__name__)

#: Largest buffer, in elements; bigger gradients are aggregated alone.
MAX_BUFFER_ELEMENTS = 1 << 22


def pack(ir: IR, towers: Towers, frontier: list[Frontier], copies: list[dict[str, str]],
         device_of, controller: str, scope: str, keys=None, group_of=None) -> dict[str, str]:
    """Aggregate packable dense gradients of ``frontier``; return tensor -> aggregate.

    Gradients need a fully known static shape to be packed; others are left to the caller.
    ``keys`` (an iterator of collective instance keys) makes each buffer's sum an all-reduce.
    ``group_of(f)`` keeps gradients of different groups (gradient computations) apart.
    """
    groups: dict[tuple, list[tuple[str, list[int]]]] = defaultdict(list)
    for f in frontier:
        shape = ir.static_shape(f.tensor)
        if f.role != "dense" or f.tail or not shape or None in shape or np.prod(shape) > MAX_BUFFER_ELEMENTS:
            continue
        group = group_of(f) if group_of is not None else ""
        groups[(ir.output_dtype(f.tensor), f.weights, device_of(f), group)].append((f.tensor, shape))
    out: dict[str, str] = {}
    for index, ((dtype, weights, device, _), members) in enumerate(groups.items()):
        if len(members) < 2:
            continue
        for chunk, part in enumerate(_chunks(members)):
            out.update(_pack_group(ir, towers, copies, part, dtype, weights, device, controller,
                                   f"{scope}/packed_{index}_{chunk}",
                                   next(keys) if keys is not None else None))
    log.info("packed %d gradients into %d buffers", len(out), len({v.rsplit("/", 1)[0] for v in out.values()}))
    return out


def _chunks(members):
    chunk, size = [], 0
    for member in members:
        n = int(np.prod(member[1]))
        if chunk and size + n > MAX_BUFFER_ELEMENTS:
            yield chunk
            chunk, size = [], 0
        chunk.append(member)
        size += n
    if chunk:
        yield chunk


def _pack_group(ir: IR, towers: Towers, copies, members, dtype, weights, device, controller, name,
                key=None):
    tf_dtype = dtypes.as_dtype(dtype)
    flat_shape = f"{name}/flat_shape"
    ir.const(flat_shape, [-1], dtypes.int32, controller)
    buffers = []
    for k, tower_device in enumerate(towers.devices):
        flats = []
        for i, (tensor, _) in enumerate(members):
            node, idx = parse_tensor(tensor)
            src = copies[k][node] if idx == 0 else f"{copies[k][node]}:{idx}"
            flats.append(ir.add(f"{name}/tower_{k}/flat_{i}", "Reshape", [src, flat_shape],
                                device=tower_device, attrs={"T": tf_dtype, "Tshape": dtypes.int32}).name)
        axis = ir.const(f"{name}/tower_{k}/axis", 0, dtypes.int32, tower_device)
        buffers.append(ir.add(f"{name}/tower_{k}/buffer", "ConcatV2", flats + [axis], device=tower_device,
                              attrs={"T": tf_dtype, "N": len(flats), "Tidx": dtypes.int32}).name)
    kind = "sum" if weights == ("ones",) else "dense"
    total = combine(ir, towers, f"{name}/sum", buffers, kind, dtype, device, controller, weights, key)
    sizes = ir.const(f"{name}/sizes", [int(np.prod(s)) for _, s in members], dtypes.int32, device)
    axis = ir.const(f"{name}/split_axis", 0, dtypes.int32, device)
    split = ir.add(f"{name}/split", "SplitV", [total, sizes, axis], device=device,
                   attrs={"T": tf_dtype, "Tlen": dtypes.int32, "num_split": len(members)}).name
    out = {}
    for i, (tensor, shape) in enumerate(members):
        target = ir.const(f"{name}/shape_{i}", shape, dtypes.int32, device)
        piece = split if i == 0 else f"{split}:{i}"
        out[tensor] = ir.add(f"{name}/grad_{i}", "Reshape", [piece, target], device=device,
                             attrs={"T": tf_dtype, "Tshape": dtypes.int32}).name
    return out
