"""Say clearly when a tower has too few examples for an op that picks examples by position.

Requires: the clone pass's tower copies (``ir.facts["copies"]``) and
``ir.facts["analysis"]`` (its settled dataflow, ``analysis.flow``).

Produces: ``ir.facts["min_batch"]`` (the smallest global batch every tower can run, and the
ops that need it) and, before every tower copy of a forward op that picks a fixed example
(a constant position) of the tower's batch
(``x[0]``, ``tf.gather(x, [2])``, the first element ``tf.scan`` reads to start, an
``argmax`` over the batch, ...), or any position of a tensor that already mixes the tower's
examples along an axis of no static length (``tf.sort(losses)[k]``, a batch quantile), an
``Assert`` that the tower holds enough examples, as a control input of the copy. Nothing else
changes: with enough examples the assertion passes and the values are the same. A pick that
only logging reads (a print, a summary) is padded to the examples it needs instead
(:mod:`replicate.passes._logged`): it cannot change what a step trains.

Why: such an op is what makes a rewrite inexact ("picks one example": each tower picks its own
first example), and the report says so. But with fewer examples in a step than towers -- the
last, short batch of an epoch -- a tower gets none, and the op fails with TensorFlow's "slice
index 0 of dimension 0 out of bounds" under a tower's name. The assertion fails instead, first,
with a message that names the op, the tower, and the batch size the step needs.
"""

from __future__ import annotations

import numpy as np
from tensorflow.python.framework import dtypes

from replicate.batchflow.lattice import MIXED, PART
from replicate.batchflow.rules.layout import strided_entries
from replicate.batchflow.rules.slicing import keeps_axis
from replicate.graph.frames import opening
from replicate.graph.ir import IR, Node, node_of, parse_tensor, tensor_name
from replicate.passes._logged import Bodies, logged_only, pad_logged

__all__ = ["MARKER", "assert_examples", "behind_check", "PICK_OPS"]

#: The start of every assertion message (the certificate recognizes it).
MARKER = "replicate: a tower has too few examples"

#: Op type -> (input picked from, input of the position(s), how a tower's count is read):
#: "shape" (the picked tensor's size along its batch axis), "list" (a TensorList's length),
#: "array" (a TensorArray's size; the flow is input 2).
PICK_OPS = {
    "StridedSlice": (0, 1, "shape"),
    "Slice": (0, 1, "shape"),
    "GatherV2": (0, 1, "shape"),
    "Gather": (0, 1, "shape"),
    "ResourceGather": (0, 1, "shape"),
    "GatherNd": (0, 1, "shape"),
    "TensorListGetItem": (0, 1, "list"),
    "TensorArrayReadV3": (0, 1, "array"),
    "TopKV2": (0, 1, "shape"),
    "NthElement": (0, 1, "shape"),
    "ArgMax": (0, 1, "shape"),      # input 1 is the axis: over the batch, it needs one example
    "ArgMin": (0, 1, "shape"),
    # a softmax over classes that are the tower's examples (in-batch negatives: logits
    # ``a @ b^T``, labels ``tf.range(n)``) rejects an empty class axis; input 0 stands in for
    # the position, which is always the first class
    "SparseSoftmaxCrossEntropyWithLogits": (0, 0, "classes"),
    "SoftmaxCrossEntropyWithLogits": (0, 0, "classes"),
    # reflection padding along the batch axis mirrors examples: it needs more than its padding
    "MirrorPad": (0, 1, "shape"),
}

#: Ops that pick along their input's last axis.
_LAST_AXIS = frozenset({"TopKV2", "NthElement", "SparseSoftmaxCrossEntropyWithLogits",
                        "SoftmaxCrossEntropyWithLogits"})

#: Ops whose position input may be computed at run time: the assertion compares the tower's
#: count with it (``tf.nn.top_k(losses, tf.maximum(1, n // 2))``: k of the tower's own count;
#: ``per[tf.shape(x)[0] - 1]``, review 32).
_RUN_TIME = frozenset({"TopKV2", "NthElement", "GatherV2", "Gather", "ResourceGather", "StridedSlice"})

#: Of those, ops whose positions are indices: the tower needs the largest one plus one
#: (``tf.gather(losses, [random_uniform([], 0, B)])``, a random anchor: an empty tower failed
#: in the gradient's segment sum with TensorFlow's "out of range", review 11).
_INDICES = frozenset({"GatherV2", "Gather", "ResourceGather"})

