"""Reasons and refusals of the analyze pass: graphs the rewrite would get wrong or could not run.

Each function checks one condition on the analysed graph. A condition under which the towers
would train differently adds a :class:`~replicate.batchflow.facts.Reason` (the report is then
inexact and says why); one under which the rewrite could not run at all raises
:class:`~replicate.errors.AnalysisError` naming the op and what to do.
"""

from __future__ import annotations

import networkx as nx

from replicate.batchflow.facts import Reason
from replicate.batchflow.lattice import INSIDE
from replicate.batchflow.fixes import RAGGED_FIX, ragged
from replicate.errors import AnalysisError
from replicate.graph import ops
from replicate.graph.ir import IR, node_of, parse_tensor, tensor_name

__all__ = ["state_written_per_tower", "refuse_replicated", "unaggregated_updates", "minus_constant", "refuse_batch_arithmetic_ranges", "refuse_inconsistent_override"]


def state_written_per_tower(ir: IR, flow, region: list[str], evicted: set[str]) -> None:
    """A variable with one row per example that towers read by rows (a stateful RNN's state)
    must be written once, from merged rows: a write left in the towers (of gradient rows, of
    row numbers) would write one tower's rows over the whole variable. Such a graph cannot
    be split."""
    inside = set(region)
    for tensor, d in flow.plan.splits.items():
        read = ir.nodes[node_of(tensor)]
        if read.op != "ReadVariableOp":
            continue
        variable = node_of(read.inputs[0])
        writers = [c.name for c in ir.consumers(variable) if c.op in ops.MUTATING_OPS
                   and c.name in inside and c.name not in evicted]
        if writers:
            reason = Reason(writers[0], f"'{writers[0]}' writes variable '{variable}', which holds "
                            "one row per example, from values that are not the batch's rows in "
                            "order (gradient rows, row numbers, one tower's values)",
                            "store per-example state from forward values of the batch")
            flow.plan.unsplittable.append(reason)
            flow.plan.reasons.append(reason)


def refuse_replicated(ir: IR) -> None:
    """A graph replicate already rewrote cannot be rewritten again (its towers would nest)."""
    marks = [n for n in ir.nodes if n.startswith(("replicate/split/", "replicate/aggregate/"))]
    if marks:
        raise AnalysisError(f"the graph is already replicated ('{marks[0]}'); transform the "
                            "single-device graph instead")


def unaggregated_updates(ir: IR, apply_ops, inside: set[str], frontier, dependent: set[str]) -> list[Reason]:
    """An optimizer update must read an aggregated gradient: a tensor of the towers that it
    reads otherwise (through a TF1 cond's switch, which was taken for a forward value and
    merged by a mean: claimed exact, 1.2 off) is a reason, never silently merged."""
    grads = {f.tensor for f in frontier}
    out = []
    for a in apply_ops:
        ref = tensor_name(*parse_tensor(a.grad)) if a.grad else None
        if ref is not None and node_of(ref) in inside and ref not in grads and node_of(ref) not in dependent:
            # the same in every tower: a generator fed noise of a fed size (review 11 was told
            # to apply the gradients outside control flow, with no control flow in sight)
            out.append(Reason(a.name, f"the gradient '{ref}' that optimizer update '{a.name}' "
                              "reads does not depend on the batch (its variable is trained only "
                              "through values every tower computes whole, such as noise of a fed "
                              "size); replicate aggregates only gradients of the towers' examples",
                              "size what the variable computes by the batch (tf.shape(x)[0], not "
                              "a fed size), or train this graph on one device"))
        elif ref is not None and node_of(ref) in inside and ref not in grads:
            out.append(Reason(a.name, f"optimizer update '{a.name}' reads '{ref}', a value of the "
                              "towers that is not one of the gradients they aggregate",
                              "apply the gradients outside control flow, or train this graph on "
                              "one device"))
    return out


#: Advice that names sync mode, and what it becomes when sync mode is on already.
SYNC_ADVICE = (", or pass batch_norm='sync' if it is a batch statistic",
               " (batch_norm='sync' cannot combine this value across the towers)")


