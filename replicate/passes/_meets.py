"""Helper of the split pass: where two inputs of one batch first meet, check they hold as many examples.

An input of a batch class is split by counts computed from its own shape (``split.py``), so a
run may feed it without the class's first input (a prediction fed ``x`` alone, the labels
declared first). Its rows then pair with the first input's only if the driver fed both the
same number of examples. One device does not always need that: a single row broadcasts
against the batch (``matmul(x, w) - m``, ``m`` fed as one row), where the towers would pair
that row with one tower's examples and nothing with the others' (claimed exact, 0.1 off:
review 20; the split by the first input's counts used to fail instead).

Requires: the IR before the clone pass (the meeting ops are copied into every tower with the
control edge), the analysis' loop depths.

Produces: an ``Assert`` per such input, ``replicate/split/<input>/own/same``, that the two
sizes are equal, and a control edge from it to every tower op where the two inputs first
meet (an op of the towers' region that depends on both, none of whose inputs does). A run that reads both checks them before
they meet; a run that feeds one never reaches the check. Ops inside TF1 loops are not given
the edge (a control edge into a loop frame is invalid).
"""

from __future__ import annotations

from tensorflow.python.framework import dtypes

from replicate.graph.ir import IR, node_of

__all__ = ["check_meetings"]


def check_meetings(ir: IR, first: str, member: str, first_size: str, member_size: str,
                   scope: str, device: str, depths: dict, region: frozenset) -> int:
    """Make the tower ops (``region``) where ``member`` first meets ``first`` (tensors) wait
    for a check that their sizes (scalar tensors) agree; returns how many ops wait. Shared
    ops read both inputs whole, as one device does: they need no check."""
    both = _reach(ir, first) & _reach(ir, member) & region
    meets = sorted((n for n in both if not depths.get(n, 0)
                    and not any(node_of(r) in both for r in ir.nodes[n].inputs + ir.nodes[n].control)),
                   key=lambda n: ("gradients" in n, n))       # the message names a forward op
    if not meets:
        return 0
    i32 = dtypes.int32
    same = ir.add(f"{scope}/equal", "Equal", [member_size, first_size], device=device,
                  attrs={"T": i32, "incompatible_shape_error": True}).name
    text = (f"replicate: batch input '{member}' holds another number of examples than "
            f"'{first}' (the two sizes follow), and the two meet at '{meets[0]}'. The towers "
            "split each by its own size, so they would pair other rows than one device does; "
            "feed both the same number of examples, or, if one holds no examples (a row that "
            "broadcasts), name it with shared_inputs=")
    message = ir.const(f"{scope}/message", text, dtypes.string, device)
    check = ir.add(f"{scope}/same", "Assert", [same, message, member_size, first_size], device=device,
                   attrs={"T": [dtypes.string, i32, i32], "summarize": 3}).name
    for name in meets:
        ir.set_control(name, ir.nodes[name].control + [check])
    return len(meets)


def _reach(ir: IR, tensor: str) -> set[str]:
    """Every node that depends on ``tensor`` (data or control)."""
    work = list({c.name for c, _ in ir.data_consumers(tensor)})
    seen = set(work)
    while work:
        for after in ir.consumers(work.pop()):
            if after.name not in seen:
                seen.add(after.name)
                work.append(after.name)
    return seen