SCOPE = "replicate/examples"


def assert_examples(ir: IR) -> int:
    """Add the assertions (see the module docstring); returns how many ops got one."""
    flow, copies = ir.facts["analysis"].flow, ir.facts["copies"]
    if flow is None:
        return 0
    done, needs = 0, {}
    towers = ir.facts["towers"]
    grads = tuple(f"{s.prefix}/" for s in ir.facts["analysis"].scopes)
    dead = _unread(ir, {c for names in copies for c in names.values()})
    differentiated = _differentiated(copies[0] if copies else {}, grads)
    bodies = Bodies(ir)
    for k, names in enumerate(copies):
        prefix = f"{towers.prefixes[k]}/"
        # what logged_only needs of the tower: its gradient scopes, its differentiated ops,
        # the walker of the bodies (built once per tower, not per pick)
        tower = (tuple(prefix + g for g in grads), {prefix + n for n in differentiated}, bodies)
        # a batch input's slice for the tower is read as the input (``x[0]`` of a placeholder)
        inputs = {tensor_name(*parse_tensor(v)): o for o, v in towers.inputs[k].items()}
        for name, copied in names.items():
            copy = ir.nodes.get(copied)
            if copy is None or copy.op not in PICK_OPS or copied in dead and not any(
                    o.startswith(tuple(f"{s}{name}_grad/" for s in grads)) for o in names):
                continue        # never run, nor its gradient (which fails as the pick does)
            data, where, kind = PICK_OPS[copy.op]
            position = 0 if kind == "classes" else _constant(ir, copy.inputs[where])
            if name in flow.ctx.gradient or (position is None and copy.op not in _RUN_TIME):
                continue    # gradient code, or bounds known only at run time (a concat's
                            # gradient slicing its pieces apart): no fixed example is picked
            source = tensor_name(*parse_tensor(copy.inputs[data]))
            original = inputs.get(source) or (source[len(prefix):] if source.startswith(prefix) else source)
            spec = flow.ctx.shape(inputs.get(copy.inputs[1]) or copy.inputs[1][len(prefix):]) \
                if copy.op == "StridedSlice" else None
            axis = _batch_axis(ir, flow, copy, name, original, spec)
            if axis is None:
                continue
            mixed = original if flow.fact(original).kind == MIXED else None
            rank = flow.ctx.rank(original)
            if not _along(ir, copy, axis) or not _restricts(ir, copy, axis, rank) or \
                    copy.op == "Slice" and name in flow.ctx.ir.nodes and keeps_axis(flow.ctx, flow.ctx.ir.nodes[name]):
                continue    # a gather along another axis, or per example (batch_dims), or a
                            # slice that keeps every example (``sel[:, None]``): its positions
                            # are no examples' (an assertion on them misfired, review 31)
            framed = opening(ir, copy.name) is not None
            logged = (position is not None or not framed) and _paddable(ir, copy, kind, position, tower)
            if framed and not logged:
                continue    # in a TF1 loop: an assertion there needs the frame's plumbing (its
                            # constants outside the frame failed the step, review 16); a pick
                            # only logged is padded, its constants run in the loop's frame
            if logged:
                need = (_needed(ir, copy, axis, where) if position is not None
                        else _largest_plus_one(ir, copy, copy.inputs[where]) if copy.op in _INDICES
                        else _position_plus_one(ir, copy, axis, rank, spec) if copy.op == "StridedSlice"
                        else copy.inputs[where])
                if need is not None:
                    pad_logged(ir, copy, axis, need, dtypes.as_dtype(ir.output_dtype(copy.inputs[0])),
                               framed)
                    done += 1
                continue
            if position is None and copy.op in _INDICES:
                indices = copy.inputs[where]
                check = _assert(ir, copy, k, axis, _largest_plus_one(ir, copy, indices),
                                kind, len(copies), mixed)
                # the gradient reads the indices, not the gather: it must wait for the check too
                # (its segment sum failed first, with TensorFlow's "out of range")
                behind_check(ir, indices, check, f"{copy.name}/{SCOPE}/checked_indices", copy.device,
                             prefix, SCOPE)
            elif position is None and copy.op == "StridedSlice":
                need = _position_plus_one(ir, copy, axis, rank, spec)
                if need is None:
                    continue        # a range of examples, bounds at run time: no failure
                check = _assert(ir, copy, k, axis, need, kind, len(copies), mixed)
                behind_check(ir, copy.inputs[1], check, f"{copy.name}/{SCOPE}/checked_begin",
                             copy.device, prefix, SCOPE)    # (its gradient reads it too)
            elif position is None:
                check = _assert(ir, copy, k, axis, copy.inputs[where], kind, len(copies), mixed)
            else:
                needs[name] = _needed(ir, copy, axis, where)
                check = _assert(ir, copy, k, axis, needs[name], kind, len(copies), mixed)
            _gradient_waits(ir, names, name, check, grads)
            done += 1
    if needs:
        ir.facts["min_batch"] = {"batch": max(needs.values()) * len(copies), "ops": sorted(needs)}
    return done


