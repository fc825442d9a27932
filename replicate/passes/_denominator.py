"""Helper of the sync pass: a loss denominator that the gradient code reads as the batch's.

A masked mean ``sum(l * m) / sum(m)`` beside terms weighted otherwise cannot be weighed by
each tower's share of ``sum(m)``: a tower with examples but none masked in has a zero share
and divides by zero; nor can ``sum(l) / sum(m)``, whose numerator is not zero there. Its
towers divide by the batch's count instead, in the gradient code only: each tower's gradient
of the term is then its exact share of one device's, and a tower with a zero count adds zero
(the loss analysis turned the term into a plain sum, :func:`replicate.passes._weights.assign`).

Requires: the clone pass's tower copies (originals still present), ``ir.facts["analysis"]``
with the denominator (tensor -> the batch reductions it is computed from) and its facts, and
``ir.facts["towers"]``.

Produces: ``replicate/sync/denominator/...``: the denominator computed once on the controller
from the towers' reductions combined (sums added, means weighted by example counts) and the
shared values it reads (tower 0's copies, or nodes outside the towers); every reader of a
tower's copy of the denominator inside that tower's gradient code reads it instead. The
forward pass keeps each tower's own value, so values fetched by name merge as before. A
reduction of the batch inputs alone (a fed mask's sum, ``sequence_mask`` of fed lengths) is
computed from the whole fed batch instead, under ``replicate/sync/denominator/whole/``: it
waits for no tower, so gradient accumulation keeps its micro-batches chained.
"""

from __future__ import annotations

import networkx as nx

from replicate.batchflow.lattice import SHARED
from replicate.graph import ops
from replicate.graph.ir import IR, Node, parse_tensor, tensor_name
from replicate.passes._combine import combine

__all__ = ["GlobalDenominator"]

SCOPE = "replicate/sync/denominator"


class GlobalDenominator:
    """One denominator made global for the gradient code (see the module docstring)."""

    def __init__(self, ir: IR, controller: str, den: str, sources: tuple, in_grad: set[str]):
        self.ir, self.controller, self.den = ir, controller, den
        self.sources, self.in_grad = set(sources), in_grad
        self.memo: dict[str, str] = {}
        #: The batch reductions built, each ``(tensor, merge)``: between-graph training
        #: combines them over the workers (:mod:`replicate.passes.between`).
        self.built: list[tuple[str, str]] = []

    def run(self) -> int:
        ir = self.ir
        towers, copies = ir.facts["towers"], ir.facts["copies"]
        total = self._global(self.den)
        name, idx = parse_tensor(self.den)
        changed = 0
        for k in range(len(towers.devices)):
            if name not in copies[k]:
                continue
            tower_den = _ref(copies[k][name], idx)
            gradient = {copies[k][g] for g in self.in_grad if g in copies[k]}
            readers = [c.name for c, _ in ir.data_consumers(tower_den) if c.name in gradient]
            changed += ir.replace_uses(tower_den, total, only=readers)
        return changed

    def _global(self, ref: str) -> str:
        """The batch's value of forward tensor ``ref``, built on the controller."""
        ir = self.ir
        name, idx = parse_tensor(ref)
        key = tensor_name(name, idx)
        if key in self.memo:
            return self.memo[key]
        analysis, towers, copies = ir.facts["analysis"], ir.facts["towers"], ir.facts["copies"]
        fact = analysis.flow.fact(key)
        whole = self._from_inputs(name, idx) if name in self.sources else None
        if whole is not None:
            out = whole
            self.built.append((out, fact.merge if fact is not None else "sum"))
        elif name in self.sources:
            merge = fact.merge if fact is not None else "sum"
            spec = fact.spec if merge == "mean" and fact.spec else ("ones",)
            if spec and spec[0] == "count":
                spec = ("count", analysis.flow.classes.find(spec[1]))
            parts = [_ref(copies[k][name], idx) for k in range(len(towers.devices))]
            out = combine(ir, towers, f"{SCOPE}/{name}", parts, merge, ir.output_dtype(key),
                          self.controller, self.controller, spec)
            self.built.append((out, merge))
        elif fact is None or (fact.kind == SHARED and not fact.taint):
            out = _ref(copies[0][name], idx) if name in copies[0] else _ref(name, idx)
        else:
            node = ir.nodes[name]
            new = f"{SCOPE}/{name}"
            if new not in ir.nodes:
                attrs = {k: v for k, v in node.attrs.items() if k != "_class"}
                ir.add_node(Node(new, node.op, [self._global(r) for r in node.inputs], [],
                                 self.controller, attrs))
            out = _ref(new, idx)
        self.memo[key] = out
        return out

    def _from_inputs(self, name: str, idx: int) -> str | None:
        """Reduction ``name`` computed once from the whole fed batch, when it reads the dense
        batch inputs through a few stateless ops alone (a mask's sum, ``sequence_mask`` of
        fed lengths): it then waits for no tower, so micro-batches stay chained."""
        ir = self.ir
        analysis = ir.facts["analysis"]
        inputs = {b.tensor for b in analysis.batch_inputs if b.sparse is None and b.axis == 0}
        flow, copies = analysis.flow, ir.facts["copies"]
        cone, work = [], [name]
        while work:
            cur = work.pop()
            if cur in cone:
                continue
            node = ir.nodes[cur]
            op_def = ir.op_def(node.op)
            if op_def is None or op_def.is_stateful or node.op in ops.CONTROL_FLOW_OPS \
                    or cur in self.in_grad or len(cone) >= MAX_CONE:
                return None
            cone.append(cur)
            for ref in node.inputs:
                tensor = tensor_name(*parse_tensor(ref))
                fact = flow.fact(tensor)
                if tensor in inputs or (fact is not None and fact.kind == SHARED and not fact.taint):
                    continue
                if fact is None:
                    return None
                work.append(parse_tensor(ref)[0])
        mapped: dict[str, str] = {}

        def source(ref: str) -> str:
            tensor = tensor_name(*parse_tensor(ref))
            node, i = parse_tensor(ref)
            if node in mapped:
                return _ref(mapped[node], i)
            if tensor in inputs or node not in copies[0]:
                return ref
            return _ref(copies[0][node], i)          # a shared value: tower 0's copy

        inside = nx.DiGraph()
        inside.add_nodes_from(cone)
        inside.add_edges_from((parse_tensor(r)[0], cur) for cur in cone for r in ir.nodes[cur].inputs
                              if parse_tensor(r)[0] in inside)
        for cur in nx.topological_sort(inside):
            node = ir.nodes[cur]
            new = f"{SCOPE}/whole/{cur}"
            if new not in ir.nodes:
                attrs = {k: v for k, v in node.attrs.items() if k != "_class"}
                ir.add_node(Node(new, node.op, [source(r) for r in node.inputs], [],
                                 self.controller, attrs))
            mapped[cur] = new
        return _ref(mapped[name], idx)


#: The most ops a reduction computed from the whole batch may take.
MAX_CONE = 32


def _ref(node: str, idx: int) -> str:
    return node if idx == 0 else f"{node}:{idx}"
