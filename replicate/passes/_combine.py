"""Build the ops that combine N tower copies of a tensor into one value.

Used by the aggregate pass (gradients) and the rewire pass (forward outputs). A kind names
the combination: ``dense``/``mean`` (sum of example-count-weighted parts), ``sum``,
``concat`` (along the batch axis), ``sparse_values`` (weighted, then concatenated),
``sparse_indices`` (concatenated), ``max``, ``min``, ``first`` (tower 0's part) and
``global`` (tower 0's part of a value every tower computes whole, from synchronized sums).
Weights use ``MulNoNan`` so a tower with no examples contributes zero, not NaN.
With gradient accumulation (``towers.micro`` > 1) the sums first run along each device's
micro-batches as a running sum on that device (each micro-batch's part can be freed as soon as
it is added), and only the per-device sums are added (or all-reduced) across devices.
"""

from __future__ import annotations

from tensorflow.python.framework import dtypes

from replicate.batchflow.facts import Towers
from replicate.graph.ir import IR, parse_tensor

__all__ = ["combine", "weight", "KINDS"]

KINDS = frozenset({"dense", "mean", "ratio", "sum", "concat", "sparse_values", "sparse_indices",
                   "max", "min", "first", "global"})
WEIGHTS = "replicate/split/weights"


def _finite_unless_empty(ir: IR, towers: Towers, k: int, name: str, ref: str, dtype, device: str) -> str:
    """Tower ``k``'s gradient ``ref``, its entries that are not finite zeroed when the tower has
    no examples: its own batch statistics over no examples are NaN (batch norm per tower in an
    inexact rewrite), while its share of the terms every tower adds (weight decay, weighed in
    the towers) is finite and kept (review 30: zeroed whole, every variable under weight
    decay lost the tower's share, 4e-4 off, though only another variable was named)."""
    dev = towers.devices[k]
    nonempty = weight(ir, towers, k, dtypes.bool.as_datatype_enum, device, ("nonempty",))
    kept = ir.add(f"{name}/kept", "LogicalOr", [ir.add(f"{name}/finite", "IsFinite", [ref], device=dev,
                                                       attrs={"T": dtype}).name, nonempty], device=dev).name
    zeros = ir.add(f"{name}/zeros", "ZerosLike", [ref], device=dev, attrs={"T": dtype}).name
    return ir.add(name, "SelectV2", [kept, ref, zeros], device=dev, attrs={"T": dtype}).name