def _differentiated(names: dict[str, str], grads: tuple[str, ...]) -> set[str]:
    """The forward ops of ``names`` (one tower's originals) that gradient code differentiates
    (``gradients/<op>_grad/...`` exists)."""
    return {original[len(s):].split("_grad/", 1)[0] for original in names for s in grads
            if original.startswith(s) and "_grad/" in original}


def _paddable(ir: IR, copy: Node, kind: str, position, tower: tuple) -> bool:
    """Whether tower copy ``copy`` picks examples that only logging reads (``tower``: the last
    arguments of :func:`~replicate.passes._logged.logged_only`), and can be padded to the count
    it needs (a run-time n-th element, picks from lists and softmax classes keep their
    assertion)."""
    dtype = dtypes.as_dtype(ir.output_dtype(copy.inputs[0]))
    return (kind == "shape" and not (copy.op == "NthElement" and position is None)
            and dtype not in (dtypes.string, dtypes.resource, dtypes.variant)
            and logged_only(ir, copy.name, *tower))


def _unread(ir: IR, names: set[str]) -> set[str]:
    """Tower copies no op needs, by data or control, through other such copies: stateless
    ones a step never runs (a tower's pick of its worst example for a summary that now reads
    the batch's, review 44). Their check would never run either; the warning that a step needs
    enough examples for them was untrue."""
    def stateless(name: str) -> bool:
        op_def = ir.op_def(ir.nodes[name].op)
        return op_def is not None and not op_def.is_stateful

    waiting = {n: len(ir.consumers(n)) for n in names if n in ir.nodes}
    work = [n for n, count in waiting.items() if count == 0 and stateless(n)]
    dead: set[str] = set()
    while work:
        name = work.pop()
        dead.add(name)
        node = ir.nodes[name]
        for producer in dict.fromkeys([node_of(r) for r in node.inputs] + list(node.control)):
            if producer in waiting and producer not in dead:
                waiting[producer] -= 1
                if waiting[producer] == 0 and stateless(producer):
                    work.append(producer)
    return dead


def _batch_axis(ir: IR, flow, copy: Node, name: str, picked: str, spec: list | None) -> int | None:
    """The axis of ``picked`` that forward op ``name`` (tower copy ``copy``) picks along and
    that may be as short as a tower's batch: the batch axis when ``name`` is what makes the
    rewrite inexact by picking from it; the axis the op picks along when ``picked`` already
    mixes the examples and has no static length there (``tf.sort(losses)[k]``,
    ``tf.unique(labels)[0][0]``, in-batch logits ``a @ b^T``: as long as the tower makes it);
    else None. A softmax's classes are its last axis: the tower's examples when that is the
    batch axis, or when the logits mix them and it has no static length. ``spec``: the shape
    of a strided slice's begin."""
    fact, out = flow.fact(picked), flow.fact(f"{name}:0")
    classes = PICK_OPS[copy.op][2] == "classes"
    if fact is None or not classes and (out is None or out.kind != MIXED):
        return None
    if fact.kind == PART and not classes:
        return fact.axis if out.src == name else None
    shape = flow.ctx.shape(picked)
    if fact.kind not in (PART, MIXED) or not shape:
        return None
    if copy.op == "StridedSlice" and not _shrinks(copy, len(shape), spec):
        return None         # a range of a mixed tensor: never out of bounds
    axis = 0
    if copy.op in _LAST_AXIS:
        axis = len(shape) - 1
    elif copy.op in ("ArgMax", "ArgMin"):
        value = _constant(ir, copy.inputs[1])
        if value is None or np.ndim(value) != 0 or not -len(shape) <= int(value) < len(shape):
            return None
        axis = int(value) % len(shape)
    if fact.kind == PART:
        return axis if fact.axis == axis else None
    return axis if shape[axis] is None else None


