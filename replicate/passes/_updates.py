"""Helpers of the analyze pass: the train op and the optimizer updates it runs.

An optimizer update is an op of ``ops.APPLY_OPS`` or ``ops.MUTATING_OPS`` whose value comes
from a gradient. The train op is the sink that runs them all (or the one the user names);
integer counters updated next to them are the global step.
"""

from __future__ import annotations

import networkx as nx

from replicate.batchflow.effects import describe, writes
from replicate.batchflow.facts import ApplyOp
from replicate.batchflow.roles import variable_of
from replicate.errors import AnalysisError
from replicate.graph import ops
from replicate.graph.ir import IR, node_of

__all__ = ["find_train_ops", "descendants"]


def _updates_in_bodies(ir: IR, below: set[str], in_grad: set[str]) -> str:
    """Why no update was found: none exists, or they are inside a function body the
    gradients flow into (a dynamic loss scale's ``apply_gradients`` under ``tf.cond``)."""
    inner = [e for name in ir.nodes if name in below and name not in in_grad
             for e in writes(ir, ir.nodes[name]) if e.inner]
    inner.sort(key=lambda e: e.op not in ops.APPLY_OPS)     # an optimizer kernel first
    if inner:
        return (f"the optimizer's updates are inside a function body ({describe(inner[0])}), "
                "where replicate cannot aggregate the gradients they read; build the graph "
                "with tf.compat.v1.disable_control_flow_v2() (a TF1 cond), or apply the "
                "gradients outside the cond")
    return "no optimizer update consumes a gradient"


def find_train_ops(ir: IR, graph: nx.DiGraph, in_grad: set[str], train_op: str | None
                   ) -> tuple[list[str], list[ApplyOp]]:
    """Every train op (a sink that runs optimizer updates fed by a gradient, and runs no fewer
    updates than another sink) and the updates they run. A GAN's ``d_optim`` and ``g_optim``
    are both train ops: all are replicated in one transform and each keeps its name. The one
    the user names (``train_op``), or else the one in the ``train_op`` collection, comes first.
    """
    below = descendants(graph, in_grad, list(ir.nodes))
    fed = _gradient_fed(ir, graph, in_grad)
    updates = [n for n in ir.nodes if n in below and n not in in_grad
               and (ir.nodes[n].op in ops.APPLY_OPS or ir.nodes[n].op in ops.MUTATING_OPS)]
    first: str | None = None
    if train_op is not None:
        first = node_of(train_op)
        if first not in ir.nodes:
            raise AnalysisError(f"train op '{train_op}' is not a node of the graph")
    reach: set[str] = set()
    for u in updates:
        if u not in reach:
            reach |= nx.descendants(graph, u) | {u}
    sinks = [n for n in ir.nodes if n in reach and graph.out_degree(n) == 0]
    if first is not None and not any(u in ir.ancestors([first], graph) for u in updates):
        # name what does (hand-written accumulation: the gradients enter through the
        # accumulating op, and the named op applies the sums; review 28)
        found = _widest(ir, graph, sinks, updates)[:3] if len(sinks) > 1 else sinks
        hint = (f"; {', '.join(repr(f) for f in found)} {'runs' if len(found) == 1 else 'run'} "
                "the updates from a gradient: name it with train_op=, or leave train_op unset "
                "to let replicate find every train op") if found else ""
        raise AnalysisError(f"train op '{first}' updates no variable from a gradient{hint}")
    if not sinks and first is None:
        raise AnalysisError("no train op found: " + _updates_in_bodies(ir, below, in_grad))
    sinks = _widest(ir, graph, sinks, updates) if len(sinks) > 1 else sinks
    if first is not None:
        covered = ir.ancestors([first], graph)
        sinks = [first] + [s for s in sinks if s != first
                           and not set(ir.ancestors([s], graph) & set(updates)) <= covered]
    else:
        collected = [s for s in _collection_names(ir, "train_op") if s in sinks]
        if collected:
            sinks = collected[:1] + [s for s in sinks if s != collected[0]]
    ancestors = ir.ancestors(sinks, graph)
    applies = _apply_ops(ir, [u for u in updates if u in ancestors], fed)
    if not any(ops.APPLY_OPS.get(ir.nodes[a.name].op) or a.op in ops.MUTATING_OPS for a in applies):
        raise AnalysisError(f"train op '{sinks[0]}' updates no variable from a gradient")
    return sinks, applies



