"""Helpers of the analyze pass: batch inputs, variables, the global step, loss terms."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
from tensorflow.python.framework import dtypes

from replicate.batchflow.facts import ApplyOp, VarInfo
from replicate.errors import AnalysisError
from replicate.graph import ops
from replicate.graph.frames import opening
from replicate.graph.ir import IR, node_of, parse_tensor, tensor_name

__all__ = ["candidates", "seed_only", "sparse_triples", "forced", "variables", "global_step",
           "independent_terms", "set_aside", "one_per_column", "columns_advice"]

log = logging.getLogger(__name__)


def candidates(ir: IR, region: list[str], sources: set[str]) -> tuple[list[str], list[str], list[str]]:
    """The input tensors the region reads, split into possible batch inputs (placeholders,
    iterator and queue outputs of rank >= 1, in graph order) and shared ones (scalars, unknown
    rank), with warnings. The batch dataflow decides which candidates are batch inputs."""
    used: dict[str, None] = {}
    for name in region:
        for ref in ir.nodes[name].inputs:
            if node_of(ref) in sources:
                used.setdefault(tensor_name(*parse_tensor(ref)), None)
    warnings: list[str] = []
    shared: list[str] = []
    found: list[str] = []
    for ref in used:
        source = ir.nodes[node_of(ref)]
        if source.op not in ops.BATCH_SOURCE_OPS:
            continue
        shape = ir.static_shape(ref)
        if shape is None and _computed_rows(ir, source):
            raise AnalysisError(
                f"'{source.name}' is a placeholder_with_default without a shape whose default the "
                "model computes from the batch and its variables: its rows cannot be split without "
                "its rank, and every tower reading the whole batch's value would not run. Give it "
                f"its shape (placeholder_with_default(..., shape=[None, ...]))")
        if shape is None:
            warnings.append(f"input '{ref}' has unknown rank; it is shared, not split")
            shared.append(ref)
        elif not shape or seed_only(ir, ref):
            shared.append(ref)
        else:
            found.append(ref)
    return found, shared, warnings


def seed_only(ir: IR, ref: str) -> bool:
    """True when tensor ``ref`` is read only as the ``seed`` argument of ops (a stateless random
    op's seed, fed as a placeholder): a seed holds no examples (review 41: with the loss
    inexact anyway such an input was kept as a batch input, split, and the step failed with
    "seed must have shape [2]")."""
    readers = [(c, i) for c in ir.consumers(node_of(ref)) for i, r in enumerate(c.inputs)
               if tensor_name(*parse_tensor(r)) == ref]
    for consumer, position in readers:
        if consumer.op in ("Identity", "Cast"):
            if not seed_only(ir, f"{consumer.name}:0"):
                return False
        elif ir.arg_index(consumer, "seed") != position:
            return False
    return bool(readers)


def _computed_rows(ir: IR, source) -> bool:
    """A ``PlaceholderWithDefault`` whose default reads both the batch's inputs and the model's
    variables (an activation a driver may override). Shared whole for want of a rank, its
    default made every tower compute on the whole batch's rows beside its own, and the
    rewrite failed at step 1 ("Incompatible shapes: [7] vs. [2]")."""
    if source.op != "PlaceholderWithDefault" or not source.inputs:
        return False
    found = {ir.nodes[n].op for n in ir.ancestors([node_of(source.inputs[0])], control=False)}
    return bool(found & ops.VARIABLE_OPS) and bool(found & ops.BATCH_SOURCE_OPS)


def _source(ir: IR, ref: str) -> str:
    """The tensor ``ref`` reads through identities."""
    for _ in range(64):
        node = ir.nodes.get(node_of(ref))
        if node is None or node.op not in ("Identity", "Snapshot") or not node.inputs:
            break
        ref = node.inputs[0]
    return tensor_name(*parse_tensor(ref))


def _selected(ir: IR, indices: str, values: str) -> tuple[str, str]:
    """The indices and values that a row selection applied alike to both (``sparse_retain``,
    ``tf.sparse.retain``: the same ``Gather`` of both) was taken from, through entry-wise
    arithmetic on the values (a SparseTensor times a scalar)."""
    for _ in range(16):
        a, b = ir.nodes.get(node_of(indices)), ir.nodes.get(node_of(values))
        if b is not None and b.op in ("SparseDenseCwiseMul", "SparseDenseCwiseDiv", "SparseDenseCwiseAdd") \
                and _source(ir, b.inputs[0]) == indices:
            values = _source(ir, b.inputs[1])       # entry-wise values of the same entries
            continue
        if a is None or b is None or a.op not in ("GatherV2", "Gather") or b.op != a.op \
                or len(a.inputs) < 2 or a.inputs[1] != b.inputs[1] \
                or (a.op == "GatherV2" and not all(ir.const_value(node_of(n.inputs[2])) == 0
                                                   for n in (a, b))):
            break
        indices, values = _source(ir, a.inputs[0]), _source(ir, b.inputs[0])
    return indices, values


def sparse_triples(ir: IR, region: list[str], candidates: list[str]
                   ) -> list[tuple[str, str | None, str | None]]:
    """Inputs fed as a ``SparseTensor``: (indices, values, dense shape) whose indices are a
    candidate, found where a sparse op reads them together (``ops.SPARSE_OPERANDS``) or by the
    names ``tf.compat.v1.sparse_placeholder`` gives (``<name>/indices``, ``/values``, ``/shape``).
    Further fed values of the same entries follow the triple (the weights of
    ``tf.SparseTensor(ids.indices, weights, ids.dense_shape)``)."""
    found: dict[str, list[str | None]] = {}
    pool = set(candidates)
    unread: list[str] = []

    def note(indices: str, values: str | None, shape: str | None) -> None:
        shape_ = ir.static_shape(indices)
        if indices not in pool or ir.output_dtype(indices) != dtypes.int64 or (
                shape_ is not None and len(shape_) != 2):
            return
        entry = found.setdefault(indices, [None, None])
        for i, ref in enumerate((values, shape)):
            if ref is not None and node_of(ref) in ir.nodes \
                    and ir.nodes[node_of(ref)].op in ops.BATCH_SOURCE_OPS:
                if entry[i] is None:
                    entry[i] = ref
                elif i == 0 and ref not in entry[:1] + entry[2:]:
                    entry.append(ref)       # more values of the same entries (weights)

    for name in region:
        node = ir.nodes[name]
        where = ops.SPARSE_OPERANDS.get(node.op)
        if where is None:
            continue
        i, v, s = (None if p is None or p >= len(node.inputs) else _source(ir, node.inputs[p])
                   for p in where)
        for _ in range(8):
            if i is not None and v is not None:
                i, v = _selected(ir, i, v)
            reshape = ir.nodes.get(node_of(i)) if i is not None else None
            if reshape is None or reshape.op != "SparseReshape" or parse_tensor(i)[1] != 0:
                break
            # the same entries in the same order, under another dense shape
            i, s = _source(ir, reshape.inputs[0]), _source(ir, reshape.inputs[1])
        if i is not None:
            note(i, v, s)
    for ref in candidates:
        name = node_of(ref)
        if name.endswith("/values") and ref.endswith(":0") and f"{name[:-7]}/indices" in ir.nodes:
            indices = f"{name[:-7]}/indices:0"  # values read without their indices (the weights
            if indices not in pool and ir.nodes[node_of(indices)].op in ops.BATCH_SOURCE_OPS:
                pool.add(indices)               # of embedding_lookup_sparse): still fed whole
                unread.append(indices)
    for ref in list(candidates) + unread:
        name = node_of(ref)
        if ir.nodes[name].op == "DeserializeSparse" and ref.endswith(":0"):
            note(ref, f"{name}:1", f"{name}:2")     # an iterator's SparseTensor, decoded
        elif name.endswith("/indices") and ref.endswith(":0"):
            base = name[: -len("/indices")]
            values, shape = f"{base}/values", f"{base}/shape"
            note(ref, f"{values}:0" if values in ir.nodes else None,
                 f"{shape}:0" if shape in ir.nodes else None)
    return [(i, *entry) for i, entry in found.items()]


def forced(ir: IR, names: Mapping[str, int] | Sequence[str]) -> dict[str, int]:
    """The user's ``batch_inputs``: tensor names (``x:0``, or ``x:0@1`` for axis 1), checked."""
    items = names.items() if isinstance(names, Mapping) else [
        (n.rsplit("@", 1)[0], int(n.rsplit("@", 1)[1])) if "@" in n else (n, 0) for n in names]
    out: dict[str, int] = {}
    for name, axis in items:
        ref = tensor_name(*parse_tensor(name))
        node = ir.nodes.get(node_of(ref))
        if node is None:
            raise AnalysisError(f"batch input '{name}' is not a tensor of the graph")
        shape = ir.static_shape(ref)
        if shape is not None and not 0 <= axis < max(len(shape), 1):
            raise AnalysisError(f"batch input '{name}' has rank {len(shape)}; it has no axis {axis}")
        out[ref] = axis
    if not out:
        raise AnalysisError("batch_inputs is empty; name at least one input to split")
    return out