def advice_for(reasons: list[Reason], sync: bool) -> list[Reason]:
    """``reasons`` with their fixes phrased for the mode the transform ran in: with sync mode
    on, a fix must not advise it (review 30: it did, and the same reason came back)."""
    if not sync:
        return reasons
    out = []
    for r in reasons:
        fix = r.fix
        for old, new in (SYNC_ADVICE, _SYNC_UPDATE_ADVICE):
            fix = fix.replace(old, new)
        out.append(r if fix == r.fix else Reason(r.node, r.what, fix))
    return out


#: An update's advice to pass sync mode, and what it says when sync mode is on (review 43:
#: a moving average of a batch variance under sync was still told to pass it).
_SYNC_UPDATE_ADVICE = ("pass batch_norm='sync' if it averages a batch statistic (moving averages), or "
                       "compute it", "compute it")


def coupled_in_body(ir: IR, coupling: str) -> Reason:
    """The reason for a batch reduction inside a function body (``<caller>>inner``) that feeds
    per-example values: the sync pass cannot reach into the body. A cond's branches can be
    built as TF1 ops, which it can; a loop's cannot be helped that way (review 30: the advice
    was given for a ``tf.while_loop`` whose condition reads a batch max, and TF1 loops are
    no better)."""
    caller, inner = coupling.split(INSIDE)[0], coupling.split(INSIDE)[-1]
    node = ir.nodes.get(caller)
    if node is not None and node.op in ("While", "StatelessWhile"):
        fix = ("compute the batch statistic before the loop and pass it in (its bound, "
               "tf.reduce_max(lengths), outside the loop), or train this graph on one device")
    else:
        fix = ("build the model with tf.compat.v1.disable_control_flow_v2(), or without the cond "
               "around the batch statistics")
    return Reason(caller, f"a batch reduction inside a function body ('{inner}', called by "
                  f"'{caller}') feeds per-example values; each tower sees its own slice's value, "
                  "and it cannot be synchronized inside the body", fix)


def minus_constant(ir: IR, flow, ref: str) -> bool:
    """``ref`` is a batch-dependent integer minus a positive constant (``n - 1``), whatever
    the analysis made of ``n`` (a size, or a value mixed by an op upstream)."""
    node = ir.nodes.get(node_of(ref))
    if node is None or node.op not in ("Sub", "Add", "AddV2") or len(node.inputs) != 2:
        return False
    value = flow.ctx.const(node.inputs[1])
    first = flow.fact(node.inputs[0])
    if value is None or value.size != 1 or first is None or first.kind == "shared":
        return False
    c = float(value.reshape(-1)[0])
    if _length_at_least(ir, node.inputs[0], abs(c)):
        return False
    return c > 0 if node.op == "Sub" else c < 0


def _length_at_least(ir: IR, ref: str, c: float) -> bool:
    """``ref`` is the length of a vector concatenated from pieces, constant ones of ``c`` or
    more elements among them (a RaggedTensor's ``row_splits = concat([[0], cumsum(lengths)])``,
    whose rows number its length minus one: review 30, refused as a batch size minus one)."""
    for _ in range(6):
        node = ir.nodes.get(node_of(ref))
        if node is None or not node.inputs:
            return False
        if node.op in ("Shape", "Size"):
            joined = ir.nodes.get(node_of(node.inputs[0]))
            if joined is None or joined.op != "ConcatV2":
                return False
            pieces = [ir.const_value(node_of(p)) for p in joined.inputs[:-1]]
            return sum(p.shape[0] for p in pieces if p is not None and p.ndim == 1) >= c
        if node.op not in ("Identity", "Cast", "StridedSlice"):
            return False
        ref = node.inputs[0]
    return False


