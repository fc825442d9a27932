"""The TF1 loop frames a node runs in.

A TF1 while loop (``Enter``/``Merge``/``Switch``/``NextIteration``/``Exit``) runs its body in
a frame that ``Enter`` opens; a tensor from outside the loop reaches the body only through an
``Enter`` of that frame, and a node with no data inputs runs in the frame of its control
inputs. Walking back from a node over its inputs without crossing an ``Exit`` (which leaves a
nested loop) stays in the node's frame until it meets the ``Enter`` nodes that open it; from
an ``Enter``'s own input the walk continues in the enclosing frame.

Used by the analysis (a check that cannot be added inside a loop) and by the draw passes
(:mod:`replicate.passes._frames` brings tensors into a frame).
"""

from __future__ import annotations

import dataclasses

from replicate.graph.ir import IR, node_of

__all__ = ["Frame", "frames", "opening", "in_branch", "cond_predicate"]

_ENTER = ("Enter", "RefEnter")
_EXIT = ("Exit", "RefExit")
_SWITCH = ("Switch", "RefSwitch")
_MERGE = ("Merge", "RefMerge")


@dataclasses.dataclass(frozen=True)
class Frame:
    """One TF1 loop frame: its ``name`` (the ``Enter`` nodes' ``frame_name``), the
    ``parallel_iterations`` it allows, and one ``Enter`` node that opens it."""

    name: str
    parallel: int
    enter: str


def _back(ir: IR, start: str, found, stop, jump=None) -> str | None:
    """The first node ``found`` accepts on a walk back from ``start`` over its inputs and
    control inputs, not past nodes ``stop`` accepts (``start`` itself is neither); where
    ``jump(node)`` gives a list, the walk goes on from those tensors instead of the node's
    inputs."""
    seen, stack = {start}, [start]
    while stack:
        node = ir.nodes[stack.pop()]
        refs = None
        if node.name != start:
            if found(node):
                return node.name
            if stop(node):
                continue
            refs = jump(node) if jump is not None else None
        for ref in refs if refs is not None else list(node.inputs) + list(node.control):
            dep = node_of(ref)
            if dep not in seen and dep in ir.nodes:
                seen.add(dep)
                stack.append(dep)
    return None


def _frame_name(enter) -> str:
    frame = enter.attr("frame_name")
    return frame.decode() if isinstance(frame, bytes) else frame


def opening(ir: IR, start: str) -> str | None:
    """An ``Enter`` that opens the frame ``start`` runs in, or None in the root frame."""
    return _back(ir, start, lambda node: node.op in _ENTER, lambda node: node.op in _EXIT)


def frames(ir: IR, name: str) -> list[Frame]:
    """The TF1 loop frames node ``name`` runs in, outermost first (empty at the root)."""
    out: list[Frame] = []
    if not any(node.op in _ENTER for node in ir):
        return out
    start = name
    while True:
        opener = opening(ir, start)
        if opener is None:
            return out[::-1]
        node = ir.nodes[opener]
        out.append(Frame(_frame_name(node), int(node.attr("parallel_iterations", 10)), opener))
        start = node_of(node.inputs[0])


def _source(ir: IR, ref: str) -> str:
    """Tensor ``ref`` with the ``Identity`` ops before it skipped (a TF1 cond switches its
    predicate on itself, and its tensors on an Identity of it)."""
    while ir.nodes[node_of(ref)].op == "Identity" and not ir.nodes[node_of(ref)].control:
        ref = ir.nodes[node_of(ref)].inputs[0]
    return ref if ":" in ref else f"{ref}:0"


