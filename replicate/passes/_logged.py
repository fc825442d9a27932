"""Helper of the guard pass: picks of examples that only logging reads run in a tower with
too few examples.

A tower's pick of its examples by position (``tf.argmax(losses)``, ``x[0]``,
``tf.math.top_k(losses, 3)``) that nothing trains on -- only a print (``tf.print``, the data
of the legacy ``tf.compat.v1.Print``), a summary or an assertion's message data reads it,
directly or through NaN checks and other stateless ops -- cannot change what a step trains.
Yet in a tower with fewer examples than it needs (the last, short batch of an epoch) its
kernel fails ("slice index 0 of dimension 0 out of bounds", "Reduction axis 0 is empty"), or
the guard pass's assertion stopped the step before it (review 45: a print of a NaN check's
output, ``tf.compat.v1.Print``, an ``Assert``'s data, a print in a ``tf.function`` or a
``tf.cond`` branch).

Such a pick reads its input padded with zeros up to the count it needs along the axis it
picks from: ``concat([x, zeros])`` with ``max(need - n, 0)`` zero rows. With enough examples
nothing is padded and the value is the same bits; a tower with too few logs a value of the
zeros, which the report says (each tower logs its own value anyway: one device logs the
batch's).

In the graph, the guard pass pads the tower copies it would otherwise assert on
(:mod:`replicate.passes._picks` asks :func:`logged_only`), and those with constant positions in
TF1 loops, where it cannot assert (the padding's constants wait for an op of the loop's frame). In function bodies, where every
tower calls the same function, :func:`pad_logged_body_picks` pads in place each pick with
constant positions whose value reaches neither the body's results nor a call; that changes
nothing for a call with enough examples (the one device's included).

Requires: the clone pass's tower copies. Produces: ``ir.facts["logged_picks"]`` (the ops
padded, for the report) and the padding ops under ``<op>/replicate/empty/pad_*`` (in the
graph) or ``<op>/replicate_empty/pad_*`` (in a body).
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
from tensorflow.python.framework import dtypes, tensor_util

from replicate.graph import ops as op_table
from replicate.graph.ir import IR, node_of
from replicate.passes._empty_kernels import BodyOps, GraphOps

__all__ = ["Bodies", "logged_only", "pad_logged", "pad_logged_body_picks", "warnings", "LOGGED_INPUTS"]

I32 = dtypes.int32

#: Ops that log what they read: op type -> the first input that is only logged (a
#: ``tf.compat.v1.Print`` passes input 0 on; an ``Assert`` stops on input 0, its condition).
LOGGED_INPUTS = {"PrintV2": 0, "Print": 1, "Assert": 1, "MergeSummary": 0,
                 **{kind: 0 for kind in op_table.SUMMARY_VALUE}}

#: Stateful ops that pass their input on unchanged (a NaN check; a Print's input 0).
_PASSED = op_table.NUMERIC_CHECK_OPS | {"Print"}

#: Calls whose bodies are followed: op type -> (the function attributes, the first input
#: that is an argument). ``tf.debugging.Assert`` of tensors is a cond whose branch asserts.
_FOLLOWED = {"If": (("then_branch", "else_branch"), 1), "StatelessIf": (("then_branch", "else_branch"), 1),
             "PartitionedCall": (("f",), 0), "StatefulPartitionedCall": (("f",), 0)}

#: Other calls: what their bodies do is not followed (a pick they read is not padded).
_CALLS = frozenset({"While", "StatelessWhile", "Case", "StatelessCase"}) | frozenset(_FOLLOWED)

#: Ops whose input 1 decides what runs: a TF1 cond's branches may be constants that wait for
#: the ``Switch`` by control edge only (review 46: ``cond(argmax(c) > 2, 1.0, 3.0)`` scaling the
#: loss was taken for logging).
_DECIDERS = frozenset({"Switch", "RefSwitch"})

#: Ops whose input vectors are never batch-sized: a pick of them (``tf.shape(x)[0]``) is not
#: of examples.
_SHAPES = frozenset({"Shape", "ShapeN", "Size", "Rank"})

#: The longest walk from a pick to its loggers (a longer one is taken to reach training).
_LIMIT = 400


def _only_logged(start: str, readers: Callable[[str], Iterable[tuple[str | None, int]]],
                 op_of: Callable[[str], str], stateless: Callable[[str], bool],
                 logs: Callable[[str, int], bool]) -> bool:
    """Whether every data path from node ``start`` ends at a logged input (or at nothing: a
    driver fetching such a node by name gets tower 0's value, as the report says), through
    stateless ops, NaN checks and calls whose bodies only log the argument
    (``logs(call, input position)``). ``readers(name)`` yields (reader, input position)
    pairs, a None reader for a result that leaves (a body's return)."""
    seen, work = {start}, [start]
    while work:
        for reader, position in readers(work.pop()):
            if reader is None:
                return False
            op = op_of(reader)
            if position >= LOGGED_INPUTS.get(op, 1 << 30):
                continue
            if op in _DECIDERS and position == 1:
                return False
            if op in _CALLS:
                if logs(reader, position):
                    continue
                return False
            if not (op in _PASSED or stateless(reader)):
                return False
            if reader not in seen:
                seen.add(reader)
                work.append(reader)
                if len(seen) > _LIMIT:
                    return False
    return True


def logged_only(ir: IR, name: str, training: tuple[str, ...], differentiated: set[str],
                bodies: "Bodies") -> bool:
    """Whether only logging reads graph node ``name``'s outputs: no op on the way is one the
    gradient differentiates (in ``differentiated``: it leads to the loss, even when no op reads
    the loss's value) or reads (its name starts with one of ``training``, the tower's gradient
    code). ``bodies`` walks the functions it calls."""
    if name in differentiated:
        return False

    def readers(node: str):
        for reader in ir.consumers(node):
            for position, ref in enumerate(reader.inputs):
                if node_of(ref) == node:
                    yield (None if reader.name.startswith(training) or reader.name in differentiated
                           else reader.name), position

    def stateless(node: str) -> bool:
        return _stateless(ir.op_def(ir.nodes[node].op))

    def logs(call: str, position: int) -> bool:
        node = ir.nodes[call]
        return bodies.log(node.op, [node.attr(k) for k in _FOLLOWED.get(node.op, ((), 0))[0]], position)

    return _only_logged(name, readers, lambda n: ir.nodes[n].op, stateless, logs)


class Bodies:
    """The library's functions, walked from an argument or a node (calls followed, to a
    depth of 8). Each body's nodes and readers are indexed once; :meth:`forget` drops a body's
    index after it changes."""

    def __init__(self, ir: IR) -> None:
        self.ir = ir
        self.functions = {f.signature.name: f for f in ir.library.function} if ir.library is not None else {}
        self.indexed: dict[str, tuple[dict, dict]] = {}

    def forget(self, fdef) -> None:
        self.indexed.pop(fdef.signature.name, None)

    def log(self, op: str, names: list, position: int, depth: int = 0) -> bool:
        """Whether the bodies ``names`` a call of ``op`` runs only log its input ``position``."""
        first = _FOLLOWED.get(op, ((), 0))[1]
        if op not in _FOLLOWED or position < first or depth >= 8 or not names:
            return False
        for name in names:
            fdef = self.functions.get(name)
            args = fdef.signature.input_arg if fdef is not None else ()
            if position - first >= len(args) or not self.only_logged(fdef, args[position - first].name, depth):
                return False
        return True

    def only_logged(self, fdef, start: str, depth: int = 0) -> bool:
        """Whether only logging reads body node (or argument) ``start`` of ``fdef``."""
        name = fdef.signature.name
        if name not in self.indexed:
            self.indexed[name] = ({n.name: n for n in fdef.node_def}, _readers(fdef))
        nodes, readers = self.indexed[name]

        def stateless(node: str) -> bool:
            return _stateless(self.ir.op_def(nodes[node].op))

        def logs(call: str, position: int) -> bool:
            node = nodes[call]
            return self.log(node.op, [node.attr[k].func.name for k in _FOLLOWED.get(node.op, ((), 0))[0]
                                      if k in node.attr], position, depth + 1)

        return _only_logged(start, lambda n: readers.get(n, ()), lambda n: nodes[n].op, stateless, logs)


def _stateless(op_def) -> bool:
    """Whether an op neither has state nor writes any (``Assign`` of a ref variable is not
    marked stateful: its ref input is the state, review 46)."""
    return op_def is not None and not op_def.is_stateful and not any(a.is_ref for a in op_def.input_arg)


def _readers(fdef) -> dict[str, list[tuple[str | None, int]]]:
    """Body node (or argument) -> its (reader, input position) pairs, None for a result."""
    readers: dict[str, list[tuple[str | None, int]]] = {}
    for node in fdef.node_def:
        for position, ref in enumerate(node.input):
            if not ref.startswith("^"):
                readers.setdefault(ref.split(":")[0], []).append((node.name, position))
    for ref in fdef.ret.values():
        readers.setdefault(ref.split(":")[0], []).append((None, 0))
    return readers


def warnings(logged: dict[str, str | None]) -> list[str]:
    """The report's words for the picks padded (``ir.facts["logged_picks"]``: op -> the
    function it is in, or None)."""
    out = []
    graph = sorted(op for op, fn in logged.items() if fn is None)
    if graph:
        out.append(", ".join(f"'{op}'" for op in graph) + f" {'pick' if len(graph) > 1 else 'picks'} "
                   "examples only logging reads (a print, summary or assertion message): each "
                   "tower logs its own examples' pick (one device logs the batch's), and a tower "
                   "with fewer examples than it picks logs zeros padded in instead of stopping "
                   "the step (fetched by name, it is tower 0's, zeros too where tower 0 is short)")
    bodies = sorted((op, fn) for op, fn in logged.items() if fn is not None)
    if bodies:
        out.append(", ".join(f"'{op}' (in '{fn}')" for op, fn in bodies) + " only logged inside "
                   "function bodies: where the tensor picked from is a tower's examples, each tower "
                   "logs its own, and where it holds fewer entries than picked, zeros padded in "
                   "instead of stopping the step")
    return out


def pad_logged(ir: IR, copy, axis: int, need: int | str, dtype, framed: bool = False) -> None:
    """Tower copy ``copy`` (a graph node) picks from its input 0 padded with zeros to ``need``
    (a number or an integer tensor) along ``axis``, and is listed in the facts. ``framed``:
    the copy runs in a TF1 loop's frame, where the padding's constants must run too (they
    wait for the input's op)."""
    ops = _FramedOps(ir, copy, node_of(copy.inputs[0])) if framed else GraphOps(ir, copy)
    if not isinstance(need, int) and ir.output_dtype(need) != I32.as_datatype_enum:
        need = ops.add("pad_need", "Cast", [need], SrcT=dtypes.as_dtype(ir.output_dtype(need)), DstT=I32)
    ops.set_input(0, _padded(ops, copy.inputs[0], axis, need, dtype))
    ir.facts.setdefault("logged_picks", {})[copy.name.split("/", 1)[1]] = None


class _FramedOps(GraphOps):
    """Ops beside a tower's op in a TF1 loop: constants wait for ``anchor`` (an op of the
    frame), which puts them in its frame."""

    def __init__(self, ir: IR, op, anchor: str) -> None:
        super().__init__(ir, op)
        self.anchor = anchor

    def const(self, name: str, value, kind=I32) -> str:
        made = super().const(name, value, kind)
        self.ir.set_control(made, [self.anchor])
        return made


def _padded(ops, ref: str, axis: int, need: int | str, dtype) -> str:
    """``ref`` with ``max(need - n, 0)`` zeros appended along ``axis`` (``n`` its length there;
    any rank, a negative axis from the end)."""
    add, const = ops.add, ops.const
    shape = add("pad_shape", "Shape", [ref], T=dtype, out_type=I32)
    rank = add("pad_rank", "Size", [shape], T=I32, out_type=I32)
    at = add("pad_axis", "FloorMod", [const("pad_axis_given", axis), rank], T=I32)
    have = add("pad_have", "GatherV2", [shape, at, const("pad_first", 0)], Tparams=I32, Tindices=I32, Taxis=I32)
    bound = const("pad_need", need) if isinstance(need, int) else need
    short = add("pad_short", "Maximum", [add("pad_missing", "Sub", [bound, have], T=I32),
                                         const("pad_none", 0)], T=I32)
    axes = add("pad_axes", "Range", [const("pad_from", 0), rank, const("pad_step", 1)], Tidx=I32)
    here = add("pad_here", "Equal", [axes, at], T=I32, incompatible_shape_error=True)
    dims = add("pad_dims", "SelectV2", [here, short, shape], T=I32)
    zero = const("pad_zero", np.zeros((), dtype.as_numpy_dtype), dtype)     # False for a bool
    zeros = add("pad_zeros", "Fill", [dims, zero], T=dtype, index_type=I32)
    return add("pad_padded", "ConcatV2", [ref, zeros, at], T=dtype, N=2, Tidx=I32)


def pad_logged_body_picks(ir: IR) -> int:
    """Pad every pick inside a library function that only logging reads (module docstring);
    returns how many."""
    done, bodies = 0, Bodies(ir)
    for fdef in list(ir.library.function) if ir.library is not None else ():
        nodes = {n.name: n for n in fdef.node_def}
        values = {n.name: tensor_util.MakeNdarray(n.attr["value"].tensor)
                  for n in fdef.node_def if n.op == "Const"}
        for node in list(fdef.node_def):
            needs = _body_needs(node, values)
            if not needs:
                continue
            kind = "Tparams" if node.op == "GatherV2" else "T"
            dtype = dtypes.as_dtype(node.attr[kind].type) if kind in node.attr else None
            source = nodes.get(node.input[0].split(":")[0]) if node.input else None
            if dtype is None or source is not None and source.op in _SHAPES or dtype in (dtypes.string, dtypes.resource, dtypes.variant) \
                    or not bodies.only_logged(fdef, node.name):
                continue
            ops = BodyOps(ir, fdef, node)
            ref = node.input[0]
            for k, (axis, need) in enumerate(needs):
                ops.scope = f"{node.name}/replicate_empty/{k}"
                ref = _padded(ops, ref, axis, need, dtype)
            ops.set_input(0, ref)
            bodies.forget(fdef)
            ir.facts.setdefault("logged_picks", {})[node.name] = fdef.signature.name
            done += 1
    return done


def _body_needs(node, values: dict) -> list[tuple[int, int]]:
    """(axis, examples needed) for each axis body node ``node`` picks from at constant
    positions, or [] (positions known only at run time, or not a pick)."""
    def const(position: int):
        if position >= len(node.input):
            return None
        return values.get(node.input[position].split(":")[0])

    if node.op in ("ArgMax", "ArgMin"):
        axis = const(1)
        return [(int(axis), 1)] if axis is not None and np.ndim(axis) == 0 else []
    if node.op == "TopKV2":
        k = const(1)
        return [(-1, int(k))] if k is not None and np.ndim(k) == 0 and int(k) > 0 else []
    if node.op == "GatherV2":
        indices, axis = const(1), const(2)
        if indices is None or axis is None or np.ndim(axis) or not np.size(indices) or \
                _int_attr(node, "batch_dims"):
            return []
        flat = np.asarray(indices).reshape(-1)
        return [(int(axis), max(1, int(flat.max()) + 1, -int(flat.min())))]
    if node.op == "StridedSlice":
        begin = const(1)
        masks = {k: _int_attr(node, k) for k in ("begin_mask", "ellipsis_mask", "new_axis_mask",
                                             "shrink_axis_mask")}
        if begin is None or np.ndim(begin) != 1 or masks["ellipsis_mask"] or masks["new_axis_mask"]:
            return []
        return [(i, int(b) + 1 if b >= 0 else -int(b)) for i, b in enumerate(begin)
                if (masks["shrink_axis_mask"] >> i) & 1 and not (masks["begin_mask"] >> i) & 1]
    return []


def _int_attr(node, key: str) -> int:
    """A body node's integer attribute (0 when absent; reading a missing key of the proto's
    map would add it)."""
    return node.attr[key].i if key in node.attr else 0
