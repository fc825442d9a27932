"""Helper of the analyze pass: which random draws the towers reproduce exactly.

One device draws a dropout mask (or per-example noise) for the whole batch; tower ``k``
must get exactly its rows of that draw. Two kinds of draw can be reproduced:

- **rows**: a seeded draw whose shape comes from the batch along one axis (a ``Shape`` of
  an activation, a static batch size), possibly with ``block`` rows per example (examples
  flattened with their time steps) or ``outer`` copies of the batch one after the other
  (attention heads folded into the batch). Each tower draws the global batch's shape with the
  original seeds (two kernels with equal seeds and equal shapes give equal streams, step
  after step) and keeps its rows (the draw pass);
- **same**: a seeded draw that does not depend on the batch (weight noise, a shared noise
  vector that could not be evicted). Every tower keeps the original seeds, so each draws
  the single-device values.

A ``rows`` draw may sit inside TF1 while loops (``Enter``/``Exit`` frames) when each loop
runs one iteration at a time (``parallel_iterations=1``): the draw pass brings its values
into the frames. A ``body`` draw is a cond, while_v2 or defun body whose random ops draw
rows, directly or in conds, loops and defuns it calls (a ``dropout(training=flag)`` in a
``tf.while_loop`` body: an ``If`` inside a ``While``). A **param_rows** draw makes one row per
row of a parameter that holds the batch's rows (``tf.random.categorical`` of per-example
logits, at the top level): each tower places its rows at their offset in a global-shaped
parameter and keeps its rows of the draw (the kernel gives row ``r`` the stream position ``r``
decides).

Anything else stays a reason: unseeded draws (one device does not reproduce itself
either), draws in loops that run iterations in parallel (at any depth), draws that read
per-example values (``Multinomial`` of per-example logits),
draws whose batch dimension is folded with another one in a way the facts do not describe,
and ops that permute examples (``RandomShuffle``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from replicate.batchflow.effects import draws
from replicate.batchflow.facts import Reason
from replicate.batchflow.lattice import PART, RED, SHARED
from replicate.batchflow.table import PARAM_DRAWS, SHAPE_SOURCES
from replicate.graph import ops
from replicate.graph.ir import IR, node_of
from replicate.passes._frames import frames

__all__ = ["Draw", "reproducible", "unseeded_once"]


#: Call ops whose functions' draws the draw pass rewrites (conds, loops and defuns).
BODY_CALLS = ops.CALL_OPS | frozenset({"While", "StatelessWhile"})


@dataclasses.dataclass(frozen=True)
class Draw:
    """A random op the towers reproduce: ``kind`` is ``rows`` (global shape, tower's rows of
    ``axis``, batch class ``cls``, output rank ``rank``), ``param_rows`` (the tower's rows of
    a draw from a global-shaped parameter), ``same`` (original seeds) or
    ``body`` (a call whose functions draw rows). For a call, ``inner`` lists a ``rows`` or
    ``same`` Draw per random op of its functions, named ``function/.../op``, with ``path``
    the functions from the outermost down; each tower calls its own copy of them. ``width``:
    the static element count of one row of ``axis`` (None if unknown)."""

    name: str
    kind: str
    axis: int | None = None
    cls: int | None = None
    rank: int | None = None
    inner: tuple = ()
    block: int = 1
    outer: int = 1
    path: tuple[str, ...] = ()
    width: int | None = None


def _width(dims, axis) -> int | None:
    """The static element count of one row of ``axis`` (the dims after it), or None."""
    rest = dims[axis + 1:] if dims is not None and axis is not None else None
    return None if rest is None or any(d is None for d in rest) else int(np.prod(rest, dtype=np.int64))


def reproducible(ir: IR, flow, random_ops: list[str]) -> tuple[dict[str, Draw], list[Reason]]:
    """The draws of ``random_ops`` the towers reproduce, and a reason for each other one."""
    found: dict[str, Draw] = {}
    reasons: list[Reason] = []
    for name in random_ops:
        node = ir.nodes[name]
        effect = draws(ir, node)[0]
        if effect.inner:
            body, why = _in_body(ir, flow, node)
            if body is not None:
                found[name] = body
            else:
                reasons.append(Reason(name, why[0], why[1]))
            continue
        why = _obstacle(ir, flow, node, effect)
        if why is None:
            fact = flow.fact(f"{name}:0")
            if fact.kind == SHARED:
                found[name] = Draw(name, "same")
            elif node.op in PARAM_DRAWS:
                found[name] = Draw(name, "param_rows", 0, flow.classes.find(fact.cls), 2)
            else:
                dims = ir.static_shape(f"{name}:0")
                found[name] = Draw(name, "rows", fact.axis, flow.classes.find(fact.cls),
                                   len(dims), block=fact.block, outer=fact.outer,
                                   width=_width(dims, fact.axis))
            continue
        reasons.append(Reason(name, why[0], why[1]))
    return found, reasons


def unseeded_once(ir: IR, evicted: list[str]) -> list[Reason]:
    """Reasons for unseeded draws among the ops run once outside the towers (a crop box
    drawn from an image's shape): the rewrite draws once per step as one device does, but
    one device does not reproduce its own draws, so nothing exact can be claimed of them."""
    out = []
    for name in evicted:
        for effect in draws(ir, ir.nodes[name]):
            if not effect.seeded:
                out.append(Reason(name, f"random op '{effect.path[-1]}' ({effect.op}) has no seed: "
                                  "one device does not reproduce its own draws either; it is drawn "
                                  "once per step, from the same distribution",
                                  "set a graph seed (tf.compat.v1.set_random_seed) or an op seed "
                                  "for exact, checkable replication"))
                break
    return out


def _in_body(ir: IR, flow, node) -> tuple[Draw | None, tuple[str, str] | None]:
    """A ``body`` Draw for a cond whose branches draw batch-shaped rows directly, or why not."""
    effects = draws(ir, node)
    first = effects[0]
    not_yet = (f"random op '{first.path[-1]}' ({first.op}) inside function "
               f"{' -> '.join(first.path[1:-1])} draws a separate stream in each tower",
               "results match single-device training in distribution only (the analysis could "
               "not follow the function's draws)")
    if node.op not in BODY_CALLS:
        return None, not_yet
    why = _loop_obstacle(node, flow, first)
    if why is not None:
        return None, why
    inner = []
    for e in effects:
        functions, fname, op = e.path[1:-1], e.path[-2], e.path[-1]
        for outer, callee in zip(functions, functions[1:]):    # calls between the bodies
            why = _nested_obstacle(ir, flow, outer, callee, e)
            if why is not None:
                return None, why
        if not e.seeded:
            return None, (f"random op '{op}' ({e.op}) inside function {fname} has no seed: one "
                          "device does not reproduce its own draws either",
                          "set a graph seed (tf.compat.v1.set_random_seed) or an op seed")
        body = flow.ctx.functions.get(("inner", fname))
        if e.op in PARAM_DRAWS:
            # sampling by per-example parameters (categorical, multinomial) is reproduced at
            # the top level and in a TF1 cond, not inside a function body (review 24: the
            # reason only said the analysis could not follow it)
            return None, (f"random op '{op}' ({e.op}) inside function {fname} samples by "
                          "per-example parameters, which replicate reproduces outside function "
                          "bodies only; each tower draws its own stream",
                          "draw it outside the function, or build a tf.cond with "
                          "tf.compat.v1.disable_control_flow_v2() (a TF1 cond), where it is "
                          "reproduced exactly")
        if body is None or op not in body.ir.nodes:
            return None, not_yet
        why = _obstacle(body.ir, body, body.ir.nodes[op], dataclasses.replace(e, path=(op,)))
        fact = body.fact(f"{op}:0")
        if why is None and fact is not None and fact.kind == SHARED:
            # each tower's kernel draws what one device draws (same seeds): in its own copy of
            # the functions, which the draw pass makes
            inner.append(Draw("/".join(functions + (op,)), "same", path=functions))
            continue
        if why is not None or fact is None or fact.kind != PART or fact.block != 1 or fact.outer != 1:
            return None, why or not_yet
        dims = body.ir.static_shape(f"{op}:0")
        inner.append(Draw("/".join(functions + (op,)), "rows", fact.axis,
                          flow.classes.find(fact.cls), len(dims), path=functions,
                          width=_width(dims, fact.axis)))
    rows = [d for d in inner if d.kind == "rows"]
    if len({d.cls for d in rows}) > 1:
        return None, not_yet
    if not rows:
        return Draw(node.name, "same", inner=tuple(inner)), None
    return Draw(node.name, "body", cls=rows[0].cls, inner=tuple(inner)), None


def _loop_obstacle(node, flow, effect) -> tuple[str, str] | None:
    """Why the draws under loop ``node`` (a ``While`` at the top level or in a body whose
    facts ``flow`` holds) cannot be reproduced, or None (not a loop)."""
    if not node.op.endswith("While"):
        return None
    parallel = node.attr("parallel_iterations", 1)
    op = effect.path[-1]
    if parallel != 1:
        return (f"random op '{op}' ({effect.op}) inside loop '{node.name}' runs up to {parallel} "
                "iterations at once: which iteration gets which draw can depend on scheduling, "
                "so one device need not reproduce its own draws",
                "build the loop with parallel_iterations=1 (dynamic_rnn(..., "
                "parallel_iterations=1); a Keras RNN layer: unroll=True): its draws are then "
                "reproduced exactly")
    trips = flow.fact(f"{node.name}:0")
    if trips is not None and trips.kind != SHARED:
        return (f"random op '{op}' ({effect.op}) inside loop '{node.name}' draws once per "
                "iteration, and the loop runs a number of iterations that depends on the batch: "
                "a tower's iteration t is not one device's",
                "bound the loop by a constant or a fed value, or draw the noise for the whole "
                "batch before the loop")
    return None


def _nested_obstacle(ir: IR, flow, outer: str, callee: str, effect) -> tuple[str, str] | None:
    """Why draws in function ``callee``, called from function ``outer``, cannot be
    reproduced: the call must be one the draw pass rewrites, analysed, and not a loop that
    runs iterations in parallel or a number of them that depends on the batch."""
    from replicate.passes._body_draws import calls_of

    body = flow.ctx.functions.get(("inner", outer))
    fdef = ir.function(outer)
    sites = calls_of(fdef, callee) if fdef is not None else []
    if body is None or not sites or any(s.name not in body.ir.nodes for s in sites):
        return (f"random op '{effect.path[-1]}' ({effect.op}) inside function "
                f"{' -> '.join(effect.path[1:-1])} draws a separate stream in each tower",
                "results match single-device training in distribution only; a call the rewrite "
                "does not handle stands between the bodies")
    for site in sites:
        why = _loop_obstacle(body.ir.nodes[site.name], body, effect)
        if why is not None:
            return why
    return None


def _obstacle(ir: IR, flow, node, effect) -> tuple[str, str] | None:
    """Why the draw of ``node`` cannot be reproduced (what, fix), or None."""
    if effect.inner:
        return (f"random op '{effect.path[-1]}' ({effect.op}) inside function "
                f"{' -> '.join(effect.path[1:-1])} draws a separate stream in each tower",
                "results match single-device training in distribution only")
    if getattr(flow, "depths", {}).get(node.name, 0):
        busy = [f for f in frames(ir, node.name) if f.parallel != 1]
        if busy:
            return (f"random op ({node.op}) inside TF1 while loop '{busy[-1].name}' runs up to "
                    f"{busy[-1].parallel} iterations at once: which iteration gets which draw can "
                    "depend on scheduling, so one device need not reproduce its own draws",
                    "build the loop with parallel_iterations=1 (dynamic_rnn(..., "
                    "parallel_iterations=1); a Keras RNN layer: unroll=True): its draws are then "
                    "reproduced exactly")
    if not effect.seeded:
        return (f"random op ({node.op}) has no seed: one device does not reproduce its own draws "
                "either; the towers draw from the same distribution",
                "set a graph seed (tf.compat.v1.set_random_seed) or an op seed for exact, "
                "checkable replication")
    fact = flow.fact(f"{node.name}:0")
    if fact is not None and fact.kind == SHARED and all(
            (f := flow.fact(r)) is not None and f.kind == SHARED for r in node.inputs):
        return None
    data = flow.fact(node.inputs[0]) if node.inputs else None
    if node.op == "RandomShuffle" and data is not None and data.kind == PART and data.axis == 0:
        return ("random_shuffle permutes the examples of the batch: each tower shuffles its own "
                "slice, so the towers' examples meet other examples than on one device",
                "shuffle the data before it is fed (in the input pipeline), or train this graph "
                "on one device")
    if node.op in PARAM_DRAWS:
        return _param_obstacle(ir, flow, node)
    shape_arg = SHAPE_SOURCES.get(node.op)
    rank = ir.static_shape(f"{node.name}:0")
    others = [r for i, r in enumerate(node.inputs) if i != shape_arg]
    shape = flow.fact(node.inputs[shape_arg]) if shape_arg is not None else None
    if shape is not None and shape.kind == RED and (fact is None or fact.kind != PART):
        # shaped by a count the batch gives (reduce_sum(ones_like(y))): no per-example value
        # is involved, and the reason said there was (review 24)
        return (f"random op ({node.op}) is shaped by a value reduced over the batch "
                f"('{shape.src or node_of(node.inputs[shape_arg])}'), which each tower computes "
                "from its own examples; each tower draws its own stream",
                "shape the draw by tf.shape(x)[0] of a batch input: replicate then draws the "
                "batch's values once and gives each tower its rows")
    if shape_arg is None or fact is None or fact.kind != PART:
        return (f"random op ({node.op}) draws per example from per-example values or permutes "
                "examples; each tower draws its own stream",
                "results match single-device training in distribution only")
    if fact.filtered or fact.block is None:     # review 41: said "folded" of a boolean_mask's rows
        return (f"random op ({node.op}) draws a number of rows per example known only at run "
                "time (the rows a filter such as tf.boolean_mask keeps, or a dimension folded in): "
                "where a tower's rows begin in the batch's draw depends on the other towers' "
                "examples; each tower draws its own stream",
                "draw the noise on the whole batch before the filter, with the batch as its own "
                "dimension")
    if not isinstance(fact.block, int) or not isinstance(fact.outer, int) \
            or fact.tail or not fact.ordered:
        return (f"random op ({node.op}) draws a shape whose batch dimension is folded with "
                "another one in an unknown way; each tower draws its own stream",
                "draw the noise with the batch as its own dimension")
    if rank is None:
        return (f"random op ({node.op}) has an output of unknown rank; each tower draws its own "
                "stream", "give the noise a static rank")
    if any((f := flow.fact(r)) is None or f.kind != SHARED for r in others):
        return (f"random op ({node.op}) reads per-example parameters; each tower draws its own "
                "stream", "results match single-device training in distribution only")
    return None


def _param_obstacle(ir: IR, flow, node) -> tuple[str, str] | None:
    """Why a draw of one row per row of a parameter (``PARAM_DRAWS``) cannot be reproduced: its
    rows must be the batch's, in order, on axis 0, its other inputs shared, and it must not be
    in a TF1 loop (the draw pass places the tower's rows at their offset in the global batch)."""
    rows = flow.fact(node.inputs[PARAM_DRAWS[node.op]])
    whole = rows is not None and rows.kind == PART and rows.axis == 0 and rows.block == 1 \
        and rows.outer == 1 and rows.ordered and not rows.filtered and not rows.tail \
        and rows.index is None
    others = [r for i, r in enumerate(node.inputs) if i != PARAM_DRAWS[node.op]]
    if not whole or any((f := flow.fact(r)) is None or f.kind != SHARED for r in others) \
            or getattr(flow, "depths", {}).get(node.name, 0):
        return (f"random op ({node.op}) draws one row per row of a parameter that is not the "
                "batch's rows in order at the top level; each tower draws its own stream",
                "results match single-device training in distribution only")
    return None