def _shrinks(copy: Node, rank: int, spec: list | None) -> bool:
    """Whether strided slice ``copy`` of a rank-``rank`` tensor picks one element of axis 0."""
    if not spec or len(spec) != 1 or not isinstance(spec[0], int):
        return False
    _, _, ell, new, shrink = _masks(copy)
    entry = next((e for e in strided_entries(rank, spec[0], ell, new, shrink) if e[0] == 0), None)
    return entry is not None and entry[1] is None and entry[2] is not None


def behind_check(ir: IR, indices: str, check: str, name: str, device: str, prefix: str,
                 scope: str) -> str:
    """Every reader of ``indices`` in the tower ``prefix`` (outside ``scope``, the check's own
    ops, and the ops the check waits for) reads them through an ``Identity`` named ``name``
    that waits for ``check``: the op and its gradient, which reads the indices too. Returns the
    identity's tensor. (Class weights gathered by the labels, ``tf.gather(weights, y)``, are
    counted from the same labels, through nodes outside the tower too: a synchronized maximum
    sizes the counts. Their counting must not wait for the check it feeds.)"""
    guarded = ir.add(name, "Identity", [indices], [check], device=device,
                     attrs={"T": dtypes.as_dtype(ir.output_dtype(indices))}).name
    before = ir.ancestors([check])
    readers = [c.name for c, _ in ir.data_consumers(indices)
               if c.name.startswith(prefix) and f"/{scope}/" not in c.name and c.name not in before]
    ir.replace_uses(indices, guarded, only=readers)
    return guarded


def _gradient_waits(ir: IR, names: dict[str, str], name: str, check: str, scopes: tuple[str, ...]) -> None:
    """The tower's copies (``names``) of op ``name``'s gradient code wait for ``check``: a
    pick's gradient places the incoming gradient at the position picked and fails as the pick
    does, and when the loss is the pick itself nothing makes it wait (review 34:
    ``tf.sort(l)[1]``)."""
    inside = tuple(f"{s}{name}_grad/" for s in scopes)
    for original, copied in names.items():
        node = ir.nodes.get(copied)
        if node is not None and original.startswith(inside) and check not in node.control:
            ir.set_control(copied, node.control + [check])


def _along(ir: IR, copy: Node, axis: int) -> bool:
    """False for a gather whose positions do not index the batch axis ``axis``."""
    if copy.op in ("ArgMax", "ArgMin"):
        value = _constant(ir, copy.inputs[1])
        rank = len(ir.static_shape(copy.inputs[0]) or []) or None
        return value is None or np.ndim(value) != 0 or int(value) == axis or (rank and int(value) + rank == axis)
    if copy.op != "GatherV2":
        return True
    if int(copy.attr("batch_dims", 0) or 0):
        return False
    value = _constant(ir, copy.inputs[2]) if len(copy.inputs) > 2 else None
    if value is None or np.ndim(value) != 0:
        return True
    rank = len(ir.static_shape(copy.inputs[0]) or []) or None
    at = int(value)
    return (at + rank if at < 0 and rank else at) == axis


def _restricts(ir: IR, copy: Node, axis: int, rank: int | None) -> bool:
    """False for a strided slice whose spec keeps the whole axis ``axis`` (all of it, stride
    1, or an axis the spec does not reach), whatever new axes it adds."""
    if copy.op != "StridedSlice":
        return True
    begin, strides = (_constant(ir, copy.inputs[i]) for i in (1, 3))
    if begin is None or strides is None or np.ndim(begin) != 1 or rank is None:
        return True
    bm, em, ell, new, shrink = _masks(copy)
    for din, dout, i in strided_entries(rank, len(begin), ell, new, shrink):
        if din == axis:
            return i is not None and not ((bm >> i) & 1 and (em >> i) & 1 and int(strides[i]) == 1)
    return False


def _masks(copy: Node) -> tuple[int, ...]:
    """A strided slice's begin, end, ellipsis, new-axis and shrink masks."""
    return tuple(int(copy.attr(k, 0)) for k in ("begin_mask", "end_mask", "ellipsis_mask",
                                                 "new_axis_mask", "shrink_axis_mask"))


