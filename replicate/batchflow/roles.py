"""Recognizers used by the analyze pass: gradient scopes, losses, reductions, sparse roles.

Each function reads the IR and answers one question about a node or tensor; none
changes the graph. They rely on TensorFlow's naming of gradient code
(``<scope>/<op>_grad/...`` under a ``gradients`` name scope) and on the op tables.
"""

from __future__ import annotations

import logging
import re

from tensorflow.core.framework import types_pb2

from replicate.graph import ops
from replicate.graph.ir import IR, node_of, parse_tensor, tensor_name

__all__ = ["seed_sources", "gradient_scopes", "scope_loss", "scope_seeds", "forward_op_of", "sparse_roles",
           "FLOAT_TYPES", "variable_of"]

log = logging.getLogger(__name__)

_SCOPE = re.compile(r"^((?:.*?/)?gradients(?:_\d+)?)/")
_SEED = re.compile(r"^(?:grad_ys_\d+|Fill|ones|grad_ys)$")

FLOAT_TYPES = frozenset({types_pb2.DT_HALF, types_pb2.DT_BFLOAT16, types_pb2.DT_FLOAT,
                         types_pb2.DT_DOUBLE, types_pb2.DT_COMPLEX64, types_pb2.DT_COMPLEX128})


def gradient_scopes(ir: IR) -> list[str]:
    """Name scopes made by ``tf.gradients`` (e.g. ``gradients``, ``gradients_1``), in graph order.

    A scope counts when some node below it lives in an ``<op>_grad`` sub-scope.
    """
    found: dict[str, None] = {}
    seeded = {name.rsplit("/", 1)[0] for name in ir.nodes if _SEED_NAME.match(name)}
    for name in ir.nodes:
        match = _SCOPE.match(name)
        if match and "_grad/" in name[len(match.group(1)):]:
            found.setdefault(match.group(1), None)
            continue
        # tf.gradients(..., name="grads_custom"): a scope of any name holding the seed
        # (grad_ys_<i>) and <op>_grad code
        head, sep, rest = name.partition("_grad/")
        if sep and "/" in head:
            for prefix in _prefixes(head):
                if prefix in seeded:
                    found.setdefault(prefix, None)
                    break
    # Gradient code of control flow nests scopes (gradients/while_grad/gradients): keep outer ones.
    return [p for p in found if not any(p.startswith(q + "/") for q in found if q != p)]


_SEED_NAME = re.compile(r"^.+/grad_ys_\d+$")


