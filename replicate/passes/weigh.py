"""Weigh each term of a loss by its own reduction inside the towers.

Requires: ``ir.facts["analysis"]`` with each scope's primary ``weights`` and ``corrections``
(terms of the loss weighted differently from the primary weights: a sum next to a mean, a
second loss in one ``tf.gradients`` call, a regularizer added to a sum), ``ir.facts["towers"]``
and the clone pass's copies.

Produces: in tower ``k``, the gradient entering each corrected term (the gradient its
reduction's gradient code reads, or the seed) is multiplied by ``w_k / p_k``, the term's
weight over the primary weight, so that after the aggregate pass weighs every gradient by
``p_k`` each term has been weighed by its own ``w_k``. A term with no gradient code (it does
not depend on a trained variable) needs nothing. ``DivNoNan`` keeps towers without examples
at zero.
"""

from __future__ import annotations

import logging

from tensorflow.python.framework import dtypes

from replicate.batchflow.facts import Reason
from replicate.batchflow.roles import FLOAT_TYPES
from replicate.graph import ops
from replicate.graph.ir import IR, node_of, parse_tensor, tensor_name
from replicate.passes._combine import weight
from replicate.passes.pipeline import PassResult

__all__ = ["Weigh", "entries"]

log = logging.getLogger(__name__)

SCOPE = "replicate/weigh"


def entries(ir: IR, prefix: str, root: str, depth: int = 0) -> list[tuple[str, list[str]]] | None:
    """(gradient tensor, nodes that read it) through which the gradient of ``root`` enters its
    gradient code in scope ``prefix``; [] when ``root`` gets no gradient; None when the entry
    cannot be told apart. An op whose gradient creates no ops (an identity, an ``AddN``, an
    ``Add`` of equal shapes) passes the question to its inputs."""
    name = node_of(root)
    inside = f"{prefix}/{name}_grad/"
    grad_nodes = [n for n in ir.nodes if n.startswith(inside)]
    if grad_nodes:
        found: dict[str, list[str]] = {}
        for g in grad_nodes:
            for ref in ir.nodes[g].inputs:
                producer = node_of(ref)
                if producer.startswith(inside) or not producer.startswith(prefix + "/"):
                    continue
                tensor = tensor_name(*parse_tensor(ref))
                if ir.output_dtype(tensor) in FLOAT_TYPES:
                    found.setdefault(tensor, []).append(g)
        return [(t, r) for t, r in found.items()] if len(found) == 1 else None
    if depth > 32 or name not in ir.nodes:
        return None
    out: list[tuple[str, list[str]]] = []
    for ref in ir.nodes[name].inputs:
        if ir.output_dtype(ref) not in FLOAT_TYPES:
            continue
        sub = entries(ir, prefix, ref, depth + 1)
        if sub is None:
            return None
        out.extend(sub)
    return out


class Weigh:
    """Per-term loss weights inside the towers (no options)."""

    name = "weigh"

    def __init__(self, controller: str):
        self.controller = controller

    def run(self, ir: IR) -> PassResult:
        analysis, towers, copies = ir.facts["analysis"], ir.facts["towers"], ir.facts["copies"]
        added = 0
        for scope in analysis.scopes:
            for root, spec in scope.corrections:
                points = entries(ir, scope.prefix, root)
                if points is None:
                    analysis.reasons.append(_unweighable(ir, root))
                    continue
                for tensor, readers in points:
                    added += self._scale(ir, towers, copies, tensor, readers, spec, scope.weights)
        log.info("weigh: %d per-tower term weights", added)
        return PassResult(ir, added > 0)

    def _scale(self, ir: IR, towers, copies, tensor: str, readers: list[str], spec: tuple,
               primary: tuple) -> int:
        name, idx = parse_tensor(tensor)
        dtype = ir.output_dtype(tensor)
        tf_dtype = dtypes.as_dtype(dtype)
        added = 0
        for k, copy in enumerate(copies):
            if name not in copy:
                continue
            mine = weight(ir, towers, k, dtype, self.controller, spec)
            if primary != ("ones",):
                base = weight(ir, towers, k, dtype, self.controller, primary)
                mine = ir.add(ir.unique_name(f"{SCOPE}/ratio_{k}"), "DivNoNan", [mine, base],
                              device=self.controller, attrs={"T": tf_dtype}).name
            source = f"{copy[name]}:{idx}"
            scaled = ir.add(ir.unique_name(f"{towers.prefixes[k]}/{SCOPE}/{name}_{idx}"), "Mul",
                            [_ref(source), mine], device=ir.nodes[copy[name]].device,
                            attrs={"T": tf_dtype}).name
            ir.replace_uses(source, scaled, only=[copy[r] for r in readers if r in copy])
            added += 1
        return added


def _ref(tensor: str) -> str:
    node, idx = parse_tensor(tensor)
    return node if idx == 0 else f"{node}:{idx}"


def _unweighable(ir: IR, root: str) -> Reason:
    """Why a loss term's gradient could not be weighed apart from the rest of the loss."""
    node = ir.nodes.get(node_of(root))
    if node is not None and node.op in ops.CALL_OPS:
        return Reason(node_of(root), f"this loss term is one of several results of the call "
                      f"'{node.name}' that are weighed differently (a mean and a sum); their "
                      "gradients enter the call's gradient function together and cannot be "
                      "weighed apart", "add the terms inside the function and return one loss, "
                      "or compute them outside it")
    return Reason(node_of(root), "the gradient entering this loss term cannot be found, so it "
                  "keeps the weights of the rest of the loss", "report this graph")
