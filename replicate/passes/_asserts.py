"""Helper of the analyze and rewire passes: assertions that check a value of the whole batch.

An ``Assert`` in the towers checks its condition on the tower's own examples. That is the
single-device check only when the condition is the same in every tower (built from shared
values) or is an ``All`` over per-example values (the batch passes exactly when every tower
does; an empty tower passes). Any other condition reads a value of the whole batch -- the
batch size (``assert_equal(tf.shape(x)[0], 64)``, ``assert_positive(batch_size)``), a sum, a
maximum -- and each tower's copy would check its own value: a tower with fewer examples, or
none, fails where one device runs. TensorFlow 2 builds ``tf.debugging.assert_*`` on a
value known only at run time as an ``If`` whose branch holds the ``Assert`` (an *assert
guard*); its predicate and arguments are checked the same way. A ``tf.cond`` branch or defun
that asserts on a value it is passed (``assert_positive(batch_size)`` in a branch) reads
the batch's value when only assertions read that argument in its body.

Requires: the analysis's facts (``flow``), the tower region and the forward outputs the
frontier merges (or recomputes once on the controller) under their original names.

A NaN check (``check_numerics(loss)``) of such a value is checked once, on the merged value,
before the optimizer's updates: an empty tower's mean is 0/0.

Produces: :func:`whole_batch` (such assertions and checks of the calling graph, with the
inputs each must read), :func:`unchecked` (the merged inputs each reads, and reasons for those
the analysis could not merge), :func:`in_bodies` (reasons for such assertions inside function
bodies, whose copies cannot read a merged value), :func:`rewire` (run after the merge: each
tower's copy checks the merged condition, or does not check), and :func:`uncheck` (the
assertions in bodies turned off).
"""

from __future__ import annotations

from tensorflow.core.framework import types_pb2

from replicate.batchflow.effects import ASSERT, ASSERT_OPS, asserts, called_functions, effects
from replicate.batchflow.facts import Reason
from replicate.batchflow.lattice import PART, RED, SHARED
from replicate.graph import ops
from replicate.graph.frames import opening
from replicate.graph.ir import IR, Node, node_of, parse_tensor, tensor_name

__all__ = ["whole_batch", "unchecked", "logged_per_tower", "checked_once", "in_bodies", "rewire", "uncheck",
           "guard"]

#: Ops run once on a merged value: NaN checks, and prints (``tf.print``) and summaries of the
#: batch's values.
_PRINTS = frozenset({"PrintV2"}) | frozenset(ops.SUMMARY_VALUE)
_ONCE = ops.NUMERIC_CHECK_OPS | _PRINTS
#: The input that holds the value of a print, summary or check.
_VALUE = ops.SUMMARY_VALUE

#: Roles of a merged forward output whose original name holds the whole batch's value.
_GLOBAL_ROLES = frozenset({"concat", "mean", "sum", "ratio", "max", "min", "recompute", "global"})


def _per_tower(fact, dtype) -> bool:
    """A condition whose tower copies together check what the batch's does."""
    if fact is None:
        return False
    if fact.kind == SHARED:
        return True
    # All over per-example values: the batch passes exactly when every tower does; not when
    # they are compared with a batch statistic (``c >= mean(c) - 2``: each tower's own mean)
    return fact.kind == RED and fact.merge == "min" and dtype == types_pb2.DT_BOOL and not fact.taint


def guard(ir: IR, node: Node) -> bool:
    """``node`` is an assert guard: an ``If`` whose branches only assert, whose results only
    ``Identity`` ops read that only control edges leave (``tf.debugging.assert_*`` waits for
    one)."""
    if node.op not in ("If", "StatelessIf"):
        return False
    for reader in ir.consumers(node.name):
        if node.name in map(node_of, reader.inputs) and (reader.op != "Identity" or any(
                reader.name in map(node_of, c.inputs) for c in ir.consumers(reader.name))):
            return False
    found = effects(ir, node)
    return bool(found) and all(e.kind == ASSERT for e in found)


