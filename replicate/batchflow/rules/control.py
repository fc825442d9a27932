"""Rules for TF1 control flow, TensorArrays and stacks.

A loop's ``Merge`` joins the value entering the loop with the value of the previous
iteration, so the solver runs loops to a fixpoint. A shared value entering a loop that
carries per-example values (a zero state) must be tower-sized: a demand. A branch or loop
condition computed from a batch reduction (the longest sequence of the batch) couples every
value the branch or loop produces. TensorArrays and stacks remember the fact of what was
written into them, keyed by the op that created them; their gradients get their own keys.
"""

from __future__ import annotations

from replicate.batchflow.context import Context
from replicate.batchflow.lattice import MIXED, PART, SHARED, Fact, join, mixed, shared
from replicate.batchflow.rules.common import condition, taint_of
from replicate.graph.frames import cond_predicate
from replicate.graph.ir import Node, node_of

__all__ = ["merge", "switch", "array_new", "array_write", "array_read", "array_gather",
           "array_concat", "array_scatter", "array_split", "array_grad", "array_size",
           "stack_new", "stack_push", "stack_pop"]


def merge(ctx: Context, node: Node, ins: list[Fact | None]) -> list[Fact | None]:
    out = join(ins, ctx.classes)
    decided = _decided(ctx, node, out)
    if decided is not None and decided.kind == MIXED:
        return [decided, shared()]
    out = decided or out
    if out is not None and out.kind == PART:
        for ref, f in zip(node.inputs, ins):
            if f is not None and f.kind == SHARED:
                ctx.demand(ref, out.axis, out, node)
    return [out, shared()]


def _decided(ctx: Context, node: Node, out: Fact | None) -> Fact | None:
    """What a TF1 cond's ``Merge`` gives when its predicate is decided per example or per
    tower (``tf.argmax(losses) > 2``), or None. Its branches' values that pass through the
    cond's ``Switch`` carry that already; values made in a branch (constants, waiting for the
    branch's pivot by control edge only) do not, yet which one the ``Merge`` gives is the
    predicate's choice (review 46: ``mean * cond(argmax(c) > 2, 1.0, 3.0)`` claimed exact)."""
    if out is None or out.kind == MIXED or _looping(ctx, node):
        return None         # a loop's Merge: its condition decides through its Switch
    if node.name not in ctx.cond_predicates:
        ctx.cond_predicates[node.name] = _predicates(ctx, node)
    predicates = ctx.cond_predicates[node.name]
    if predicates is None:
        return mixed(node.name, "a value a TF1 cond chooses whose condition replicate did not "
                     f"trace (more than {_WALK} ops back)", out.taint)
    decided = None
    for pred, fact in [(p, ctx.fact(p)) for p in sorted(predicates)]:
        if fact is None:
            continue
        if fact.kind == PART:
            return mixed(node.name, "a value a TF1 cond chooses by a condition decided per example",
                         fact.taint | out.taint)
        if fact.kind == MIXED:
            return fact.with_(handle=None)
        bad, taint = condition(ctx, node, fact, pred)   # as the Switch's rule: a coupling's taint
        if bad is not None:
            return bad
        if not taint <= (decided or out).taint:
            decided = (decided or out).with_(taint=(decided or out).taint | taint)
    return decided


def _predicates(ctx: Context, node: Node) -> set[str] | None:
    """The predicates of the ``Switch`` nodes first met on every way back from cond ``Merge``
    ``node`` (by data and control edges), and of those met on the way back from each such
    predicate (one made in an outer branch, a constant waiting for its pivot, leads to the
    outer cond's Switch: review 47); None when the walk grows past :data:`_WALK` ops.

    Another cond's ``Merge`` met on the way is live whichever branch its own predicate takes,
    and its value carries that predicate's fact already (this rule ran there): behind it, its
    own cond's switches lead on to what they switch, not to their predicate. An assertion in
    a branch is such a cond (``tf.Assert``, the weights check of ``v1.losses``): its predicate
    (a set operation on shapes) had made every cond around a weighted loss inexact (review
    48 L3; exact before 8dae365's rule)."""
    predicates, seen = set(), set()
    work = [(node_of(r), ()) for r in node.inputs]     # (op, the conds whose Merge we passed)
    while work:
        name, passed = work.pop()
        if (name, passed) in seen or name not in ctx.ir.nodes:
            continue
        seen.add((name, passed))
        if len(seen) > _WALK:
            return None
        back = ctx.ir.nodes[name]
        if back.op in ("Switch", "RefSwitch"):
            pred = node_of(back.inputs[1])
            inside = [i for i, own in enumerate(passed) if pred in own]
            if inside:                  # out of a cond we came in through its Merge
                work.append((node_of(back.inputs[0]), passed[:inside[-1]]))
                continue
            predicates.add(back.inputs[1])
            work.append((node_of(back.inputs[1]), passed))  # made in an outer branch, it leads there
            continue
        if back.op in ("Merge", "RefMerge") and not _looping(ctx, back):
            own = cond_predicate(ctx.ir.nodes, back)
            passed = passed + (own,) if own and own not in passed else passed
        work.extend((node_of(r), passed) for r in back.inputs)
        work.extend((c, passed) for c in back.control)
    return predicates