def in_branch(ir: IR, name: str) -> bool:
    """True when node ``name`` (of the root frame) may not run in a step: a ``Switch`` reaches
    it, by data or control. Such a node is skipped (its inputs are dead) when a branch it
    depends on is not taken; what replaces it must be skipped too. A loop's ``Exit`` runs
    when the loop's inputs are there: the walk goes on from the inputs of the loop's
    ``Enter`` nodes (past the loop's own ``Switch``). A cond's ``Merge`` runs when the
    cond's inputs are there: the walk goes on from the inputs of the cond's own ``Switch``
    nodes (its predicate and the tensors its branches read), so a draw after a cond runs in
    every step unless the cond itself lies in a branch (review 39: stopping at the ``Merge``
    moved a draw after an inner cond or loop out of the outer branch, 0.43-0.97 off)."""
    enters: dict[str, list[str]] = {}       # each frame's Enter inputs, once a walk needs them

    def past_loop(node) -> list[str] | None:
        if node.op not in _EXIT:
            return None
        opener = opening(ir, node.name)
        if opener is None:
            return None
        if not enters:
            for enter in ir:
                if enter.op in _ENTER:
                    enters.setdefault(_frame_name(enter), []).extend(list(enter.inputs) + list(enter.control))
        return enters.get(_frame_name(ir.nodes[opener]), [])

    def past(node) -> list[str] | None:
        return past_cond(node) if node.op in _MERGE else past_loop(node)

    def past_cond(merge) -> list[str] | None:
        """The inputs of the ``Switch`` nodes of the cond ``merge`` closes, or None (walk
        through it, conservatively) unless they all take one predicate. TensorFlow's TF1 cond
        passes everything a branch reads from outside through a ``Switch`` of its own
        predicate, and a branch's nodes without inputs wait for its pivot (an Identity of
        one): so the first ``Switch`` on every way back from the ``Merge`` is the cond's, and
        with its predicate alive one branch runs and the ``Merge`` does too."""
        switches: set[str] = set()

        def own(node) -> bool:
            if node.op in _SWITCH:
                switches.add(node.name)
            return False

        _back(ir, merge.name, own, lambda node: node.op in _SWITCH, past)
        predicates = {_source(ir, ir.nodes[s].inputs[1]) for s in switches}
        if len(predicates) != 1:
            return None
        return sorted({ref for s in switches for ref in list(ir.nodes[s].inputs) + list(ir.nodes[s].control)})

    return _back(ir, name, lambda node: node.op in _SWITCH, lambda node: False, past) is not None


def cond_predicate(nodes: dict, merge) -> frozenset:
    """The predicate of the TF1 cond whose ``Merge`` is ``merge`` (``nodes``: name -> node, each
    with ``op`` and ``inputs``): its ``pred_id`` (``tf.cond`` names it in the cond's name
    scope; the switches of the values a branch reads read it) and the op it copies (the switch
    of the branches' pivots reads that). Empty if not found, or if the scope holds a second
    cond (``tf.cond(..., name="blk/")`` twice: a guard's Merge was taken for the outer cond's
    and a cond decided per tower claimed exact, 1.61 off; review 49 S1).

    A cond whose branches read nothing from outside has its ``pred_id`` pruned from the
    towers' copies: then the switch of its pivots (``Switch(pred, pred)``, named ``Switch`` in
    the scope) gives the predicate (review 49 C1: a cond on the batch size in a branch,
    gating the constant the branch returns, was taken for the end of the branch, and with
    ``accumulate=2`` the next micro-batch waited for it, dead in a step the other branch
    takes)."""
    scope = merge.name.rsplit("/", 1)[0] if "/" in merge.name else ""
    pred = f"{scope}/pred_id" if scope else "pred_id"
    if f"{pred}_1" in nodes:
        return frozenset()
    found = nodes.get(pred)
    if found is None:
        pivots = f"{scope}/Switch" if scope else "Switch"
        switch = nodes.get(pivots)
        if switch is not None and switch.op in ("Switch", "RefSwitch") and len(switch.inputs) == 2 \
                and switch.inputs[0] == switch.inputs[1] and f"{pivots}_1" not in nodes:
            return frozenset({node_of(switch.inputs[1])})
        return frozenset()
    if found.op != "Identity" or not found.inputs:
        return frozenset()
    return frozenset({pred, node_of(found.inputs[0])})