def _prefixes(path: str) -> list[str]:
    """``a/b/c`` -> ``a/b``, ``a`` (the name scopes enclosing ``path``), innermost first."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def forward_op_of(ir: IR, prefix: str, name: str) -> str | None:
    """The forward op whose gradient code contains node ``name`` (``prefix/<op>_grad/...``)."""
    rest = name[len(prefix) + 1:]
    parts = rest.split("/")
    for i, part in enumerate(parts[:-1]):
        if part.endswith("_grad"):
            candidate = "/".join(parts[:i] + [part[: -len("_grad")]])
            if candidate in ir.nodes:
                return candidate
    return None


def scope_loss(ir: IR, prefix: str) -> str | None:
    """The loss tensor a gradient scope differentiates, recovered from the seed.

    ``tf.gradients`` seeds with ``Fill(Shape(loss), 1)``: with a dynamic loss shape the
    Shape op reads the loss; otherwise the seed's consumers live in ``<loss op>_grad``.
    """
    shape = ir.nodes.get(f"{prefix}/Shape")
    if shape is not None and shape.op == "Shape" and shape.inputs:
        return tensor_name(*parse_tensor(shape.inputs[0]))
    seeds = [n for n in ir.nodes.values()
             if n.name.startswith(prefix + "/") and "/" not in n.name[len(prefix) + 1:]
             and _SEED.match(n.name[len(prefix) + 1:])]
    for seed in seeds:
        for consumer in ir.consumers(seed.name):
            op = forward_op_of(ir, prefix, consumer.name)
            if op is not None:
                return _loss_output(ir, op, prefix)
    candidates: dict[str, None] = {}
    for name in ir.nodes:
        if name.startswith(prefix + "/"):
            op = forward_op_of(ir, prefix, name)
            if op is not None:
                candidates.setdefault(op, None)
    # The loss is the candidate no other candidate's forward op reads.
    consumed = {node_of(r) for c in candidates for r in ir.nodes[c].inputs}
    downstream = [c for c in candidates if c not in consumed]
    return _loss_output(ir, downstream[-1], prefix) if downstream else None


def _loss_output(ir: IR, op: str, prefix: str) -> str:
    """The output of forward op ``op`` a loss is: its only one, or the only float output that
    forward code reads (review 44: the loss ``a`` of ``_, a = tf.while_loop(...)`` was taken
    for the loop's counter, output 0, whose fact is shared: each tower's gradient weighed
    alike, 0.09-0.25 off)."""
    n = len(ir.output_types(ir.nodes[op]))
    if n <= 1:
        return tensor_name(op, 0)
    read = {parse_tensor(r)[1] for c in ir.consumers(op) if not c.name.startswith(prefix + "/")
            for r in c.inputs if node_of(r) == op}
    floats = [i for i in sorted(read) if ir.output_dtype(tensor_name(op, i)) in FLOAT_TYPES]
    if len(floats) > 1:     # a v2 loop's outputs each get an Identity of its own: the loss's leaves it
        floats = [i for i in floats if _leaves(ir, tensor_name(op, i), op + "/", prefix + "/")] or floats
    return tensor_name(op, floats[0] if len(floats) == 1 else 0)


def _leaves(ir: IR, ref: str, scope: str, gradient: str, depth: int = 4) -> bool:
    """A forward reader of ``ref``, through ``Identity`` ops inside ``scope``, is outside it
    (gradient code, under ``gradient``, does not count)."""
    for reader in ir.consumers(node_of(ref)):
        if reader.name.startswith(gradient) or not any(parse_tensor(r) == parse_tensor(ref)
                                                        for r in reader.inputs):
            continue
        if not reader.name.startswith(scope):
            return True
        if reader.op == "Identity" and depth and \
                _leaves(ir, tensor_name(reader.name, 0), scope, gradient, depth - 1):
            return True
    return False


_SEED_INDEX = re.compile(r"^grad_ys_(\d+)$")


def scope_seeds(ir: IR, prefix: str) -> list[tuple[str, str | None]]:
    """(seed tensor, loss tensor) for every output ``tf.gradients`` differentiated in scope
    ``prefix``: the seed is the ``grad_ys_<i>`` tensor of ones shaped like the loss; the loss is
    the tensor that ``Shape`` reads, or else the output of the forward op whose gradient code
    first consumes the seed (a loss behind an ``Identity`` is found as the identity's input).
    The loss is None when it cannot be recovered."""
    seeds = []
    for name, node in ir.nodes.items():
        if not name.startswith(prefix + "/"):
            continue
        match = _SEED_INDEX.match(name[len(prefix) + 1:])
        if match:
            seeds.append((int(match.group(1)), name))
    out: list[tuple[str, str | None]] = []
    for _, name in sorted(seeds):
        node = ir.nodes[name]
        loss = None
        shape = ir.nodes.get(node_of(node.inputs[0])) if node.inputs else None
        if shape is not None and shape.op == "Shape" and shape.inputs:
            loss = tensor_name(*parse_tensor(shape.inputs[0]))
        else:
            found = seed_sources(ir, prefix, name)
            if len(found) == 1:
                loss = _loss_output(ir, found[0], prefix)
            elif found:
                # the seed passed through ops whose gradient makes no op (``mean + 0.01 *
                # sum(x ** 2)`` of scalars): the loss joins them. Taking the first was a loss
                # with terms missing (a false exact)
                joined = _joined(ir, found, prefix)
                loss = tensor_name(joined, 0) if joined is not None else None
        out.append((tensor_name(name, 0), loss))
    return out


def seed_sources(ir: IR, prefix: str, seed: str) -> list[str]:
    """The forward ops whose gradient code reads the seed ``seed`` of scope ``prefix``."""
    return list(dict.fromkeys(op for c in ir.consumers(seed)
                              if (op := forward_op_of(ir, prefix, c.name)) is not None))


#: Ops whose gradient passes the incoming gradient on unchanged, creating no op when the
#: shapes agree (so a seed can reach several forward ops' gradient code directly).
_PASS_THROUGH = frozenset({"Identity", "Snapshot", "Add", "AddV2", "AddN"})


def _joined(ir: IR, ops_: list[str], prefix: str) -> str | None:
    """The nearest forward node that every op of ``ops_`` reaches through pass-through ops
    only (the differentiated loss), or None."""
    reach: list[dict[str, int]] = []
    for start in ops_:
        dist, work = {start: 0}, [start]
        while work:
            cur = work.pop(0)
            for c in ir.consumers(cur):
                # ``a - b`` passes the gradient to ``a`` unchanged (``b`` gets a Neg, an op)
                through = c.op in _PASS_THROUGH or (c.op == "Sub" and node_of(c.inputs[0]) == cur)
                if c.name not in dist and through and not c.name.startswith(prefix + "/"):
                    dist[c.name] = dist[cur] + 1
                    work.append(c.name)
        reach.append(dist)
    common = set(reach[0]).intersection(*reach[1:])
    if not common:
        return None
    return min(common, key=lambda n: (max(d[n] for d in reach), n))


def variable_of(ir: IR, ref: str) -> str | None:
    """The variable node behind a ref/resource input, looking through identities."""
    for _ in range(32):
        name = node_of(ref)
        node = ir.nodes.get(name)
        if node is None:
            return None
        if node.op in ops.VARIABLE_OPS:
            return name
        if node.op not in ("Identity", "RefIdentity", "Enter", "RefEnter", "Switch", "RefSwitch") \
                or not node.inputs:
            return None
        ref = node.inputs[0]
    return None


#: Ops a sparse gradient's values pass through on their way to a sparse update, with the
#: name of the argument holding the values.
_SPARSE_VALUE_ARGS = {"UnsortedSegmentSum": "data", "UnsortedSegmentMean": "data",
                      "SparseSegmentSum": "data", "ScatterNd": "updates"}
_VALUE_PASSTHROUGH = frozenset({"Identity", "Mul", "RealDiv", "Neg", "Cast", "Reshape",
                                "Snapshot", "GatherV2", "Gather", "Square", "Sub", "AddV2",
                                "Add", "Maximum", "Minimum", "ClipByValue", "Sqrt", "Rsqrt"})
_INDEX_PASSTHROUGH = frozenset({"Identity", "Unique", "Reshape", "Cast", "Snapshot"})


def sparse_roles(ir: IR, frontier: set[str], meets: list | None = None) -> dict[str, str]:
    """Tensors of ``frontier`` that are values or indices of a sparse (IndexedSlices) gradient.

    Walks back from the values and indices inputs of sparse updates (``SparseApply*``,
    ``Scatter*``, ``UnsortedSegmentSum`` of a deduplication) to the frontier. ``meets``, if
    given, receives (values, indices) frontier tensors that meet at one update (indices None
    when the update's indices are outside the frontier: shared ids every tower reads).
    """
    roles: dict[str, str] = {}

    def walk(ref: str, role: str, passthrough: frozenset[str]) -> set[str]:
        stack, seen, reached = [ref], set(), set()
        while stack:
            cur = stack.pop()
            key = tensor_name(*parse_tensor(cur))
            if key in seen:
                continue
            seen.add(key)
            if key in frontier:
                roles.setdefault(key, role)
                reached.add(key)
                continue
            node = ir.nodes.get(node_of(cur))
            if node is None or node.op not in passthrough:
                continue
            stack.extend(node.inputs[:1] if node.op in ("Unique", "GatherV2", "Gather") else node.inputs)
        return reached

    for node in ir.nodes.values():
        spec = ops.APPLY_OPS.get(node.op)
        pairs: list[tuple[str, str]] = []
        if spec is not None and spec.indices_arg:
            pairs.append((spec.grad_arg, spec.indices_arg))
        elif node.op in ops.MUTATING_OPS and ops.MUTATING_OPS[node.op][2]:
            _, value_arg, index_arg = ops.MUTATING_OPS[node.op]
            pairs.append((value_arg, index_arg))
        elif node.op in _SPARSE_VALUE_ARGS:
            pairs.append((_SPARSE_VALUE_ARGS[node.op],
                          "segment_ids" if node.op != "ScatterNd" else "indices"))
        for value_arg, index_arg in pairs:
            vpos, ipos = ir.arg_index(node, value_arg), ir.arg_index(node, index_arg)
            values = indices = set()
            if vpos is not None and vpos < len(node.inputs):
                values = walk(node.inputs[vpos], "sparse_values", _VALUE_PASSTHROUGH)
            if ipos is not None and ipos < len(node.inputs):
                indices = walk(node.inputs[ipos], "sparse_indices", _INDEX_PASSTHROUGH)
            if meets is not None:
                meets.extend((v, i) for v in values for i in (indices or [None]))
    return roles