def _looping(ctx: Context, node: Node) -> bool:
    """A loop's ``Merge`` (it joins the value of the previous iteration)."""
    return any(ctx.ir.nodes[node_of(r)].op in ("NextIteration", "RefNextIteration")
               for r in node.inputs if node_of(r) in ctx.ir.nodes)


#: How far back a cond's ``Merge`` looks for its ``Switch`` nodes (review 47: 64 missed the
#: Switch behind a chain of 70 constant ops, and the cond was claimed exact).
_WALK = 20_000


def switch(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    data, pred = ins[0], ins[1]
    if pred.kind == PART:
        return [mixed(node.name, "a branch or loop condition decided per example", taint_of(ins))] * 2
    if pred.kind == MIXED:
        return [pred.with_(handle=None)] * 2
    bad, taint = condition(ctx, node, pred, node.inputs[1])
    if bad is not None:
        return [bad] * 2
    return [data.with_(taint=data.taint | taint)] * 2


def _key(fact: Fact) -> str | None:
    return fact.handle


def array_new(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    size = ins[0] if ins else shared()
    if size.kind == PART or size.kind == MIXED:
        return [mixed(node.name, "a TensorArray sized per example", size.taint)] * 2
    handle = shared(handle=node.name, taint=size.taint)
    return [handle, shared(taint=size.taint)]


def _write(ctx: Context, node: Node, key: str, value: Fact, ref: str) -> None:
    old = ctx.arrays.get(key)
    new = join([old, value], ctx.classes)
    if new is not None and new.kind == PART and value.kind == SHARED:
        ctx.demand(ref, new.axis, new, node)
    if new != old:
        ctx.arrays[key] = new
        ctx.changed = True


def _element(value: Fact, drop_leading: bool, node: Node, what: str) -> Fact:
    """The fact of one element of a tensor split along its leading axis."""
    if not drop_leading or value.kind != PART:
        return value.with_(value=None, index=None)
    if value.axis == 0:
        return mixed(node.name, f"{what} along the batch axis", value.taint)
    return value.with_(axis=value.axis - 1, value=None, index=None)


def array_write(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    key = _key(ins[0])
    if key is None:
        return [mixed(node.name, "a TensorArray of unknown origin", taint_of(ins))]
    _write(ctx, node, key, ins[2], node.inputs[2])
    return [shared(taint=taint_of(ins))]


def array_scatter(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    key = _key(ins[0])
    if key is None:
        return [mixed(node.name, "a TensorArray of unknown origin", taint_of(ins))]
    _write(ctx, node, key, _element(ins[2], True, node, node.op), node.inputs[2])
    return [shared(taint=taint_of(ins))]


def array_split(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    key = _key(ins[0])
    if key is None:
        return [mixed(node.name, "a TensorArray of unknown origin", taint_of(ins))]
    value = ins[1]
    element = mixed(node.name, "TensorArraySplit along the batch axis", value.taint) \
        if value.kind == PART and value.axis == 0 else value.with_(value=None)
    _write(ctx, node, key, element, node.inputs[1])
    return [shared(taint=taint_of(ins))]


def _read(ctx: Context, node: Node, ins: list[Fact]) -> Fact | None:
    key = _key(ins[0])
    if key is None:
        return mixed(node.name, "a TensorArray of unknown origin", taint_of(ins))
    element = ctx.arrays.get(key)
    if element is None:
        return None
    extra = taint_of(ins[1:])
    return element.with_(taint=element.taint | extra)


def array_read(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact | None]:
    return [_read(ctx, node, ins)]


def array_gather(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact | None]:
    element = _read(ctx, node, ins)
    if element is None or element.kind != PART:
        return [element]
    return [element.with_(axis=element.axis + 1)]


def array_concat(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact | None]:
    element = _read(ctx, node, ins)
    if element is not None and element.kind == PART and element.axis == 0:
        element = element.with_(outer=None, ordered=False)
    return [element, shared()]


def array_grad(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    key = _key(ins[0])
    if key is None:
        return [mixed(node.name, "a TensorArray of unknown origin", taint_of(ins))] * 2
    return [shared(handle=f"{key}#grad:{node.attr('source', '')}"), shared(taint=taint_of(ins))]


def array_size(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    return [shared(taint=taint_of(ins))]


def stack_new(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    return [shared(handle=node.name, taint=taint_of(ins))]


def stack_push(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    key = _key(ins[0])
    if key is None:
        return [mixed(node.name, "a stack of unknown origin", taint_of(ins))]
    _write(ctx, node, key, ins[1], node.inputs[1])
    return [ins[1]]


def stack_pop(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact | None]:
    key = _key(ins[0])
    if key is None:
        return [mixed(node.name, "a stack of unknown origin", taint_of(ins))]
    return [ctx.arrays.get(key)]

