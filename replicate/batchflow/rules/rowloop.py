"""Loops over the examples of the batch: ``tf.map_fn`` over the batch, and its gradient.

In TF2 control flow ``tf.map_fn(f, x)`` is a ``While`` whose condition compares a counter with
the number of examples; each iteration reads one example from the list of ``x``'s rows
(``TensorListFromTensor``) and writes ``f`` of it into a list of results. A tower's copy runs
once per example of its own rows, in order, and computes for each what one device computes
for it. Such a loop is per example when its functions prove that:

- its counters start at 0 and add 1 per iteration, and the condition only compares counters
  with the examples' count (``counter < n``, joined by ``LogicalAnd``);
- it reads lists of the batch's rows one element per iteration, at a counter, or (in the
  gradient loop) at an index popped from a list its forward loop pushed, and never as a
  whole (no stack, gather, concat or pop of them in a forward loop);
- what depends on the example goes into lists, one element per iteration (pushed, or set at
  its index), or into a sum carried from one iteration to the next (``AddN``/``AddV2`` of the
  carried value: a captured weight's gradient), never into other carried values;
- it draws nothing (iteration ``t`` is example ``t`` on one device, example ``first + t`` in
  a tower).

The body is analysed once with every value of the current example marked by the ``ROW``
taint. Then a list of the loop's results is partitioned along its length (``ROWS``), a
counter ends at the examples' count, a carried sum is a reduction over the batch. A loop
that proves less is left to :func:`replicate.batchflow.rules.functional.while_` (a
condition decided by the batch size mixes examples).
"""

from __future__ import annotations

from replicate.batchflow.context import Context
from replicate.batchflow.effects import draws
from replicate.batchflow.lattice import (
    LIST,
    PART,
    RED,
    ROWS,
    SHARED,
    Fact,
    Sym,
    join,
    mixed,
    red,
    shared,
)
from replicate.batchflow.table import IDENTITIES, behind
from replicate.graph.ir import IR, Node, parse_tensor, tensor_name

__all__ = ["rows_loop", "ROW"]

#: Taint of the values of a loop's current example (never leaves the loop's rule).
ROW = "replicate:row"
#: Taint of the values of a loop's earlier examples (carried from one iteration to the next).
CARRY = "replicate:carry"

#: Ops that read a whole list: in a loop over rows they would see other examples.
_WHOLE_LIST = frozenset({"TensorListStack", "TensorListGather", "TensorListConcat",
                         "TensorListConcatV2", "TensorListResize", "TensorListSplit",
                         "TensorListScatter", "TensorListScatterV2",
                         "TensorListScatterIntoExistingList"})
_SUMS = frozenset({"AddN", "AddV2", "Add"})

DRAWS = ("a loop over the batch's examples draws per iteration: iteration t is example t on one "
         "device but the tower's first row plus t in a tower")
CARRIES = "a loop over the batch's examples carries a value from one example to the next"
WHOLE = "a loop over the batch's examples puts values of the whole batch into its results"
UNPROVEN = (f"{CARRIES}, or reads them in another order than one by one (a tf.scan over the "
            "batch): replicate cannot prove it computes each example on its own")


