"""Helper of the analyze pass: gradients the user replaced (``tf.custom_gradient``,
``gradient_override_map``).

A replaced gradient need not be linear in the gradient flowing into it (clipping is not), so
towers that differentiate their own share of the loss and are weighed afterwards do not
compute one device's gradient: each example's incoming gradient is ``1/n_k`` instead of
``1/B``. The towers weigh the loss instead, when that is proven to be enough:

- the op is *per-example*: its float inputs and outputs are per-example or shared values, and
  its gradient code reads and computes nothing reduced over the batch (``clip_by_value`` of
  the incoming gradient is per-example; ``clip_by_norm`` over the batch is not);
- every term of the scope's loss has a tower weight (a masked mean's count is synchronized,
  so a tower without masked-in examples divides by the batch's count, not by zero).

Then the scope's weights become ``ones`` and every term is a correction: the weigh pass
scales the gradient entering each term in tower ``k`` by that term's own weight, so the
gradient reaching each example equals one device's, and the aggregate pass sums. A custom
gradient on a shared path alone (a regularizer's) needs nothing: it sees the full upstream in
every tower, weighed by shares that sum to one. Beside a per-example one it forbids weighing
in the towers (it would see ``1/N`` of its upstream), so the per-example one is a reason then,
as is any other custom gradient on a batch-dependent path.
"""

from __future__ import annotations

from replicate.batchflow.facts import GradScope, Reason
from replicate.batchflow.lattice import PART, RED, SHARED, batch_size
from replicate.batchflow.roles import FLOAT_TYPES
from replicate.graph.ir import IR
from replicate.passes._weights import weigh_in_towers

__all__ = ["settle"]


def settle(ir: IR, flow, region: list[str], scopes: list[GradScope]) -> list[Reason]:
    """Switch the scopes whose custom gradients are per-example to weighing in the towers;
    reasons for the custom gradients that are not (at most four)."""
    custom = [n for n in region if ir.nodes[n].attr("_gradient_op_type")]
    if not custom:
        return []
    reasons: list[Reason] = []
    for scope in scopes:
        code = {n: _gradient_code(ir, scope.prefix, n) for n in custom}
        mine = [n for n in custom if code[n]]
        dependent = [n for n in mine if flow.dependent(n, len(ir.output_types(ir.nodes[n])))]
        if not dependent:
            continue
        bad = [n for n in dependent if not _per_example(ir, flow, n, code[n])]
        on_shared = [n for n in mine if n not in dependent]
        if not bad and not on_shared and scope.kind != "other" and weigh_in_towers(flow, scope):
            continue
        for name in (bad or dependent)[:4]:
            kind = ir.nodes[name].attr("_gradient_op_type")
            why = ("its gradient code reduces over the batch or reads a batch-reduced value "
                   "(the batch size included)"
                   if name in bad else "the loss's terms cannot all be weighed in the towers")
            reasons.append(Reason(name, f"its gradient is replaced by a custom one ('{kind}', from "
                                  "tf.custom_gradient or gradient_override_map), which each tower "
                                  f"applies to its own share of the loss, and {why}",
                                  "results match one device only if the custom gradient is "
                                  "linear in its incoming gradient; a per-example custom gradient "
                                  "(clip_by_value of the incoming gradient) is exact"))
    return reasons


def _gradient_code(ir: IR, prefix: str, name: str) -> list[str]:
    inside = f"{prefix}/{name}_grad/"
    return [n for n in ir.nodes if n.startswith(inside)]


def _per_example(ir: IR, flow, name: str, code: list[str]) -> bool:
    """The op and its gradient code (``code``) touch only per-example and shared values."""
    node = ir.nodes[name]
    tensors = [r for r in node.inputs if ir.output_dtype(r) in FLOAT_TYPES]
    tensors += [f"{name}:{i}" for i in range(len(ir.output_types(node)))]
    for g in code:
        gnode = ir.nodes[g]
        tensors += list(gnode.inputs)
        tensors += [f"{g}:{i}" for i in range(len(ir.output_types(gnode)))]
    for ref in tensors:
        fact = flow.fact(ref)
        if fact is None or fact.taint:
            return False
        if _size(fact) and ir.output_dtype(ref) in FLOAT_TYPES:
            return False        # the batch size as a value, ``-dy * 4.0 / n``, wherever it
                                # was cast (reviews 33, 34)
        if fact.kind not in (PART, SHARED) and not (fact.kind == RED and fact.merge == "size"):
            return False        # a shape of the tower's rows is fine; a value over them is not
    return True


def _size(fact) -> bool:
    """Whether ``fact`` is of a count of the tower's examples (``tf.shape(t)[0]``)."""
    return fact is not None and (fact.kind == RED and fact.merge == "size" or batch_size(fact))