def whole_batch(ir: IR, flow, region: list[str], dependent: set[str]) -> dict[str, dict[int, str]]:
    """Assertions and assert guards of the towers whose condition reads a value of the whole
    batch -> the inputs (by position, the condition at 0) that must hold the batch's value."""
    found: dict[str, dict[int, str]] = {}
    for name in region:
        node = ir.nodes[name]
        if not node.inputs or (node.op not in ASSERT_OPS and node.op not in ops.CALL_OPS
                               and node.op not in _ONCE):
            continue
        if node.op in _ONCE:       # a NaN check, print or summary of a value of the whole batch
            value = tensor_name(*parse_tensor(node.inputs[_VALUE.get(node.op, 0)]))
            if name not in flow.ctx.gradient and opening(ir, name) is None and \
                    _varying(ir, flow.fact(value), value, dependent):
                found[name] = {0: value}
            continue
        if _is_call(ir, node):
            passed = _passed(ir, flow, node, dependent) if asserts(ir, node) else {}
            if passed:
                found[name] = passed
            continue
        cond = _before_switch(ir, node.inputs[0])
        if node_of(cond) not in dependent or _per_tower(flow.fact(cond), ir.output_dtype(cond)) \
                or _sizes_agree(ir, flow, cond):
            continue
        found[name] = {0: cond}
        for i, ref in enumerate(node.inputs[1:], start=1):
            t = _before_switch(ir, ref)
            fact = flow.fact(t)
            if node_of(t) in dependent and not (fact is not None and fact.kind == PART) \
                    and not _per_tower(fact, ir.output_dtype(t)):
                found[name][i] = t      # a count or sum in the message: the batch's
    return found


def _varying(ir: IR, fact, ref: str, dependent=None) -> bool:
    """``ref`` holds a value of the whole batch that a tower's copy would compute for itself."""
    if dependent is not None and node_of(ref) not in dependent:
        return False
    return fact is not None and fact.dependent and fact.kind != PART and \
        not _per_tower(fact, ir.output_dtype(ref))


def _passed(ir: IR, flow, node: Node, dependent: set[str]) -> dict[int, str]:
    """Inputs of call ``node`` (a ``tf.cond``, a defun) that hold a value of the whole batch
    and that, in every body it calls, only assertions read (by position); empty unless these
    are all that make the bodies' assertions check a value of the whole batch."""
    from replicate.batchflow.rules.functional import body_of

    lead = ops.LEADING_NON_ARGUMENTS.get(node.op, 0)
    refs = node.inputs[lead:]
    wanted = {lead + i: tensor_name(*parse_tensor(r)) for i, r in enumerate(refs)
              if _varying(ir, flow.fact(tensor_name(*parse_tensor(r))), r, dependent)}
    if not wanted:
        return {}
    for function in called_functions(node):
        found = body_of(flow.ctx, function, refs)
        if found is None:
            return {}
        body, args, outs = found
        for position in list(wanted):
            if not _asserted_only(body, node_of(args[position - lead]), set(outs)):
                del wanted[position]
        inner = flow.ctx.functions.get(("inner", function))
        if inner is None:
            return {}
        fixed = {node_of(args[p - lead]) for p in wanted}
        other = {node_of(a) for i, a in enumerate(args)
                 if lead + i not in wanted and flow.fact(tensor_name(*parse_tensor(refs[i]))) is not None
                 and flow.fact(tensor_name(*parse_tensor(refs[i]))).dependent}
        for check in body.nodes.values():
            if (check.op in ASSERT_OPS or guard(body, check)) and check.inputs and \
                    _varying(body, inner.fact(tensor_name(*parse_tensor(check.inputs[0]))), check.inputs[0]):
                behind = body.ancestors([node_of(check.inputs[0])])
                if not behind & fixed or behind & other:
                    return {}       # not (only) from the batch values passed in
    return wanted


def _asserted_only(body: IR, arg: str, outs: set[str]) -> bool:
    """Only assertions (and what computes their conditions) read argument ``arg`` of ``body``."""
    seen, work = {arg}, [arg]
    while work:
        name = work.pop()
        if any(o.startswith(f"{name}:") or o == name for o in outs):
            return False
        for consumer in body.consumers(name):
            if consumer.name in seen or name not in map(node_of, consumer.inputs):
                continue        # a control edge: waits, reads nothing
            if consumer.op in ASSERT_OPS or guard(body, consumer):
                continue
            op_def = body.op_def(consumer.op)
            if op_def is None or op_def.is_stateful or consumer.op in ops.CONTROL_FLOW_OPS \
                    or consumer.op in ops.CALL_OPS:
                return False
            seen.add(consumer.name)
            work.append(consumer.name)
    return True