def weight(ir: IR, towers: Towers, k: int, dtype: int, device: str,
           spec: tuple = ("count",)) -> str:
    """Tower ``k``'s weight as a scalar of ``dtype`` (the ops are created once per spec).

    Args:
        spec: ``("count",)`` for the tower's share of the first batch class's examples,
            ``("count", c)`` for its share of class ``c``'s, ``("size", t)`` for its share of the
            elements of its copy of tensor ``t``, ``("value", t)`` for its share of the value of
            its copy of ``t``, ``("uniform",)`` for ``1/N``, ``("ones",)`` for 1,
            ``("nonempty",)`` for 1 if the tower has examples, else 0.
    """
    if spec[0] == "count" and len(spec) > 1 and towers.class_counts.get(spec[1]) in (None, towers.counts):
        spec = ("count",)       # the first class is the default one
    key = (k, int(dtype), spec)
    if key in towers.weights:
        return towers.weights[key]
    tf_dtype = dtypes.as_dtype(dtype)
    scope = f"{WEIGHTS}/{tf_dtype.name}"
    n = len(towers.devices)
    if spec == ("nonempty",):
        name = f"{scope}/nonempty_{k}"
        if name not in ir.nodes:
            zero = f"{scope}/nonempty_zero"
            if zero not in ir.nodes:
                ir.const(zero, 0, dtypes.int32, device)
            more = ir.add(f"{name}/more", "Greater", [towers.counts[k], zero], device=device,
                          attrs={"T": dtypes.int32}).name
            ir.add(name, "Cast", [more], device=device, attrs={"SrcT": dtypes.bool, "DstT": tf_dtype})
        towers.weights[key] = name
        return name
    if spec in (("uniform",), ("ones",)):
        name = f"{scope}/{spec[0]}"
        if name not in ir.nodes:
            ir.const(name, 1.0 / n if spec == ("uniform",) else 1.0, tf_dtype, device)
        towers.weights[key] = name
        return name
    counts, batch = towers.counts, towers.batch_size
    if spec[0] == "count" and len(spec) > 1 and spec[1] in towers.class_counts:
        counts, batch = towers.class_counts[spec[1]], towers.class_batch[spec[1]]
        if counts is not towers.counts:
            scope += f"/class_{list(towers.class_counts).index(spec[1])}"
    elif spec[0] != "count":
        scope += f"/{spec[0]}_" + spec[1].replace(":", "_")
    numerators = [f"{scope}/part_{j}" for j in range(n)]
    total = f"{scope}/total"
    if total not in ir.nodes:
        for j, name in enumerate(numerators):
            _numerator(ir, towers, j, name, tf_dtype, spec, device, counts)
        if spec[0] == "count":
            ir.add(total, "Cast", [batch], device=device,
                   attrs={"SrcT": dtypes.int32, "DstT": tf_dtype})
        elif spec[0] == "shifted":
            _shifted_total(ir, towers, total, tf_dtype, spec, device)
        elif len(numerators) == 1:
            ir.add(total, "Identity", numerators, device=device, attrs={"T": tf_dtype})
        else:
            ir.add(total, "AddN", numerators, device=device, attrs={"T": tf_dtype, "N": len(numerators)})
    node = ir.add(f"{scope}/weight_{k}", "DivNoNan", [numerators[k], total], device=device,
                  attrs={"T": tf_dtype})
    towers.weights[key] = node.name
    return node.name


def _shifted_total(ir: IR, towers: Towers, total: str, tf_dtype, spec: tuple, device: str) -> None:
    """The global value of a shifted denominator ``op(S, c)``: ``op`` of the towers' summed
    ``S`` and the shared ``c`` (spec ``("shifted", denominator, op, S, c)``)."""
    _, _, op, s_ref, c_ref = spec
    node, idx = parse_tensor(s_ref)
    sums = []
    for k, prefix in enumerate(towers.prefixes):
        copy = _ref(f"{prefix}/{node}:{idx}")
        src = dtypes.as_dtype(ir.output_dtype(copy))     # the original may be gone (rewire)
        sums.append(ir.add(f"{total}_sum_{k}", "Cast", [copy],
                           device=towers.devices[k], attrs={"SrcT": src, "DstT": tf_dtype}).name)
    summed = ir.add(f"{total}_sum", "AddN", sums, device=device, attrs={"T": tf_dtype, "N": len(sums)})
    c_node, c_idx = parse_tensor(c_ref)
    local = f"{towers.prefixes[0]}/{c_node}"
    c = _ref(f"{local if local in ir.nodes else c_node}:{c_idx}")
    shift = ir.add(f"{total}_shift", "Cast", [c], device=device,
                   attrs={"SrcT": dtypes.as_dtype(ir.output_dtype(c)), "DstT": tf_dtype})
    ir.add(total, op, [summed.name, shift.name], device=device, attrs={"T": tf_dtype})


def _numerator(ir: IR, towers: Towers, k: int, name: str, tf_dtype, spec: tuple, device: str,
               counts: list[str]) -> None:
    if spec[0] == "count":
        ir.add(name, "Cast", [counts[k]], device=device,
               attrs={"SrcT": dtypes.int32, "DstT": tf_dtype})
        return
    node, idx = parse_tensor(spec[1])
    copy = _ref(f"{towers.prefixes[k]}/{node}:{idx}")
    if spec[0] == "size":
        size = ir.add(f"{name}_size", "Size", [copy], device=towers.devices[k],
                      attrs={"T": dtypes.as_dtype(ir.output_dtype(copy)), "out_type": dtypes.int64}).name
        ir.add(name, "Cast", [size], device=towers.devices[k], attrs={"SrcT": dtypes.int64, "DstT": tf_dtype})
    else:
        src = dtypes.as_dtype(ir.output_dtype(copy))
        ir.add(name, "Cast", [copy], device=towers.devices[k], attrs={"SrcT": src, "DstT": tf_dtype})


