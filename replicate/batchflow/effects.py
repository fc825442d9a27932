"""Side effects of ops, function bodies included: what a node draws, writes or asserts.

TensorFlow 2 builds ``tf.cond``, while loops, ``dynamic_rnn``, Keras layers under a
``training`` flag and defuns as ``If``/``While``/``PartitionedCall`` ops whose bodies live in
the function library, even in graph mode. A moving-average update of
``batch_normalization(training=flag)`` is an ``AssignSubVariableOp`` inside an ``If``
branch; a dropout mask of ``Dropout(training=flag)`` is a ``RandomUniform`` inside one. So the
question "does this node draw random numbers / write state?" is never ``node.op in TABLE``
alone: a node that calls a function has every effect of every op in its body, transitively
(nested calls, both branches of a cond, a loop's condition and body).

Requires: an IR whose library holds the called functions.

Produces: :func:`effects` (every effect of a node, with the path of function names down to
the op that has it), and the predicates the analysis uses: :func:`draws`, :func:`writes`,
:func:`asserts`. Effects of a function are computed once per function and cached on the IR.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

from tensorflow.python.framework import op_def_registry

from replicate.graph import ops
from replicate.graph.ir import IR, Node

__all__ = ["Effect", "effects", "draws", "writes", "asserts", "called_functions", "describe"]

log = logging.getLogger(__name__)

#: Op types that check a condition at run time.
ASSERT_OPS = frozenset({"Assert"})

#: Effect kinds, in the order reports list them.
RANDOM, WRITE, ASSERT, IO = "random", "write", "assert", "io"


@dataclasses.dataclass(frozen=True)
class Effect:
    """One side effect found at or under a node.

    Attributes:
        kind: ``random`` (draws random numbers), ``write`` (writes a variable or other state),
            ``assert`` (checks a condition), ``io`` (touches files, Python or processes).
        op: op type of the op that has the effect.
        path: names of the functions entered from the node down to that op, then the op's
            node name inside the innermost one (just the node's own name at the top level).
        seeded: for ``random``: the op has a nonzero ``seed`` or ``seed2`` (or is stateless).
        arg: for a ``write`` inside a body: the position of the call's input that carries the
            written resource, when the body writes an argument directly; else None.
    """

    kind: str
    op: str
    path: tuple[str, ...]
    seeded: bool = True
    arg: int | None = None

    @property
    def inner(self) -> bool:
        """True when the effect is inside a function body, not the node itself."""
        return len(self.path) > 1


def called_functions(node) -> list[str]:
    """Names of the library functions ``node`` (a Node or NodeDef) calls through its attributes
    (``then_branch``, ``body``, ``f``, ``branches``...), in attribute order."""
    names: list[str] = []
    attrs = node.attrs if isinstance(node, Node) else node.attr
    for key in sorted(attrs):
        value = attrs[key]
        kind = value.WhichOneof("value")
        if kind == "func" and value.func.name:
            names.append(value.func.name)
        elif kind == "list" and value.list.func:
            names.extend(f.name for f in value.list.func if f.name)
    return names


def _own(op: str, attrs, name: str) -> list[Effect]:
    """Effects of one op by its type alone."""
    found = []
    generator = op in ops.GENERATOR_OPS
    if op in ops.RANDOM_OPS or op.startswith("StatelessRandom") or op.startswith("StatelessTruncated") \
            or (generator and op.startswith("Stateful")):
        # stateless ops and a generator's draws are determined by their inputs and its state
        seed = _attr_int(attrs, "seed") or _attr_int(attrs, "seed2") or op.startswith("Stateless") \
            or generator
        found.append(Effect(RANDOM, op, (name,), bool(seed) and op != "NonDeterministicInts"))
    if op in ops.MUTATING_OPS or op in ops.APPLY_OPS or op in ops.STATE_OPS or _unknown_state(op):
        found.append(Effect(WRITE, op, (name,)))
    if op in ASSERT_OPS:
        found.append(Effect(ASSERT, op, (name,)))
    if op in ops.UNSAFE_OPS:
        found.append(Effect(IO, op, (name,)))
    return found


@functools.lru_cache(maxsize=None)
def _unknown_state(op: str) -> bool:
    """A stateful op (by its OpDef) no table says anything about: taken to write state, so
    that what the analysis does not know makes the rewrite inexact, with the op named."""
    if op in ops.READ_STATE_OPS or op in ops.VARIABLE_OPS or op in ops.RANDOM_OPS or \
            op in ASSERT_OPS or op in ops.UNSAFE_OPS or op in ops.CALL_OPS or op in ops.CONSUMING_OPS or \
            any(family in op for family in ops.READ_STATE_FAMILIES):
        return False
    op_def = op_def_registry.get(op)
    return op_def is not None and op_def.is_stateful


def _attr_int(attrs, key: str) -> int:
    value = attrs.get(key)
    return int(value.i) if value is not None and value.WhichOneof("value") == "i" else 0


def _function_effects(ir: IR, fname: str, cache: dict, stack: tuple[str, ...]) -> tuple[Effect, ...]:
    """Effects of every op in function ``fname`` (and the functions it calls), paths relative
    to the function: ``(fname, ..., inner node name)``."""
    if fname in cache:
        return cache[fname]
    if fname in stack:              # recursion: the registry refuses it; never loop here
        return ()
    fdef = ir.function(fname)
    if fdef is None:
        return ()
    args = {a.name: i for i, a in enumerate(fdef.signature.input_arg)}
    found: list[Effect] = []
    for nd in fdef.node_def:
        own = _own(nd.op, nd.attr, nd.name)
        if nd.op in ops.CONSUMING_OPS:      # each tower's copy would take its own element
            own.append(Effect(WRITE, nd.op, (nd.name,)))
        for e in own:
            if e.kind == WRITE and nd.input:
                e = dataclasses.replace(e, arg=args.get(nd.input[0].split(":")[0]))
            found.append(dataclasses.replace(e, path=(fname,) + e.path))
        callees = called_functions(nd) + ([nd.op] if ir.function(nd.op) is not None else [])
        data = [r for r in nd.input if not r.startswith("^")][ops.LEADING_NON_ARGUMENTS.get(nd.op, 0):]
        for callee in callees:
            for e in _function_effects(ir, callee, cache, stack + (fname,)):
                # a nested call's argument that is one of this body's own arguments
                outer = args.get(data[e.arg].split(":")[0]) if e.arg is not None and e.arg < len(data) else None
                found.append(dataclasses.replace(e, path=(fname,) + e.path, arg=outer))
    cache[fname] = tuple(found)
    return cache[fname]


def effects(ir: IR, node: Node) -> tuple[Effect, ...]:
    """Every effect of ``node``: its own (by op type) and those of every function it calls."""
    cache = ir.facts.setdefault("function_effects", {})
    found = [e for e in _own(node.op, node.attrs, node.name)]
    callees = called_functions(node) + ([node.op] if ir.function(node.op) is not None else [])
    for callee in callees:
        found.extend(dataclasses.replace(e, path=(node.name,) + e.path)
                     for e in _function_effects(ir, callee, cache, ()))
    return tuple(found)


def draws(ir: IR, node: Node) -> list[Effect]:
    """The random draws at or under ``node``."""
    return [e for e in effects(ir, node) if e.kind == RANDOM]


def writes(ir: IR, node: Node) -> list[Effect]:
    """The state writes at or under ``node`` (assignments, scatters, optimizer kernels)."""
    return [e for e in effects(ir, node) if e.kind == WRITE]


def asserts(ir: IR, node: Node) -> list[Effect]:
    """The run-time assertions at or under ``node``."""
    return [e for e in effects(ir, node) if e.kind == ASSERT]


def describe(effect: Effect) -> str:
    """``'op' (Type)`` at the top level, ``'op' (Type) in function 'f' called by 'node'`` inside."""
    if not effect.inner:
        return f"'{effect.path[0]}' ({effect.op})"
    functions = " -> ".join(effect.path[1:-1])
    return f"'{effect.path[-1]}' ({effect.op}) in function {functions} called by '{effect.path[0]}'"