def _switched_in(ir: IR, ref: str) -> bool:
    """Tensor ``ref`` comes through a ``Switch`` (past ``Identity`` ops): a TF1 cond's branch."""
    node = ir.nodes[node_of(ref)]
    while node.op == "Identity" and node.inputs and not node.control:
        node = ir.nodes[node_of(node.inputs[0])]
    return node.op in ("Switch", "RefSwitch") or (node.op == "Identity" and bool(node.control))


#: Ops through which a shape check's equalities pass to its condition.
_CHECK_PATH = frozenset({"All", "LogicalAnd", "Identity", "Cast", "Reshape", "Squeeze"})


def _sizes_agree(ir: IR, flow, cond: str, depth: int = 6) -> bool:
    """``cond`` only says that sizes of the batch are equal (``dynamic_rnn``'s check that
    ``sequence_length`` has the batch's size): each tower's copy of it holds exactly when the
    batch's does, since the split gives every input of a batch the same counts (and checks
    that it can). Read in the towers, such a check needs no value of the others."""
    node = ir.nodes[node_of(cond)]
    if node.op in ("Equal", "NotEqual"):
        facts = [flow.fact(tensor_name(*parse_tensor(r))) for r in node.inputs[:2]]
        return all(f is not None and (f.kind == SHARED or f.kind == RED and f.merge == "size")
                   for f in facts)
    if node.op not in _CHECK_PATH or not depth or not node.inputs:
        return False
    data = [r for r in node.inputs if not (node.op == "All" and r is node.inputs[-1] and len(node.inputs) > 1)]
    return all(_sizes_agree(ir, flow, r, depth - 1) for r in data)


#: Ops whose result depends on their input's shape only.
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def _shapes_only(ir: IR, ref: str, limit: int = 400) -> bool:
    """Tensor ``ref`` is computed from shapes alone: every path back to a fed input or a
    variable passes a ``Shape``/``Size``/``Rank`` op."""
    seen, work = {node_of(ref)}, [node_of(ref)]
    while work:
        node = ir.nodes[work.pop()]
        if node.op in _SHAPE_OPS:
            continue
        if node.op in ops.INPUT_SOURCE_OPS or node.op in ops.VARIABLE_OPS or len(seen) > limit:
            return False
        for producer in map(node_of, node.inputs):
            if producer in ir.nodes and producer not in seen:
                seen.add(producer)
                work.append(producer)
    return True


def _before_switch(ir: IR, ref: str) -> str:
    """Tensor ``ref`` seen from outside the TF1 conds it is in: past ``Identity`` ops and the
    data input of ``Switch`` ops (a TF1 ``tf.Assert`` guard switches its condition into the
    branch that asserts)."""
    while True:
        node = ir.nodes[node_of(ref)]
        if node.op not in ("Identity", "Switch", "RefSwitch") or node.control:
            return tensor_name(*parse_tensor(ref))
        ref = node.inputs[0]