def _position_plus_one(ir: IR, copy: Node, axis: int, rank: int | None, spec: list | None) -> str | None:
    """A tensor of the tower: how many examples strided slice ``copy`` needs to pick one at a
    position computed at run time, ``p + 1`` (or ``-p`` from the end); None unless it picks one
    example on ``axis`` (a shrunk axis)."""
    if rank is None or not spec or len(spec) != 1 or not isinstance(spec[0], int):
        return None
    _, _, ell, new, shrink = _masks(copy)
    entry = next((e for e in strided_entries(rank, spec[0], ell, new, shrink) if e[0] == axis), None)
    if entry is None or entry[1] is not None or entry[2] is None:
        return None
    scope, dev = f"{copy.name}/{SCOPE}", copy.device
    index = dtypes.as_dtype(ir.output_dtype(copy.inputs[1]))
    at = ir.add(f"{scope}/position", "GatherV2", [copy.inputs[1], ir.const(f"{scope}/entry", entry[2], dtypes.int32, dev),
                                                  ir.const(f"{scope}/first", 0, dtypes.int32, dev)],
                device=dev, attrs={"Tparams": index, "Tindices": dtypes.int32, "Taxis": dtypes.int32}).name
    after = ir.add(f"{scope}/position_plus_one", "AddV2", [at, ir.const(f"{scope}/one", 1, index, dev)],
                   device=dev, attrs={"T": index}).name
    back = ir.add(f"{scope}/from_the_end", "Neg", [at], device=dev, attrs={"T": index}).name
    return ir.add(f"{scope}/position_needs", "Maximum", [after, back], device=dev, attrs={"T": index}).name


def _largest_plus_one(ir: IR, copy: Node, indices: str) -> str:
    """A tensor of the tower: the largest of ``indices`` plus one (the examples it needs), 0 for
    no indices (the largest of none is the dtype's least value: an int64 one plus one, cast to
    int32, was 1, and the check failed on an empty tower that gathers nothing)."""
    scope, dev = f"{copy.name}/{SCOPE}", copy.device
    index = dtypes.as_dtype(ir.output_dtype(indices))
    flat = ir.add(f"{scope}/indices", "Reshape", [indices, ir.const(f"{scope}/flat", [-1], dtypes.int32, dev)],
                  device=dev, attrs={"T": index, "Tshape": dtypes.int32}).name
    top = ir.add(f"{scope}/largest", "Max", [flat, ir.const(f"{scope}/all", 0, dtypes.int32, dev)],
                 device=dev, attrs={"T": index, "Tidx": dtypes.int32, "keep_dims": False}).name
    after = ir.add(f"{scope}/largest_plus_one", "AddV2", [top, ir.const(f"{scope}/one", 1, index, dev)],
                   device=dev, attrs={"T": index}).name
    return ir.add(f"{scope}/at_least_none", "Maximum", [after, ir.const(f"{scope}/none", 0, index, dev)],
                  device=dev, attrs={"T": index}).name


def _constant(ir: IR, ref: str):
    """The value of ``ref`` when a ``Const`` produces it, else None."""
    return ir.const_value(node_of(ref)) if ref.partition(":")[2] in ("", "0") else None


def _needed(ir: IR, node: Node, axis: int, where: int) -> int:
    """How many examples a tower needs for ``node``'s constant position(s)."""
    if PICK_OPS[node.op][2] == "classes":
        return 1
    value = np.asarray(_constant(ir, node.inputs[where]))
    if node.op == "MirrorPad":      # REFLECT needs more rows than its padding, SYMMETRIC as many
        if value.ndim != 2 or axis >= len(value):
            return 1
        return max(1, int(value[axis].max()) + (node.attr("mode", "REFLECT") == "REFLECT"))
    if node.op == "StridedSlice":
        masks = [int(node.attr(k, 0)) for k in ("begin_mask", "ellipsis_mask", "new_axis_mask")]
        if masks[1] or masks[2] or value.ndim != 1 or axis >= len(value) or (masks[0] >> axis) & 1:
            return 1
        picks = value[axis:axis + 1]
    elif node.op == "Slice":
        size = ir.const_value(node_of(node.inputs[2]))
        if value.ndim != 1 or axis >= len(value) or size is None or np.ndim(size) != 1:
            return 1
        begin, count = int(value[axis]), int(np.asarray(size)[axis])
        return max(1, begin + count if count >= 0 else begin)
    elif node.op == "TopKV2":
        return max(1, int(value))
    elif node.op == "NthElement":           # the n-th smallest (0-based) needs n + 1
        return int(value) + 1
    elif node.op in ("ArgMax", "ArgMin"):   # the position of the batch's largest: one example
        return 1
    elif node.op == "GatherNd":
        picks = value.reshape(-1, value.shape[-1])[:, 0] if value.ndim and value.shape[-1] else value[:0]
    else:
        picks = value.reshape(-1)
    if not picks.size:
        return 1
    return max(1, max(int(k) + 1 if k >= 0 else -int(k) for k in picks))