def rows_loop(ctx: Context, node: Node, ins: list[Fact], body_of, call, passed) -> list[Fact | None] | None:
    """Output facts of ``While`` ``node`` when it is a loop over the examples of one batch
    class (see the module docstring), else None.

    Args:
        body_of: ``(ctx, function, refs) -> (ir, args, results) | None``.
        call: ``(ctx, node, function, refs, facts) -> facts | None`` (a body's analysis).
        passed: the loop variables the body returns unchanged.
    """
    refs = node.inputs[:len(ins)]
    found_body, found_cond = body_of(ctx, node.attr("body"), refs), body_of(ctx, node.attr("cond"), refs)
    if found_body is None or found_cond is None:
        return None
    body, args, outs = found_body
    counters = _counters(body, args, outs, ins)
    cls = _bound(ctx, found_cond, counters, ins) if counters else None
    if cls is None:
        return None
    rows = {i for i, f in enumerate(ins) if f.handle == ROWS}
    for i in rows:      # iteration t reads element t of each: the lists hold the same examples
        ctx.classes.union(cls, ins[i].cls, node.name)
    cls = ctx.classes.find(cls)
    gradient = ctx.in_gradient(node)
    if not rows or not _indexed(body, args, counters, rows, gradient):
        return None
    ctx.functions[("rows", node.name)] = cls
    if draws(ctx.ir, node):
        return [f if i in passed else mixed(node.name, DRAWS, f.taint) for i, f in enumerate(ins)]
    facts = [shared(taint=frozenset({ROW}), handle=LIST) if i in rows
             else shared(taint=frozenset({ROW})) if i in counters else f for i, f in enumerate(ins)]
    variant = [ctx.ir.output_dtype(r) == _VARIANT for r in refs]
    for _ in range(12):
        results = call(ctx, node, node.attr("body"), refs, facts)
        if results is None:
            return None
        results = [_marked(r) for r in results]
        new = []
        for i, (f, o) in enumerate(zip(facts, results)):
            j = f if i in rows or i in counters else join([f, o], ctx.classes)
            if j is not None and not variant[i] and i not in counters and _has_row(j):
                j = j.with_(taint=j.taint | {CARRY})   # a value of earlier examples
            new.append(j)
        if new == facts:
            break
        facts = new
    else:
        return None
    size = red(cls, "size", None, value=(Sym(1, cls),))
    out: list[Fact | None] = []
    for i, (before, after) in enumerate(zip(ins, results)):
        if i in passed:
            out.append(before)
        elif i in counters:
            out.append(size)
        elif after is None:
            out.append(None)
        elif variant[i]:
            out.append(_list_result(node, cls, before, after))
        elif not _has_row(after):
            # changed once per example without reading one: its value counts the examples
            out.append(mixed(node.name, CARRIES, after.taint))
        elif after.kind == SHARED and _carried_sum(body, args[i], outs[i]) and \
                not _has_row(before):
            out.append(red(cls, "sum", node.name, taint=_strip(after.taint)))
        else:
            out.append(mixed(node.name, CARRIES, _strip(after.taint)))
    return out


_VARIANT = 21       # types_pb2.DT_VARIANT


def _has_row(fact: Fact, mark: str = ROW) -> bool:
    return any(t == mark or t.endswith(">" + mark) for t in fact.taint)


def _marked(fact: Fact | None) -> Fact | None:
    """``fact`` with the current example's taint under one name (a body's analysis names a
    taint from inside it after the call)."""
    if fact is None or not _has_row(fact):
        return fact
    return fact.with_(taint=_strip(fact.taint) | {ROW} | ({CARRY} if _has_row(fact, CARRY) else set()))


def _strip(taint: frozenset) -> frozenset:
    return frozenset(t for t in taint if not any(t == m or t.endswith(">" + m) for m in (ROW, CARRY)))


def _list_result(node: Node, cls: int, before: Fact, after: Fact) -> Fact:
    """A list the loop fills one element per example, or one it leaves as it was."""
    if after.kind != SHARED:
        return mixed(node.name, WHOLE, _strip(after.taint))
    if _has_row(after, CARRY):
        return mixed(node.name, CARRIES, _strip(after.taint))
    if not _has_row(after) and after == before:
        return before
    return Fact(PART, axis=0, cls=cls, handle=ROWS, taint=_strip(after.taint))