def unchecked(ir: IR, checks: dict[str, dict[int, str]], outputs,
              flow=None) -> tuple[dict[str, dict[int, str] | None], list[Reason]]:
    """``checks`` with the merged inputs each tower's copy will read (None: not checked, the
    analysis could not merge its condition), and a reason for each assertion not checked, and
    each call whose bodies then check the towers' own values."""
    merged = {f.tensor for f in outputs if f.role in _GLOBAL_ROLES}
    settled: dict[str, dict[int, str] | None] = {}
    reasons: list[Reason] = []
    for name, refs in checks.items():
        if not _is_call(ir, ir.nodes[name]):
            # in a TF1 while loop the condition is the iteration's: no merged value outside
            # the loop's frame can stand in (review 43: "inputs from different frames")
            settled[name] = {i: t for i, t in refs.items() if t in merged} \
                if refs[0] in merged and opening(ir, name) is None else None
            kept = _switched_in(ir, ir.nodes[name].inputs[0])     # left in its cond's branch
            fact = flow.fact(refs[0]) if flow is not None else None
            if settled[name] is None and kept and (fact is not None and fact.kind == RED and
                                                   fact.src is None or _shapes_only(ir, refs[0])):
                continue    # a check of shapes and sizes in a TF1 guard (the losses API's
                            # assert_broadcastable): each tower's holds as the batch's does
            if settled[name] is None and ir.nodes[name].op not in _PRINTS:   # a print: each tower's
                reasons.append(Reason(name, f"the assertion checks '{refs[0]}', a value of the whole "
                                      "batch that replicate cannot compute once from the towers' "
                                      "values; each tower " + ("checks its own examples' value, and "
                                                               "may fail where one device passes" if kept else
                                                               "would check its own examples' value "
                                                               "and fail where one device passes, so "
                                                               "the towers do not check it"),
                                      "assert on the inputs as fed, outside the model, or "
                                      "remove the assertion"))
        elif all(t in merged for t in refs.values()):
            settled[name] = refs
        else:
            reasons.append(_in_body(name, next(t for t in refs.values() if t not in merged)))
    return settled, reasons


def logged_per_tower(ir: IR, checks: dict, settled: dict) -> list[str]:
    """Warnings for prints and summaries of a value of the whole batch that :func:`unchecked`
    could not settle (``checks`` before, ``settled`` after): each tower logs its own value
    (a variance out of a TF1 cond: three lines a step, ``nan`` for a tower without examples,
    review 45), where one device logs the batch's. Training is not affected."""
    return [f"'{name}' logs '{checks[name][0]}', a value of the whole batch that replicate cannot "
            "compute once from the towers' values: each tower logs its own (one device logs the "
            "batch's); compute it outside a tf.cond or loop to log the batch's"
            for name, refs in settled.items() if refs is None and ir.nodes[name].op in _PRINTS
            and checks.get(name)]


def checked_once(ir: IR, settled: dict) -> set[str]:
    """NaN checks :func:`rewire` makes once on the merged value and whose value no op reads,
    the identities (``verify_tensor_all_finite``'s) that wait for them, and ``MergeSummary``
    ops of summaries made once: fetched by name, each gives the batch's value (the warning
    called it tower 0's, review 45)."""
    found: set[str] = set()
    for name, refs in settled.items():
        if refs and ir.nodes[name].op in ops.NUMERIC_CHECK_OPS and not _read(ir, name):
            found.add(name)
            found.update(w.name for w in ir.consumers(name)
                         if w.op == "Identity" and name in w.control and not _read(ir, w.name))
    once = {name for name, refs in settled.items() if refs and ir.nodes[name].op in ops.SUMMARY_VALUE}
    found.update(n.name for n in ir.nodes.values() if n.op == "MergeSummary" and n.inputs
                 and all(node_of(r) in once for r in n.inputs))
    return found


def _is_call(ir: IR, node: Node) -> bool:
    return node.op in ops.CALL_OPS and not guard(ir, node)


def _in_body(where: str, what: str) -> Reason:
    return Reason(where, f"an assertion inside function '{where.split('/')[0]}' checks '{what}', "
                  "a value of the whole batch; each tower's copy of the function would check its own "
                  "examples' value (a tower with fewer examples, or none, failing where one device "
                  "passes), so the towers do not check it", "move the assertion out of the "
                  "tf.cond or function, or remove it")


def in_bodies(ir: IR, flow, checks: dict) -> tuple[list[Reason], dict[str, list[str]]]:
    """Reasons for assertions inside function bodies (a ``tf.cond`` branch, a defun, a loop)
    whose condition reads a value of the whole batch: every tower's copy of the body checks
    its own; and those assertions (function -> nodes), which :func:`uncheck` turns off. Not the
    branches of the assert guards in ``checks``, which read merged values."""
    functions = getattr(flow.ctx, "functions", {}) or {}
    guarded = {f for name, refs in checks.items() if refs for f in called_functions(ir.nodes[name])}
    reasons: list[Reason] = []
    found: dict[str, list[str]] = {}
    for key, inner in list(functions.items()):
        if not (isinstance(key, tuple) and len(key) == 2 and key[0] == "inner") or key[1] in guarded:
            continue
        for node in inner.ir.nodes.values():
            if node.op not in ASSERT_OPS and node.op not in ops.NUMERIC_CHECK_OPS or not node.inputs:
                continue
            cond = tensor_name(*parse_tensor(node.inputs[0]))
            fact = inner.fact(cond)
            if node.op in ops.NUMERIC_CHECK_OPS and not inner.in_gradient(node) \
                    and _varying(inner.ir, fact, cond):     # a NaN check of a batch mean
                reasons.append(_in_body(f"{key[1]}/{node.name}", cond))
                found.setdefault(key[1], []).append(node.name)
            elif node.op in ASSERT_OPS and fact is not None and fact.dependent \
                    and not _per_tower(fact, inner.ir.output_dtype(cond)):
                reasons.append(_in_body(f"{key[1]}/{node.name}", cond))
                found.setdefault(key[1], []).append(node.name)
    return reasons, found