def interior(ir: IR, forced: Mapping[str, int]) -> set[str]:
    """Ops whose output the user names as a batch input though they compute it (cached
    features fed in place of the images): the towers start there, and read its slices; the op
    stays outside them, computed whole where it is not fed."""
    out = set()
    for ref in forced:
        node = ir.nodes[node_of(ref)]
        if node.op in ops.INPUT_SOURCE_OPS or node.op in ops.VARIABLE_OPS:
            continue
        if len(ir.output_types(node)) != 1:
            raise AnalysisError(f"batch input '{ref}' is one of several outputs of "
                                f"'{node.name}' ({node.op}); name a tensor of its own "
                                "(tf.identity of it) as the batch input")
        if opening(ir, node.name) is not None:
            raise AnalysisError(f"batch input '{ref}' is computed inside a TF1 while loop; name "
                                "a tensor outside the loop as the batch input")
        out.add(node.name)
    return out


def named_shared(ir: IR, names: Sequence[str], forced: Mapping[str, int] | None) -> list[str]:
    """The user's ``shared_inputs``: tensors every tower reads whole, checked."""
    out = []
    for name in names:
        ref = tensor_name(*parse_tensor(name))
        if ir.nodes.get(node_of(ref)) is None:
            raise AnalysisError(f"shared input '{name}' is not a tensor of the graph")
        if forced and ref in forced:
            raise AnalysisError(f"'{name}' is named both a batch input and a shared input")
        out.append(ref)
    return out