def combine(ir: IR, towers: Towers, name: str, parts: list[str], kind: str, dtype: int,
            device: str, controller: str, weights: tuple = ("count",),
            allreduce_key: int | None = None, axis: int = 0, tail: int = 0, tail_sum: bool = False,
            outer=1) -> str:
    """Add the ops combining ``parts`` (one tensor per tower) by ``kind``; return the result.

    Args:
        ir: the graph.
        towers: tower facts (devices, counts, weight cache).
        name: node name of the final op; helper ops go under ``<name>_parts/``.
        parts: the tower tensors, in tower order.
        kind: one of :data:`KINDS`.
        dtype: DataType enum of the parts.
        device: device of the combining op (a variable's device or the controller).
        controller: device of the weight computation.
        weights: how towers are weighted for ``dense``, ``mean``, ``ratio`` and
            ``sparse_values`` (see :func:`weight`); ``("ones",)`` sums them unweighted.
        allreduce_key: when set, sums (``dense``, ``mean``, ``ratio``, ``sum``) are all-reduced
            among the tower devices with TensorFlow's collective ops (NCCL on GPUs) under this
            instance key, and the result is read from tower 0.
        axis: the axis ``concat`` joins along (the batch axis of the parts).
        tail: for ``concat``, ``sparse_values`` and ``sparse_indices``: each part ends with
            this many rows shared by every tower (after its batch rows, along ``axis``). The
            batch rows are concatenated in tower order, then the shared rows follow once:
            summed over the towers with ``tail_sum`` (each tower's share of a gradient), else
            tower 0's (the same in every tower).
        outer: for ``concat``: each part holds this many copies of its batch rows one after
            the other along ``axis`` (time-major steps flattened with the batch); the towers'
            rows of each copy are joined, copy after copy. An int, or per part a ``(tensor,
            dimension)`` whose size it is.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown combine kind '{kind}'")
    tf_dtype = dtypes.as_dtype(dtype)
    refs = [_ref(p) for p in parts]
    if kind in ("first", "global"):     # global: every tower's copy is the batch's value
        return ir.add(name, "Identity", [refs[0]], device=device, attrs={"T": tf_dtype}).name
    if kind in ("dense", "mean", "ratio", "sparse_values") and weights == ("nonempty",):
        refs = [_finite_unless_empty(ir, towers, k, f"{name}_parts/kept_{k}", ref, tf_dtype, controller)
                for k, ref in enumerate(refs)]
    elif kind in ("dense", "mean", "ratio", "sparse_values") and weights != ("ones",):
        scaled = []
        for k, ref in enumerate(refs):
            w = weight(ir, towers, k, dtype, controller, weights)
            scaled.append(ir.add(f"{name}_parts/scaled_{k}", "MulNoNan", [ref, w],
                                 device=towers.devices[k], attrs={"T": tf_dtype}).name)
        refs = scaled
    if kind in ("dense", "mean", "ratio", "sum"):
        devices = list(towers.devices)
        if towers.micro > 1 and len(refs) == len(devices):
            refs, devices = _running_sums(ir, towers, name, refs, tf_dtype)
        if allreduce_key is not None and len(refs) > 1:
            return _allreduce(ir, devices, name, refs, tf_dtype, device, allreduce_key)
        if len(refs) == 1:
            return ir.add(name, "Identity", refs, device=device, attrs={"T": tf_dtype}).name
        return ir.add(name, "AddN", refs, device=device, attrs={"T": tf_dtype, "N": len(refs)}).name
    if kind in ("concat", "sparse_values", "sparse_indices") and tail and len(refs) > 1:
        return _concat_with_tail(ir, towers, name, refs, tf_dtype, device,
                                 axis if kind == "concat" else 0, tail, tail_sum)
    if kind == "concat" and outer != 1 and len(refs) > 1:
        return _interleaved(ir, towers, name, refs, tf_dtype, device, axis, outer)
    if kind in ("concat", "sparse_values", "sparse_indices"):
        if len(refs) == 1:
            return ir.add(name, "Identity", refs, device=device, attrs={"T": tf_dtype}).name
        axis_name = f"{name}_parts/axis"
        ir.const(axis_name, axis if kind == "concat" else 0, dtypes.int32, device)
        return ir.add(name, "ConcatV2", refs + [axis_name], device=device,
                      attrs={"T": tf_dtype, "N": len(refs), "Tidx": dtypes.int32}).name
    op = "Maximum" if kind == "max" else "Minimum"
    attrs = {"T": tf_dtype}
    if tf_dtype == dtypes.bool:     # reduce_any / reduce_all over the batch: or / and
        op, attrs = ("LogicalOr" if kind == "max" else "LogicalAnd"), {}
    acc = refs[0]
    for k, ref in enumerate(refs[1:], start=1):
        last = k == len(refs) - 1
        acc = ir.add(name if last else f"{name}_parts/{kind}_{k}", op, [acc, ref], device=device,
                     attrs=attrs).name
    if len(refs) == 1:
        return ir.add(name, "Identity", [acc], device=device, attrs={"T": tf_dtype}).name
    return acc


def _running_sums(ir: IR, towers: Towers, name: str, refs: list[str], tf_dtype):
    """Per device, the running sum of its micro-batches' parts (on that device, in order);
    returns the per-device sums and their devices."""
    sums, devices = [], []
    for i, chain in enumerate(towers.chains()):
        acc, adds = refs[chain[0]], []
        for j in chain[1:]:
            acc = ir.add(f"{name}_parts/accumulate_{i}_{j - chain[0]}", "AddV2", [acc, refs[j]],
                         device=towers.devices[j], attrs={"T": tf_dtype}).name
            adds.append(acc)
        towers.sums.append((list(chain), [refs[j] for j in chain], adds))
        sums.append(acc)
        devices.append(towers.devices[chain[0]])
    return sums, devices


#: Collective group of the towers' all-reduces.
GROUP_KEY = 1


def _allreduce(ir: IR, devices: list[str], name: str, refs: list[str], tf_dtype, device: str,
               instance_key: int) -> str:
    """All-reduce ``refs`` across the tower devices; the result (tower 0's) waits for every
    tower's collective, so none is pruned from a step."""
    n = len(refs)
    scope = f"{name}_parts"
    outputs = []
    for k, ref in enumerate(refs):
        consts = [ir.const(f"{scope}/{what}_{k}", value, dtypes.int32, devices[k])
                  for what, value in (("group_size", n), ("group_key", GROUP_KEY),
                                      ("instance_key", instance_key))]
        outputs.append(ir.add(f"{scope}/allreduce_{k}", "CollectiveReduceV2", [ref] + consts,
                              device=devices[k],
                              attrs={"T": tf_dtype, "merge_op": "Add", "final_op": "Id",
                                     "Nordering_token": 0}).name)
    return ir.add(name, "Identity", [outputs[0]], control=outputs[1:], device=device,
                  attrs={"T": tf_dtype}).name


def _ref(tensor: str) -> str:
    node, idx = parse_tensor(tensor)
    return node if idx == 0 else f"{node}:{idx}"


def _interleaved(ir: IR, towers: Towers, name: str, refs: list[str], tf_dtype, device: str,
                 axis: int, outer) -> str:
    """Parts of ``outer`` copies of their rows each along ``axis``: each viewed as
    ``[..., outer, rows, ...]``, joined along the rows, and viewed back. ``outer`` is an int,
    or per part a ``(tensor, dimension)`` whose size it is (a dynamic number of time steps,
    read from the tower's own copy of the tensor it was inferred from)."""
    i32 = dtypes.int32

    def size(ref: str, scope: str, dev: str, begin: list[int], length: list[int]) -> str:
        shape = ir.add(f"{scope}/shape", "Shape", [ref], device=dev,
                       attrs={"T": ir.output_dtype(ref), "out_type": i32}).name
        return ir.add(f"{scope}/slice", "Slice", [shape, ir.const(f"{scope}/begin", begin, i32, dev),
                                                  ir.const(f"{scope}/size", length, i32, dev)],
                      device=dev, attrs={"T": i32, "Index": i32}).name

    def view(ref: str, scope: str, dev: str, middle: list[str], skip: int) -> str:
        """The shape of ``ref`` with dimensions ``axis`` to ``axis + skip`` replaced by
        ``middle`` (1-element vectors)."""
        parts = [size(ref, f"{scope}/head", dev, [0], [axis])] + middle + \
            [size(ref, f"{scope}/rest", dev, [axis + skip], [-1])]
        return ir.add(f"{scope}/target", "ConcatV2", parts + [ir.const(f"{scope}/axis", 0, i32, dev)],
                      device=dev, attrs={"T": i32, "N": len(parts), "Tidx": i32}).name

    viewed = []
    for k, ref in enumerate(refs):
        scope, dev = f"{name}_parts/tower_{k}", towers.devices[k]
        if isinstance(outer, int):
            copies = ir.const(f"{scope}/copies", [outer], i32, dev)
        else:
            copies = size(_ref(outer[k][0]), f"{scope}/copies", dev, [outer[k][1]], [1])
        target = view(ref, scope, dev, [copies, ir.const(f"{scope}/rows", [-1], i32, dev)], 1)
        viewed.append(ir.add(f"{scope}/copies_view", "Reshape", [ref, target], device=dev,
                             attrs={"T": tf_dtype, "Tshape": i32}).name)
    along = ir.const(f"{name}_parts/axis", axis + 1, i32, device)
    joined = ir.add(f"{name}_parts/joined", "ConcatV2", viewed + [along], device=device,
                    attrs={"T": tf_dtype, "N": len(viewed), "Tidx": i32}).name
    target = view(joined, f"{name}_parts/flat", device, [ir.const(f"{name}_parts/rows", [-1], i32, device)], 2)
    return ir.add(name, "Reshape", [joined, target], device=device,
                  attrs={"T": tf_dtype, "Tshape": i32}).name


def _concat_with_tail(ir: IR, towers: Towers, name: str, refs: list[str], tf_dtype, device: str,
                      axis: int, tail: int, tail_sum: bool) -> str:
    """The towers' batch rows in tower order, then their ``tail`` shared rows once (summed, or
    tower 0's): the single-device rows in the single-device order."""
    heads, tails = [], []
    for k, ref in enumerate(refs):
        scope = f"{name}_parts/tower_{k}"
        sizes = ir.const(f"{scope}/sizes", [-1, tail], dtypes.int32, towers.devices[k])
        along = ir.const(f"{scope}/axis", axis, dtypes.int32, towers.devices[k])
        cut = ir.add(f"{scope}/split", "SplitV", [ref, sizes, along], device=towers.devices[k],
                     attrs={"T": tf_dtype, "Tlen": dtypes.int32, "num_split": 2}).name
        heads.append(cut)
        tails.append(f"{cut}:1")
    if tail_sum:
        shared = ir.add(f"{name}_parts/shared_rows", "AddN", tails, device=device,
                        attrs={"T": tf_dtype, "N": len(tails)}).name
    else:
        shared = tails[0]
    along = ir.const(f"{name}_parts/axis", axis, dtypes.int32, device)
    pieces = heads + [shared]
    return ir.add(name, "ConcatV2", pieces + [along], device=device,
                  attrs={"T": tf_dtype, "N": len(pieces), "Tidx": dtypes.int32}).name
