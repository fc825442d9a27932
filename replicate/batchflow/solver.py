"""The fixpoint of the batch dataflow over the tower region.

Nodes are visited in topological order (control edges included, TF1 loop back edges from
``NextIteration`` left out). Without loops, TensorArrays or stacks one pass is exact; with
them, passes repeat until no fact changes, so the value carried around a loop and the
elements written into an array settle before anyone relies on them.
"""

from __future__ import annotations

import logging

import networkx as nx

from replicate.batchflow import rules
from replicate.batchflow.context import Context
from replicate.batchflow.lattice import SHARED, Classes, Fact, part
from replicate.errors import AnalysisError
from replicate.graph.ir import IR

__all__ = ["solve", "MAX_PASSES"]

log = logging.getLogger(__name__)

#: Passes over a region with loops before the analysis gives up (facts only grow, so a
#: region settles in a few passes; more means a rule is not monotone).
MAX_PASSES = 24

_LOOPY = frozenset({"NextIteration", "RefNextIteration", "TensorArrayV3", "StackV2", "Stack",
                    "TensorArrayGradV3"})


def order(ir: IR, region: list[str]) -> list[str]:
    """Region nodes in a topological order that follows graph order where it may: the region
    itself when graph order is already topological (as TensorFlow writes most graphs)."""
    rank = {name: i for i, name in enumerate(region)}
    edges = []
    for name in region:
        node = ir.nodes[name]
        for ref in node.inputs:
            producer = ref.split(":")[0] if not ref.startswith("^") else ref[1:]
            if producer in rank and ir.nodes[producer].op not in ("NextIteration", "RefNextIteration"):
                edges.append((producer, name))
        for ctl in node.control:
            if ctl in rank and ir.nodes[ctl].op not in ("NextIteration", "RefNextIteration"):
                edges.append((ctl, name))
    if all(rank[a] < rank[b] for a, b in edges):
        return list(region)     # what the lexicographic sort below returns for such an order
    graph = nx.DiGraph()
    graph.add_nodes_from(region)
    graph.add_edges_from(edges)
    try:
        return list(nx.lexicographical_topological_sort(graph, key=rank.__getitem__))
    except nx.NetworkXUnfeasible:
        raise AnalysisError("the region has a cycle that is not a TF1 while loop") from None


def solve(ir: IR, region: list[str], inputs: dict[str, tuple[int, int]], gradient: set[str],
          classes: Classes, resized: dict[str, tuple] | None = None,
          visit: list[str] | None = None, seeds: dict[str, Fact] | None = None,
          all_gradient: bool = False, functions: dict | None = None,
          sparse: dict[str, str] | None = None, fed: dict[str, str] | None = None) -> Context:
    """Compute the fact of every output of every region node.

    Args:
        ir: the graph with static shapes.
        region: the tower region, in graph order.
        inputs: batch inputs (tensor -> (axis, class)); every other input is shared.
        gradient: nodes of gradient scopes.
        classes: batch classes (the inputs' classes already created).
        resized: shared tensors made tower-sized by an earlier round (see :class:`Context`).
        visit: the topological order, when the caller computed it already.
        seeds: facts of tensors given from outside (a function body's arguments).
        all_gradient: every node is gradient code (the body of a gradient loop).
        functions: a cache of function bodies already analysed, shared with the caller.
        sparse: batch inputs fed as a SparseTensor: tensor -> its role (``indices``,
            ``values``, ``shape``); see :func:`replicate.batchflow.rules.sparse.source`.
        fed: a function body's arguments that carry a batch input as fed (``Context.fed``).
    """
    ctx = Context(ir, inputs, gradient, classes, resized, seeds, all_gradient, functions)
    ctx.sparse = sparse or {}
    ctx.fed_args = fed or {}
    ctx.solve, ctx.sparse_source = solve, rules.sparse.source
    ctx.body = rules.functional.body_of
    ctx.region_names = frozenset(region)
    sequence = visit if visit is not None else order(ir, region)
    loopy = any(ir.nodes[n].op in _LOOPY for n in sequence)
    for attempt in range(MAX_PASSES if loopy else 1):
        changed = False
        for found in (ctx.demands, ctx.positions, ctx.attr_positions, ctx.row_shapes, ctx.slice_pads, ctx.fed_rows,
                      ctx.refusals):
            found.clear()           # obligations of the settled pass only, not of partial facts
        ctx.notes.clear()
        for name in sequence:
            node = ir.nodes[name]
            outs = rules.apply(ctx, node, [ctx.fact(r) for r in node.inputs])
            for i, fact in enumerate(outs):
                key = f"{name}:{i}"
                fact = _resize(ctx, key, fact)
                if fact is not None and ctx.facts.get(key) != fact:
                    ctx.facts[key] = fact
                    changed = True
        changed = changed or ctx.changed
        ctx.changed = False
        if not changed and attempt:
            break
        if attempt == MAX_PASSES - 1 and loopy:
            raise AnalysisError("the batch analysis did not settle on a loop of the graph "
                                "(an internal error: please report it with the graph)")
    return ctx


def _resize(ctx: Context, key: str, fact: Fact | None) -> Fact | None:
    """A shared tensor that the rewrite makes tower-sized is partitioned from now on."""
    entry = ctx.resized.get(key)
    if entry is None or fact is None or fact.kind != SHARED:
        return fact
    dim, cls, block, outer, index = entry
    return part(dim, cls, block, outer=outer, taint=fact.taint,
                index=("rows", cls, block) if index else None)
