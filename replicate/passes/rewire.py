"""Connect the shared graph to the towers and give merged values the original names.

Requires: the facts of analyze, split, clone and aggregate.

Produces: shared ops that read a gradient now read its aggregate (so processing such as
``clip_by_global_norm`` and the optimizer see exactly the single-device gradient); control
edges from shared ops into the region point at every tower's copy (state updates: tower 0's),
and a state write run once outside the towers waits for every tower's copy of the reads of its
variable that precede it on one device;
the original region nodes are removed, except those that do not depend on the batch and are
still read by shared ops or named in collections; forward tensors that a driver or a shared
op reads (the loss, logits, accuracy inputs...) are rebuilt under their original names by
merging the tower copies (concatenated in batch order, or count-weighted means, sums, max,
min); each aggregated gradient is also fetchable under its original name. The global step
and the optimizer are shared and untouched, so they run once per step.
``ir.facts["renamed"]`` maps removed names without a merged replacement to tower 0's copy.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from tensorflow.python.framework import dtypes

from replicate.graph.ir import IR, Node, node_of, parse_tensor, tensor_name
from replicate.passes import _asserts
from replicate.passes._combine import combine
from replicate.passes.pipeline import PassResult

__all__ = ["Rewire"]

log = logging.getLogger(__name__)


class Rewire:
    """Rewiring of shared consumers and merged outputs.

    Args:
        controller: device of merged forward outputs.
    """

    name = "rewire"

    def __init__(self, controller: str):
        self.controller = controller

    def run(self, ir: IR) -> PassResult:
        analysis = ir.facts["analysis"]
        towers = ir.facts["towers"]
        copies = ir.facts["copies"]
        aggregates = ir.facts["aggregates"]
        region = analysis.region_set
        doomed = [n for n in analysis.region if n not in analysis.keep]
        arity = {n: len(ir.output_types(ir.nodes[n])) for n in doomed}
        out_types = {f.tensor: ir.output_dtype(f.tensor) for f in analysis.outputs}
        self._controls(ir, analysis, copies, self.controller)
        for tensor, aggregate in aggregates.items():
            users = [c.name for c, _ in ir.data_consumers(tensor) if c.name not in region]
            ir.replace_uses(tensor, aggregate, only=users)
        recomputed = {n: ir.nodes[n] for f in analysis.outputs for n in f.recompute}
        ir.remove_many(doomed + sorted(analysis.dead))
        merged = self._merge_outputs(ir, analysis, towers, copies, arity, out_types)
        merged += self._recompute(ir, analysis, copies, recomputed)
        checked = _asserts.rewire(ir, copies, analysis.checks, [a.name for a in analysis.apply_ops]) \
            + _asserts.uncheck(ir, analysis.unchecked)
        for name, draw in ir.facts.get("global_draws", {}).items():
            if name not in ir.nodes:        # a once-per-step draw is the batch's: fetched as is
                ir.add(name, "Identity", [draw], device=ir.nodes[node_of(draw)].device,
                       attrs={"T": dtypes.as_dtype(ir.output_dtype(draw))})
                merged += 1
        self._tower0_only(ir, copies[0], [n for n in doomed if n not in analysis.needed])
        aliases = 0
        for tensor, aggregate in aggregates.items():
            name, idx = parse_tensor(tensor)
            if idx == 0 and arity.get(name) == 1 and name not in ir.nodes:
                ir.add(name, "Identity", [aggregate], device=ir.nodes[node_of(aggregate)].device,
                       attrs={"T": ir.nodes[node_of(aggregate)].attrs["T"]})
                aliases += 1
        stale = self._colocation(ir, towers.prefixes)
        ir.facts["renamed"] = {n: copies[0][n] for n in doomed if n not in ir.nodes and n in copies[0]}
        log.info("rewire: %d region originals removed, %d outputs merged, %d gradient aliases, "
                 "%d stale colocations dropped, %d assertions' copies check the batch's value",
                 len(doomed), merged, aliases, stale, checked)
        return PassResult(ir, True)

    @staticmethod
    def _colocation(ir: IR, prefixes: list[str]) -> int:
        """Drop ``loc:@`` entries of shared ops that name a node no longer in the graph."""
        dropped = 0
        for node in ir:
            if "_class" not in node.attrs or node.name.split("/", 1)[0] in prefixes:
                continue
            entries = node.attr("_class", [])
            kept = [e for e in entries if not e.startswith("loc:@") or e[5:] in ir.nodes]
            if len(kept) != len(entries):
                dropped += len(entries) - len(kept)
                if kept:
                    ir.set_attr(node.name, "_class", kept, kind="list(string)")
                else:
                    ir.drop_attr(node.name, "_class")
        return dropped

    @staticmethod
    def _controls(ir: IR, analysis, copies: list[dict[str, str]], controller: str) -> None:
        for write, reads in analysis.evicted_reads.items():
            waits = [c[r] for r in reads for c in copies if r in c]
            if write in analysis.region_set:
                # run by tower 0 alone (its own reads precede it already): the other towers'
                # reads meet at a node outside the towers, which it waits for
                others = [c[r] for r in reads for c in copies[1:] if r in c]
                gate = f"{write}/replicate_reads"
                waits = [ir.add(gate, "NoOp", control=others, device=controller).name] if others else []
                write = copies[0][write]
            ir.set_control(write, list(dict.fromkeys(ir.nodes[write].control + waits)))
        replicated = analysis.region_set - analysis.keep
        for consumer in analysis.external_controls:
            new: list[str] = []
            for ctl in ir.nodes[consumer].control:
                if ctl in replicated:
                    new.extend(c[ctl] for c in copies if ctl in c)
                else:
                    new.append(ctl)
            ir.set_control(consumer, new)

    @staticmethod
    def _tower0_only(ir: IR, first: dict[str, str], names: list[str]) -> None:
        """Shared readers of ops that only tower 0 runs (state updates and what only feeds
        them) read tower 0's copy: there is no other."""
        for name in names:
            if name in ir.nodes or name not in first:
                continue
            for reader in list(ir.consumers(name)):
                for i, ref in enumerate(reader.inputs):
                    producer, idx = parse_tensor(ref)
                    if producer == name:
                        ir.set_input(reader.name, i, tensor_name(first[name], idx))

    def _recompute(self, ir: IR, analysis, copies, originals: dict) -> int:
        """Outputs no combination of tower copies gives are computed once, under their original
        names, from merged inputs, shared values (tower 0's copies, which run before the
        update) and nodes outside the towers."""
        done = 0
        for out in analysis.outputs:
            for name in out.recompute:
                if name in ir.nodes:
                    continue
                node = originals[name]
                inputs = []
                for ref in node.inputs:
                    producer, idx = parse_tensor(ref)
                    if producer not in ir.nodes and producer in copies[0]:
                        ref = copies[0][producer] if idx == 0 else f"{copies[0][producer]}:{idx}"
                    inputs.append(ref)
                attrs = {k: v for k, v in node.attrs.items() if k != "_class"}
                ir.add_node(Node(name, node.op, inputs, [], self.controller, attrs))
                done += 1
        return done

    def _merge_outputs(self, ir: IR, analysis, towers, copies, arity, out_types) -> int:
        by_node: dict[str, dict[int, object]] = defaultdict(dict)
        for out in analysis.outputs:
            name, idx = parse_tensor(out.tensor)
            by_node[name][idx] = out
        count = 0
        n = len(towers.devices)
        synced = ir.facts.get("synced_outputs", {})
        for name, roles in by_node.items():
            if name in ir.nodes or any(name not in copies[k] for k in range(n)) or \
                    any(r.role == "recompute" for r in roles.values()):
                continue
            if arity.get(name, 1) == 1 and list(roles) == [0]:
                combine(ir, towers, name, [copies[k][name] for k in range(n)], roles[0].role,
                        out_types[f"{name}:0"], self.controller, self.controller, roles[0].weights,
                        axis=roles[0].axis, tail=roles[0].tail, outer=_copies_of(roles[0].outer, copies, n))
                count += 1
                continue
            outputs, types = [], []
            refs = [is_ref for _, is_ref in ir.output_types(ir.nodes[copies[0][name]])]
            for i in range(arity[name]):
                tensor = f"{name}:{i}"
                if i in roles and roles[i].role == "first" and i < len(refs) and refs[i]:
                    # a reference variable passed by a cond's RefSwitch: an Identity of it is
                    # no reference any more, and the write it feeds did not import (review 50 F1)
                    outputs.append(f"{copies[0][name]}:{i}")
                elif i in roles:
                    outputs.append(combine(ir, towers, f"{name}_merged/output_{i}",
                                           [f"{copies[k][name]}:{i}" for k in range(n)], roles[i].role,
                                           out_types[tensor], self.controller, self.controller,
                                           roles[i].weights, axis=roles[i].axis, tail=roles[i].tail,
                                           outer=_copies_of(roles[i].outer, copies, n)))
                    count += 1
                elif i in synced.get(name, {}):
                    outputs.append(synced[name][i])     # a synchronized statistic (sync pass)
                else:
                    outputs.append(f"{copies[0][name]}:{i}")
                types.append(ir.output_dtype(outputs[-1]))
            tower0 = ir.nodes[copies[0][name]]
            if tower0.op in _SWITCHES and len(outputs) == 2:
                # one output of a TF1 cond's Switch is dead: an IdentityN of both is dead
                # whole, and every reader after it never ran (the moving averages of a batch
                # norm under a training flag were not updated; Grappler's rewrite of the
                # IdentityN had hidden it). The live one, switched again by the same predicate.
                live = ir.add(f"{name}_merged/live", _SWITCHES[tower0.op], [_ref(o) for o in outputs],
                              device=self.controller, attrs={"T": types[0], "N": 2})
                ir.add(name, tower0.op, [live.name, tower0.inputs[1]], device=self.controller,
                       attrs={"T": types[0]})
                continue
            ir.add(name, "IdentityN", [_ref(o) for o in outputs], device=self.controller,
                   attrs={"T": types})
        return count


#: A TF1 cond's switches, and the merge that takes the live one of their outputs.
_SWITCHES = {"Switch": "Merge", "RefSwitch": "RefMerge"}


def _ref(tensor: str) -> str:
    node, idx = parse_tensor(tensor)
    return node if idx == 0 else f"{node}:{idx}"


def _copies_of(outer, copies, n: int):
    """A merge's count of batch copies: an int, or per tower the ``(tensor, dimension)`` it is
    the size of (``"tensor#dim"``, read from the tower's own copy of the tensor)."""
    if isinstance(outer, int):
        return outer
    tensor, dim = outer.rsplit("#", 1)
    name, idx = parse_tensor(tensor)
    return [(tensor_name(copies[k].get(name, name), idx), int(dim)) for k in range(n)]