def uncheck(ir: IR, bodies: dict[str, list[str]]) -> int:
    """The assertions ``bodies`` names (function -> nodes) check a constant True: each tower's
    copy of the function would check its own examples' value, and a tower with fewer examples
    (or none) failed where one device passes. The report's reason says they are not checked.
    Returns how many."""
    from tensorflow.python.framework import tensor_util

    done = 0
    for function, names in bodies.items():
        fdef = ir.function(function)
        if fdef is None:
            continue
        true = None
        for node in fdef.node_def:
            if node.name not in names or not node.input:
                continue
            if node.op in ops.NUMERIC_CHECK_OPS:     # passes its value on, unchecked
                node.op = "Identity"
                del node.attr["message"]
                done += 1
                continue
            if true is None:
                const = fdef.node_def.add(name="replicate_unchecked", op="Const")
                const.attr["dtype"].type = types_pb2.DT_BOOL
                const.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(True))
                true = "replicate_unchecked:output:0"
            node.input[0] = true
            done += 1
    return done


def rewire(ir: IR, copies: list[dict[str, str]], checks: dict[str, dict[int, str] | None],
           applies: list[str] = ()) -> int:
    """Each tower's copy of an assertion in ``checks`` reads the merged condition (and counts)
    under their original names; with no merged condition, a constant True. A NaN check of a
    value of the whole batch checks the merged value once, before the optimizer's ``applies``
    (an empty tower's mean is 0/0: its own check failed where one device passes); the towers'
    copies pass their value on unchecked. Returns the number of copies changed."""
    changed = 0
    for name, refs in checks.items():
        if ir.nodes.get(copies[0].get(name, "")) is not None and ir.nodes[copies[0][name]].op in _ONCE:
            changed += _once(ir, copies, name, refs, applies)
            continue
        for tower in copies:
            copy = tower.get(name)
            if copy is None or copy not in ir.nodes:
                continue
            node = ir.nodes[copy]
            if _is_call(ir, node):
                for i, t in (refs or {}).items():
                    ir.set_input(copy, i, _ref(t))
                changed += bool(refs)
                continue
            # what gated the copy (its branch of a TF1 cond, its loop) still does: an op with a
            # dead control input is skipped. Elsewhere the tower's own condition must not run
            # (review 44: its pick of the tower's first example stopped an empty tower)
            switched = _switched_in(ir, node.inputs[0])
            gated = switched or opening(ir, copy) is not None
            if switched and refs is None:
                continue    # in a TF1 cond's branch with no merged condition: left as it is (a
                            # constant waiting for the branch's Switch hung a step)
            if gated:
                ir.set_control(copy, list(dict.fromkeys(node.control + [node_of(node.inputs[0])])))
            if refs is None or node_of(refs[0]) not in ir.nodes:
                true = ir.const(f"{copy}/replicate_unchecked", True, device=node.device)
                if gated:
                    ir.set_control(true, [node_of(node.inputs[0])])    # in the loop's frame
                ir.set_input(copy, 0, true)
            else:
                for i, t in refs.items():
                    if node_of(t) in ir.nodes:
                        ir.set_input(copy, i, _ref(t))
                _switch_on(ir, tower, refs[0])
            changed += 1
    return changed