def variables(ir: IR, region: list[str], apply_ops: list[ApplyOp]) -> dict[str, VarInfo]:
    """Every variable of the graph, with its size and whether an optimizer updates it."""
    updated = {a.variable for a in apply_ops}
    out: dict[str, VarInfo] = {}
    for node in ir:
        if node.op not in ops.VARIABLE_OPS:
            continue
        kind = ("ref" if node.op in ops.REF_VARIABLE_OPS else
                "resource" if node.op in ops.RESOURCE_VARIABLE_OPS else "table")
        dtype_enum = node.attr("dtype")
        dtype = dtypes.as_dtype(dtype_enum).base_dtype if dtype_enum else None
        shape = node.attr("shape")
        size = int(np.prod([d for d in shape])) if shape and all(d is not None for d in shape) else (
            1 if shape == [] else 0)
        nbytes = size * (dtype.size if dtype is not None else 0)
        out[node.name] = VarInfo(node.name, node.op, kind, dtype.name if dtype else "?", shape,
                                 nbytes, node.name in updated)
    return out


def global_step(ir: IR, apply_ops: list[ApplyOp]) -> str | None:
    """The integer variable incremented next to the optimizer updates, if any.

    Removes its increment from ``apply_ops`` (it is not a gradient update).
    """
    for op in list(apply_ops):
        node = ir.nodes[op.variable]
        dtype = node.attr("dtype")
        if dtype is not None and dtypes.as_dtype(dtype).base_dtype.is_integer:
            apply_ops.remove(op)
            return op.variable
    return None