def _counters(body: IR, args: list[str], outs: list[str], ins: list[Fact]) -> set[int]:
    """Loop variables that enter as 0 and leave as themselves plus 1."""
    found = set()
    for i, (arg, out) in enumerate(zip(args, outs)):
        if ins[i].kind != SHARED or ins[i].value != (0,):
            continue
        node = body.nodes.get(parse_tensor(behind(body, out, IDENTITIES))[0])
        if node is None or node.op not in ("AddV2", "Add") or len(node.inputs) != 2:
            continue
        a, b = (behind(body, r, IDENTITIES) for r in node.inputs)
        arg = tensor_name(*parse_tensor(arg))
        one = [r for r in (a, b) if r != arg]
        if len(one) == 1 and arg in (a, b):
            value = body.const_value(parse_tensor(one[0])[0])
            if value is not None and value.size == 1 and int(value) == 1:
                found.add(i)
    return found


def _bound(ctx: Context, found, counters: set[int], ins: list[Fact]) -> int | None:
    """The batch class whose example count the condition compares every counter with."""
    cond, args, outs = found
    index = {tensor_name(*parse_tensor(a)): i for i, a in enumerate(args)}
    classes: set[int] = set()

    def walk(ref: str) -> bool:
        node = cond.nodes.get(parse_tensor(behind(cond, ref, IDENTITIES))[0])
        if node is None:
            return False
        if node.op == "LogicalAnd":
            return all(walk(r) for r in node.inputs)
        if node.op != "Less" or len(node.inputs) != 2:
            return False
        a, b = (index.get(behind(cond, r, IDENTITIES)) for r in node.inputs)
        if a not in counters or b is None:
            return False
        n = ins[b]
        if n.kind != RED or not n.value or len(n.value) != 1 or not isinstance(n.value[0], Sym) \
                or n.value[0].coef != 1:
            return False
        classes.add(ctx.classes.find(n.value[0].cls))
        return True

    if len(outs) != 1 or not walk(outs[0]) or len(classes) != 1:
        return None
    return classes.pop()


def _indexed(body: IR, args: list[str], counters: set[int], rows: set[int], gradient: bool) -> bool:
    """True when the body reads and writes lists one element per iteration (see the module
    docstring)."""
    counter_refs = {tensor_name(*parse_tensor(args[i])) for i in counters}
    row_args = {parse_tensor(args[i])[0] for i in rows}
    for node in body:
        if node.op in _WHOLE_LIST:
            return False
        if node.op == "TensorListPopBack" and not gradient:
            return False
        if node.op in ("TensorListGetItem", "TensorListSetItem"):
            index = behind(body, node.inputs[1], IDENTITIES)
            name, _ = parse_tensor(index)
            popped = body.nodes.get(name) is not None and body.nodes[name].op == "TensorListPopBack" \
                and parse_tensor(index)[1] == 1
            if index not in counter_refs and not (gradient and popped):
                return False
        if node.op == "TensorListLength" and not gradient and \
                any(c.op != "TensorListPushBack" for c in body.consumers(node.name)):
            return False
        if node.op == "TensorListPushBack" and \
                parse_tensor(behind(body, node.inputs[0], IDENTITIES))[0] in row_args:
            return False
    return True


def _carried_sum(body: IR, arg: str, out: str) -> bool:
    """True when the body returns its argument ``arg`` plus something (``AddN``, ``AddV2``)
    and uses ``arg`` nowhere else."""
    node = body.nodes.get(parse_tensor(behind(body, out, IDENTITIES))[0])
    if node is None or node.op not in _SUMS:
        return False
    arg = tensor_name(*parse_tensor(arg))
    mine = [r for r in node.inputs if behind(body, r, IDENTITIES) == arg]
    if len(mine) != 1:
        return False
    users = [c for c in body.consumers(parse_tensor(arg)[0])]
    if not all(c.name == node.name or (c.op in IDENTITIES and all(
            u.name == node.name for u in body.consumers(c.name))) for c in users):
        return False
    # the running sum is only returned: no example's result depends on earlier examples
    return all(c.op in IDENTITIES and not body.consumers(c.name) for c in body.consumers(node.name))