def _assert(ir: IR, copy: Node, tower: int, axis: int, need: int | str, kind: str,
            towers: int, mixed: str | None = None) -> str:
    """The assertion before ``copy``: its tower holds at least ``need`` examples (a number, or
    a tensor of the tower computed at run time); ``mixed`` names the tensor it picks from when
    that already mixes the tower's examples."""
    scope = f"{copy.name}/{SCOPE}"
    i32, dev = dtypes.int32, copy.device

    def add(suffix, op, inputs, **attrs):
        return ir.add(f"{scope}/{suffix}", op, inputs, device=dev, attrs=attrs).name

    source = copy.inputs[PICK_OPS[copy.op][0]]
    if kind == "list":
        count = add("count", "TensorListLength", [source])
    elif kind == "array":
        count = add("count", "TensorArraySizeV3", [source, copy.inputs[2]])
    else:
        dtype = dtypes.as_dtype(ir.output_dtype(source))
        shape = add("shape", "Shape", [source], T=dtype, out_type=i32)
        zero = ir.const(f"{scope}/zero", 0, i32, dev)
        count = add("count", "GatherV2", [shape, ir.const(f"{scope}/axis", axis, i32, dev), zero],
                    Tparams=i32, Tindices=i32, Taxis=i32)
    what = (f"{MARKER}: '{copy.name.split('/', 1)[1]}' "
            + {"TopKV2": "takes the k largest of each tower's examples",
               "MirrorPad": "mirrors each tower's examples by reflection padding",
               "NthElement": "takes the n-th smallest of each tower's examples",
               "SparseSoftmaxCrossEntropyWithLogits": f"takes a softmax over '{mixed}', whose "
               "classes are each tower's examples",
               "SoftmaxCrossEntropyWithLogits": f"takes a softmax over '{mixed}', whose classes "
               "are each tower's examples"}.get(
                   copy.op, f"picks by position from '{mixed}', which mixes each tower's examples"
                   if mixed else "picks example(s) of each tower's batch by position")
            + f" (a reason the rewrite is inexact), so tower {tower} needs at least ")
    if isinstance(need, int):
        bound = ir.const(f"{scope}/need", need, i32, dev)
        message = (f"{what}{need} example(s) in every step; feed at least {need * towers} "
                   f"examples per step, or train on fewer towers. Examples in tower {tower}:")
    else:
        bound = need
        if ir.output_dtype(need) != i32.as_datatype_enum:
            bound = add("need", "Cast", [need], SrcT=dtypes.as_dtype(ir.output_dtype(need)), DstT=i32)
        positions = _INDICES | {"StridedSlice"}
        k = "n + 1" if copy.op == "NthElement" else "i + 1" if copy.op in positions else "k"
        shown = k if copy.op in positions else k[0]      # the bound printed after the message
        what = what.replace("by position", "by a position computed at run time (i, the largest)") \
            if copy.op in positions else what
        message = (f"{what}{k} examples in every step ({k[0]} as that tower computes it); feed "
                   f"more examples per step, or train on fewer towers. Examples in tower "
                   f"{tower}, {shown}:")
    # a run-time n-th element needs n + 1 examples
    above = "Greater" if copy.op == "NthElement" and not isinstance(need, int) else "GreaterEqual"
    enough = add("enough", above, [count, bound], T=i32)
    text = ir.const(f"{scope}/message", message, dtypes.string, dev)
    check = add("assert", "Assert", [enough, text, count, bound], T=[dtypes.string, i32, i32],
                summarize=3)
    ir.set_control(copy.name, copy.control + [check])
    return check