def independent_terms(ir: IR, loss: str, dependent: set[str], region: set[str]) -> list[str]:
    """Nodes added into the loss that depend on variables but not on the batch."""
    out, work, seen = [], [node_of(loss)], set()
    while work:
        name = work.pop()
        if name in seen:
            continue
        seen.add(name)
        node = ir.nodes[name]
        if node.op not in ("Add", "AddV2", "AddN", "Sub", "Identity"):
            continue
        for ref in node.inputs:
            producer = node_of(ref)
            if producer in dependent:
                work.append(producer)
            elif producer in region and ir.nodes[producer].op != "Const":
                out.append(producer)
    return out


def fed_in_a_call(ir: IR, region: list[str]) -> str | None:
    """A region call (a v2 ``If``, a defun) whose function reads data from an iterator or a
    placeholder inside its body: the batch then enters inside the call, unsplittable."""
    from replicate.batchflow.effects import called_functions

    for name in region:
        node = ir.nodes[name]
        if node.op not in ops.CALL_OPS:
            continue
        for fn in called_functions(node):
            fdef = ir.function(fn)
            if fdef is not None and any(n.op in ops.BATCH_SOURCE_OPS for n in fdef.node_def):
                return name
    return None


def set_aside(ir: IR, demoted: Mapping[str, str]) -> str:
    """The end of the "no batch input found" message: the candidates set aside and why, and
    when several of them are concatenated along their first axis (two batches fed apart and
    joined into one, review 21), how to name them: split each, every tower joins its slices."""
    if not demoted:
        return ""
    text = "; set aside: " + "; ".join(f"'{t}': {why}" for t, why in list(demoted.items())[:4])
    joins, joined = [], []
    for node in ir:
        if node.op != "ConcatV2" or len(node.inputs) < 3:
            continue
        axis = ir.const_value(node_of(node.inputs[-1]))
        parts = [tensor_name(*parse_tensor(r)) for r in node.inputs[:-1]]
        # each part fed, or computed from one input set aside (review 40: embeddings of two
        # batches of different sizes joined; the advice was missing)
        fed = [p if p in demoted else next(iter(_from_set_aside(ir, p, demoted)), None) for p in parts]
        fed = [p for p in dict.fromkeys(fed) if p is not None]
        if axis is not None and int(np.asarray(axis)) == 0 and len(fed) >= 2:
            joins.append((node.name, fed))
            joined += [p for p in fed if p not in joined]
    if not joins:
        return text
    where = ", ".join(f"'{name}' joins {' and '.join(repr(p) for p in fed)}" for name, fed in joins[:3])
    return (f"{text}; they are batches joined along their first axis ({where}): name each with "
            f"batch_inputs={sorted(joined)!r}, and each tower joins its slices of them")


def _from_set_aside(ir: IR, part: str, demoted: Mapping[str, str]) -> list[str]:
    """The one input set aside that tensor ``part`` is computed from, if only one."""
    above = ir.ancestors([node_of(part)])
    found = [t for t in demoted if node_of(t) in above]
    return found if len(found) == 1 else []


def one_per_column(shape) -> bool:
    """A fixed axis 0 and a dynamic axis 1: examples as columns (``[n_x, None]``, an edge list
    ``[2, None]``)."""
    return shape is not None and len(shape) >= 2 and shape[0] is not None and shape[1] is None


def columns_advice(tensors: Sequence[str]) -> str:
    """The end of a refusal naming ``batch_inputs=`` for inputs that may hold their examples
    along axis 1 (review 37: an edge list was told to give axis 0 a dynamic size)."""
    if not tensors:
        return ""
    return ("; if the examples are along axis 1 (one per column), say so: batch_inputs={"
            + ", ".join(f"'{t}': 1" for t in tensors) + "}")