def _entries_of(ir: IR, flow, ref: str) -> str | None:
    """The batch input whose length, less a constant, ``ref`` is (``tf.shape(splits)[0] - 1``)."""
    for _ in range(6):
        node = ir.nodes.get(node_of(ref))
        if node is None or not node.inputs:
            return None
        if node.op in ("Shape", "Size"):
            fed = flow.ctx.fed(node.inputs[0])
            return fed if fed is not None and flow.ctx.inputs.get(fed, (None,))[0] == 0 else None
        if node.op not in ("Identity", "Cast", "StridedSlice", "Sub", "Add", "AddV2"):
            return None
        ref = node.inputs[0]
    return None


def refuse_batch_arithmetic_ranges(ir: IR, flow, region: list[str]) -> None:
    """``tf.range(tf.shape(x)[0] - 1)`` runs on one device with any batch, but a tower with no
    example computes ``Range(0, -1)`` and fails at run time: refused, since every rewrite must
    run (an uneven last batch smaller than the towers would stop training). An op the split
    cannot serve at all is the better reason, and is given instead (review 31: tokens fed flat
    with their lengths were told to slice a tensor inside RaggedTensor's code)."""
    if flow.plan.unsplittable:
        return
    for name in region:
        node = ir.nodes[name]
        if node.op != "Range" or len(node.inputs) < 2:
            continue
        limit = flow.fact(node.inputs[1])
        if limit is not None and limit.kind == "red" and limit.src is None and limit.merge == "other" \
                or minus_constant(ir, flow, node.inputs[1]):
            fed = _entries_of(ir, flow, node.inputs[1])
            if fed is not None:     # review 31: row splits fed beside the flat rows
                raise AnalysisError(
                    f"'{name}' counts up to the entries of '{fed}' minus a constant, and '{fed}' is "
                    "split as a batch input: it holds row boundaries (RaggedTensor.from_row_splits' "
                    "have one entry more than the batch has examples), which no tower's slice of "
                    "it keeps. Feed the rows padded per example ([batch, length] with the lengths "
                    "or a mask), or train this graph on one device")
            if ragged(name):    # a RaggedTensor's row count: the user wrote no range
                raise AnalysisError(f"'{name}' is RaggedTensor code that counts the rows of a "
                                    "ragged tensor built from the batch, and replicate does not "
                                    f"follow row splits across towers; {RAGGED_FIX}")
            if minus_constant(ir, flow, node.inputs[1]):
                raise AnalysisError(f"'{name}' counts up to the batch size minus a constant "
                                    f"('{node_of(node.inputs[1])}'): a tower with fewer examples than "
                                    "that constant (the last, uneven batch) cannot run it. Slice the "
                                    "tensor instead (x[:-1] runs on any tower), or train on one device")
            # review 43: min(B, 3), B // 2 were worded as B minus a constant
            raise AnalysisError(f"'{name}' counts up to a value computed from the batch size "
                                f"('{node_of(node.inputs[1])}'): each tower would count up to its "
                                "own, and a tower with few examples or none may not run it. Count "
                                "up to a number that does not depend on the batch size (a static "
                                "maximum length), or train on one device")


def refuse_inconsistent_override(ir: IR, graph: nx.DiGraph, flow, apply_ops, forced) -> None:
    """Named batch inputs that pair row by row with a value the model computes from its
    trained variables over the whole graph (a full-batch GCN's node outputs beside its
    labels): the towers would have to cut that value to their rows, and its gradient code
    expects every row, so the rewrite could not run. Refused, naming the value."""
    trained = {a.variable for a in apply_ops}
    for tensor in sorted(set(flow.plan.splits) | set(flow.plan.slices)):
        name = node_of(tensor)
        if trained & ir.ancestors([name], graph):
            named = ", ".join(sorted(forced))
            raise AnalysisError(
                f"batch_inputs ({named}): '{tensor}' has no batch axis (it is computed from the "
                "trained variables over the whole input, every row from every other) but is "
                "paired row by row with the named batch inputs, so each tower would need its "
                "rows of a value whose gradient needs all of them; there is no batch to split "
                "here: name inputs whose rows are examples (the features the rows are computed "
                "from), or train this graph on one device")
