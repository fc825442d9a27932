"""Control hubs: one NoOp inside the IR standing for a set of control inputs many nodes share.

``minimize`` built under ``tf.control_dependencies(update_ops)``, as the ``tf.layers``
documentation recommends, gives every gradient op without another input one control edge per
batch-norm update. Slim's ResNet-152 built that way has 445,000 control edges on 15,800 nodes,
and 1,064 of its nodes wait for the same 310 updates. TensorFlow's importer handles an edge in
well under a microsecond; every pass that walks edges pays about one.

:func:`plan` (at load) finds the control sets that many nodes share exactly, and the loader
gives each a hub: a ``NoOp`` that waits for the set, and one control edge to it in place of
the set wherever a node's control inputs include it. That is the graph ``tf.group(*updates)``
would have built, so the passes treat a hub as any ``NoOp`` that forwards its waits, cloning
it per tower where its consumers are. :func:`expand` (at write) puts the members back in
place of every hub, transitively, and drops the hubs: the output GraphDef has the user's
control edges, with the passes' changes to them.

Requires: a top-level GraphDef. Graphs with TF1 control flow are left alone (a hub's frame
would follow from its inputs, not from the frame its consumers run in). Produces: hub nodes
marked with the ``_replicate_hub`` attribute, named ``replicate/control_hub_<i>``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from tensorflow.core.framework import attr_value_pb2

__all__ = ["MARK", "MIN_MEMBERS", "MIN_USES", "plan", "expand", "is_hub"]

#: The attribute that marks a hub (clones keep it, so per-tower copies are hubs too).
MARK = "_replicate_hub"
#: A set becomes a hub when it has at least this many members ...
MIN_MEMBERS = 16
#: ... and at least this many nodes wait for exactly that set.
MIN_USES = 8
#: TF1 control-flow ops: a graph holding any is not compressed.
_FRAME_OPS = frozenset({"Enter", "RefEnter", "Exit", "RefExit", "Switch", "RefSwitch", "Merge",
                        "RefMerge", "NextIteration", "RefNextIteration", "LoopCond"})


def plan(nodes: list[tuple[str, str, list[str]]]) -> tuple[list[tuple[str, ...]], list[str]]:
    """The hubs to make for a graph's ``(name, op, control inputs)``: their member tuples
    (largest first) and names."""
    counts: Counter = Counter()
    first: dict[frozenset, tuple[str, ...]] = {}
    for _, op, control in nodes:
        if op in _FRAME_OPS:
            return [], []
        if len(control) >= MIN_MEMBERS:
            key = frozenset(control)
            if len(key) >= MIN_MEMBERS:
                counts[key] += 1
                # members in the order the first consumer lists them
                first.setdefault(key, tuple(dict.fromkeys(control)))
    shared = [s for s, uses in counts.items() if uses >= MIN_USES]
    if not shared:
        return [], []
    names = {name for name, _, _ in nodes}
    members = sorted((first[s] for s in shared), key=lambda m: (-len(m), m))
    out, i = [], 0
    for _ in members:
        while f"replicate/control_hub_{i}" in names:
            i += 1
        out.append(f"replicate/control_hub_{i}")
        i += 1
    return members, out


def substitute(control: list[str], hubs: list[tuple[str, ...]], names: list[str]) -> list[str]:
    """``control`` with every hub's members replaced by the hub (at its first member's place)."""
    if len(control) < MIN_MEMBERS:
        return control
    present = set(control)
    out = control
    for members, name in zip(hubs, names):
        if len(members) <= len(present) and present.issuperset(members):
            gone = set(members)
            at = min(i for i, c in enumerate(out) if c in gone)
            out = [c for c in out[:at] if c not in gone] + [name] + \
                [c for c in out[at:] if c not in gone]
            present -= gone
    return out


def hub_attrs() -> dict[str, attr_value_pb2.AttrValue]:
    """A hub's attributes: only its mark."""
    return {MARK: attr_value_pb2.AttrValue(b=True)}


def is_hub(attrs) -> bool:
    """Whether a node with these attributes is a hub."""
    return MARK in attrs


def expand(control: Iterable[str], hub_control: dict[str, list[str]]) -> list[str]:
    """``control`` with every hub replaced by its members, transitively, without repeats."""
    out: dict[str, None] = {}
    stack = list(reversed(list(control)))
    while stack:
        name = stack.pop()
        inner = hub_control.get(name)
        if inner is None:
            out[name] = None
        else:
            stack.extend(reversed(inner))
    return list(out)