def _once(ir: IR, copies: list[dict[str, str]], name: str, refs: dict[int, str] | None,
          applies: list[str]) -> int:
    """A NaN check or a print of a value of the whole batch, made once on the merged value (a
    check before the optimizer's ``applies``). A tower's copy that only control edges wait for
    is replaced by it (the tower's own value, a pick of its first example, is then not
    computed: it stopped an empty tower, review 44); one whose value the tower reads passes
    that value on, unchecked."""
    first = ir.nodes[copies[0][name]]
    once = None
    if refs and node_of(refs[0]) in ir.nodes:
        inputs = list(first.inputs)         # a summary's tag: tower 0's constant
        inputs[_VALUE.get(first.op, 0)] = _ref(refs[0])
        once = ir.add(f"{name}/replicate_batch", first.op, inputs,
                      device=ir.nodes[node_of(refs[0])].device, attrs=dict(first.attrs)).name
        if first.op in ops.NUMERIC_CHECK_OPS:
            for apply in applies:
                if apply in ir.nodes:
                    ir.set_control(apply, list(dict.fromkeys(ir.nodes[apply].control + [once])))
    changed = 0
    for tower in copies:
        node = ir.nodes.get(tower.get(name, ""))
        if node is None:
            continue
        if once is not None and node.op in ops.SUMMARY_VALUE:
            for merge in [c for c in ir.consumers(node.name) if c.op == "MergeSummary"]:
                # merge_all() the loss waits for (review 45): it merges the batch's summary
                for i, ref in enumerate(list(merge.inputs)):
                    if node_of(ref) == node.name:
                        ir.set_input(merge.name, i, once)
        if once is not None and node.op in _PRINTS and not _read(ir, node.name, 0):
            for waiter in list(ir.consumers(node.name)):
                ir.set_control(waiter.name, list(dict.fromkeys(
                    once if c == node.name else c for c in waiter.control)))
            ir.remove(node.name)
        elif node.op in ops.NUMERIC_CHECK_OPS:
            node.op, node.attrs = "Identity", {"T": node.attrs["T"]}
            if once is not None and not _read(ir, node.name):    # (verify_tensor_all_finite's
                ir.set_input(node.name, 0, once)                    # identity waited for)
            for waiter in list(ir.consumers(node.name)) if once is not None else ():
                # assert_all_finite(ce[0]): an identity of the checked value that waits for
                # the check, itself only waited for, forwards the batch's value, not a pick
                # of the tower's first example (it stopped an empty tower, review 44 B3)
                if waiter.op == "Identity" and node.name in waiter.control and waiter.inputs \
                        and not _read(ir, waiter.name):
                    ir.set_input(waiter.name, 0, once)
        else:
            continue        # a print with no merged value: each tower prints its own
        changed += 1
    return changed


def _read(ir: IR, name: str, depth: int = 3) -> bool:
    """Some op reads ``name``'s value, past ``Identity`` ops only control edges wait for."""
    for reader in ir.consumers(name):
        if name not in map(node_of, reader.inputs):
            continue
        if reader.op != "Identity" or not depth or _read(ir, reader.name, depth - 1):
            return True
    return False


def _switch_on(ir: IR, tower: dict[str, str], cond: str) -> None:
    """A TF1 assert guard (``cond(condition, no_op, assert)``) in the tower decides by the
    merged condition too: its ``Switch`` ops (and their predicate's ``Identity``) read it in
    place of the tower's own, so the assertion runs when the batch fails, not only when the
    tower does (review 43: a sum below its bound in every tower but not in the batch passed)."""
    name, idx = parse_tensor(cond)
    own = tower.get(name)
    if own is None or own not in ir.nodes:
        return
    mine = (own, idx)
    for reader in list(ir.consumers(own)):
        switches = reader.op in ("Switch", "RefSwitch")
        predicate = reader.op == "Identity" and any(
            c.op in ("Switch", "RefSwitch") and len(c.inputs) > 1 and node_of(c.inputs[1]) == reader.name
            for c in ir.consumers(reader.name))
        if not (switches or predicate):
            continue
        for i, ref in enumerate(reader.inputs):
            if parse_tensor(ref) == mine:
                ir.set_input(reader.name, i, _ref(cond))


def _ref(tensor: str) -> str:
    node, idx = parse_tensor(tensor)
    return node if idx == 0 else f"{node}:{idx}"