def descendants(graph: nx.DiGraph, starts: set[str], region: list[str]) -> set[str]:
    inside = set(region)
    out: set[str] = set()
    work = [s for n in starts for s in graph.successors(n) if s in inside]
    while work:
        name = work.pop()
        if name in out:
            continue
        out.add(name)
        work.extend(s for s in graph.successors(name) if s in inside and s not in out)
    return out


def _gradient_fed(ir: IR, graph: nx.DiGraph, in_grad: set[str]) -> set[str]:
    """Nodes computed from a gradient: data descendants of the gradient code, and reads of a
    variable that wait (by control edge) for an update of that same variable from a gradient
    (TF1 Adam's sparse path reads its slots back after scattering into them)."""
    data_only = nx.DiGraph()
    data_only.add_nodes_from(graph)
    data_only.add_edges_from((node_of(r), n.name) for n in ir for r in n.inputs)
    fed = descendants(data_only, in_grad, list(ir.nodes)) | in_grad
    while True:
        extra = set()
        for name in fed:
            node = ir.nodes[name]
            if node.op not in ops.MUTATING_OPS or not node.inputs:
                continue
            target = variable_of(ir, node.inputs[0])
            for reader in ir.consumers(name):
                if reader.name not in fed and name in reader.control and reader.inputs \
                        and reader.op in ("ReadVariableOp", "Identity") \
                        and variable_of(ir, reader.inputs[0]) == target:
                    extra.add(reader.name)
        if not extra:
            return fed
        fed |= extra | descendants(data_only, extra, list(ir.nodes))


def _widest(ir: IR, graph: nx.DiGraph, sinks: list[str], updates: list[str]) -> list[str]:
    """Sinks whose set of ancestor updates no other sink strictly contains; reads dropped
    when an op that is not a read remains."""
    update_set = set(updates)
    covers = {s: frozenset(ir.ancestors([s], graph) & update_set) for s in sinks}
    out = [s for s in sinks if not any(covers[s] < covers[o] for o in sinks)]
    non_reads = [s for s in out if ir.nodes[s].op not in ("ReadVariableOp", "Identity")]
    return non_reads or out


def _apply_ops(ir: IR, names: list[str], fed: set[str]) -> list[ApplyOp]:
    """Updates among ``names`` whose value input is computed from a gradient (in ``fed``),
    plus integer counters (the global step), which the caller separates."""
    out = []
    for name in names:
        node = ir.nodes[name]
        spec = ops.APPLY_OPS.get(node.op)
        if spec is not None:
            var_arg, grad_arg, idx_arg, family = spec.var_arg, spec.grad_arg, spec.indices_arg, spec.optimizer
        else:
            var_arg, grad_arg, idx_arg = ops.MUTATING_OPS[node.op]
            family = _family(ir, name, names)
        vpos, gpos = ir.arg_index(node, var_arg), ir.arg_index(node, grad_arg)
        ipos = ir.arg_index(node, idx_arg) if idx_arg else None
        variable = variable_of(ir, node.inputs[vpos]) if vpos is not None else None
        if variable is None or gpos is None:
            continue
        counter = node.op in ("AssignAdd", "AssignAddVariableOp") and _is_integer(ir, variable)
        if node_of(node.inputs[gpos]) not in fed and not counter:
            continue
        out.append(ApplyOp(name, node.op, family, variable, node.inputs[gpos],
                           node.inputs[ipos] if ipos is not None else None))
    return out


def _family(ir: IR, name: str, names: list[str]) -> str:
    """Optimizer family of a plain variable update: that of an optimizer kernel in the same
    top-level name scope (TF1 Adam's sparse path scatters, then assigns), else the scope."""
    top = name.split("/")[0]
    for other in names:
        spec = ops.APPLY_OPS.get(ir.nodes[other].op)
        if spec is not None and other.split("/")[0] == top:
            return spec.optimizer
    return top


def _is_integer(ir: IR, variable: str) -> bool:
    from tensorflow.python.framework import dtypes

    dtype = ir.nodes[variable].attr("dtype")
    return dtype is not None and dtypes.as_dtype(dtype).base_dtype.is_integer


def _collection_names(ir: IR, key: str) -> list[str]:
    if ir.meta is None or key not in ir.meta.collection_def:
        return []
    return [node_of(v.decode() if isinstance(v, bytes) else v)
            for v in ir.meta.collection_def[key].node_list.value]


