"""Show what `convert` would do with a saved training graph, without writing anything.

Prints the batch inputs and their batch axes, the loss and how it reduces the batch, the
optimizers, the variables (count, bytes), what would be replicated per tower and what
stays shared, whether N towers would train exactly as one device (and why not), and
warnings: constants that bake in the batch size, trainable variables that get no
gradient, train ops that change nothing. --json prints the same as one JSON object.

example:
  replicate inspect model.meta --devices /gpu:0,/gpu:1 --json
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
from typing import Any

from replicate.cli.commands._cluster_args import add_cluster_arguments
from replicate.cli.commands._common import (
    add_device_arguments,
    add_graph_arguments,
    add_strategy_arguments,
    check_input,
    human_bytes,
    name_list,
    relabel,
    table,
    targets,
    train_op_hint,
)
from replicate.errors import ReplicateError
from replicate.wording import count, reductions

__all__ = ["HELP", "add_arguments", "run", "collect", "render"]

log = logging.getLogger(__name__)

HELP = "analyse a saved training graph: inputs, loss, optimizers, variables, exactness"

#: Tower devices assumed when --devices is not given.
DEFAULT_DEVICES = "/gpu:0,/gpu:1"

#: Variables listed in the text table (--json lists them all).
MAX_ROWS = 40

#: How each input format is called in the report.
FORMAT_NAMES = {"meta": "binary MetaGraphDef", "metatxt": "text MetaGraphDef",
                "pb": "binary GraphDef", "pbtxt": "text GraphDef", "savedmodel": "TF1 SavedModel"}

#: Learning-rate argument names of optimizer update ops.
_RATE_ARGS = ("lr", "alpha")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``replicate inspect``."""
    parser.add_argument("input", metavar="IN", help="a .meta, .pb or .pbtxt file, or a SavedModel directory")
    add_device_arguments(parser, required=False)
    add_graph_arguments(parser)
    add_strategy_arguments(parser)
    add_cluster_arguments(parser)
    parser.add_argument("--batch", metavar="B", type=_positive, default=None,
                        help="global batch size for the memory estimate (default: the inputs' "
                             "static batch size, if any)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': give a whole number of examples, 1 or more")
    return int(text)


def run(args: argparse.Namespace) -> int:
    """Analyse ``args.input`` and print the findings; return the exit code."""
    check_input(args.input)
    assumed = args.devices is None and getattr(args, "cluster", None) is None
    where = targets(args, default=DEFAULT_DEVICES)
    devices, controller = where.pop("devices"), where.pop("controller")
    info = collect(args.input, devices, controller, train_op=args.train_op, loss=args.loss,
                   outputs=name_list(args.outputs), strategy=where, batch=args.batch)
    info["devices_assumed"] = assumed
    print(json.dumps(info, indent=2, sort_keys=True) if args.json else render(info))
    return 0


def collect(path: str, devices: list[str], controller: str, strategy: dict | None = None,
            batch: int | None = None, **options: Any) -> dict[str, Any]:
    """Everything ``inspect`` reports about the graph at ``path``, as plain data.

    ``strategy`` holds the transform's placement and aggregation options (see
    :func:`replicate.cli.commands._common.strategy_options`); ``batch`` is the global batch of
    the memory estimate.
    """
    from replicate import api, memory
    from replicate.graph import io, meta

    loaded = io.load(path)
    source = loaded.meta if loaded.meta is not None else loaded.graph_def
    options["train_op"] = train_op_hint(options.get("train_op"), loaded.meta)
    try:
        ir = api.analyze_only(source, **options)
        result = api.transform(source, devices, controller=controller, **options, **(strategy or {}))
    except ReplicateError as exc:
        raise relabel(exc, path) from None
    analysis, report = ir.facts["analysis"], result.report
    region_ops = collections.Counter(ir.nodes[n].op for n in analysis.region if n in analysis.needed
                                     or len(devices) == 1)
    trained = {a.variable for a in analysis.apply_ops}
    return {
        "input": path, "format": loaded.format, "nodes": len(loaded.graph_def.node),
        "devices": report.devices, "controller": report.controller,
        "train_op": report.train_op, "loss": report.loss, "loss_reductions": report.loss_reductions,
        "global_step": report.global_step,
        "inputs": [dict(i, dtype=_dtype(ir, i["tensor"]), shape=ir.static_shape(i["tensor"]))
                   for i in report.inputs],
        "shared_inputs": report.shared_inputs,
        "optimizers": dict(collections.Counter(a.optimizer for a in analysis.apply_ops)),
        "variables": {
            "count": report.variables, "bytes": report.variable_bytes,
            "trained": report.trainable_variables,
            "list": [{"name": v.name, "kind": v.kind, "dtype": v.dtype, "shape": v.shape,
                      "bytes": v.bytes, "trained": v.name in trained}
                     for v in analysis.variables.values()]},
        "replicated": {"nodes_per_tower": report.nodes_per_tower,
                       "ops": dict(region_ops.most_common())},
        "shared": {"nodes": report.shared_nodes, "variables": report.variables,
                   "optimizer_updates": report.updates, "inputs": len(report.inputs)
                   + len(report.shared_inputs)},
        "mirrored": list(report.mirrored),
        "accumulate": dict(report.accumulate),
        "memory": memory.estimate(ir, analysis, len(devices), (strategy or {}).get("accumulate", 1),
                                  batch, (strategy or {}).get("aggregation") or "add_n").to_dict(),
        "phases": list(report.phases),
        "merged_outputs": [f.tensor for f in analysis.outputs if f.role != "first"],
        "named_outputs": [f.tensor for f in analysis.outputs
                          if f.role != "first" and _named(ir, f.tensor)],
        "tower0_outputs": [f.tensor for f in analysis.outputs if f.role == "first"],
        "random": {"ops": list(report.random.get("ops", [])),
                   "reproduced": dict(report.random.get("reproduced", {}))},
        "output_nodes": report.output_nodes, "exact": report.exact,
        "reasons": [dict(node=r.node, what=r.what, fix=r.fix) for r in report.reasons],
        "warnings": _warnings(ir, analysis, report, loaded.meta, meta),
    }


#: How the towers draw a random op, by its ``reproduced`` kind.
DRAWN = {"rows": "each tower its rows of the single-device draw",
         "param_rows": "each tower its examples' rows (one per row of the op's parameter)",
         "body": "in a cond, loop or function body: each tower its rows of the single-device draw",
         "same": "no batch shape: every tower draws what one device draws"}


def _random(random: dict) -> list[str]:
    """The random ops of the replicated region and how the towers draw each."""
    ops, done = random.get("ops", []), random.get("reproduced", {})
    if not ops:
        return []
    rows = [[op, DRAWN.get(done[op], done[op]) if op in done else "not reproduced (see the reasons)"]
            for op in ops[:MAX_ROWS]]
    out = ["", f"Random ops: {len(done)} of {len(ops)} in the towers reproduced exactly",
           table(["op", "drawn"], rows)]
    if len(ops) > MAX_ROWS:
        out.append(f"  ... {len(ops) - MAX_ROWS} more (--json lists all)")
    return out


def _named(ir, tensor: str) -> bool:
    """True when a tensor's node was named by the model's author, not after its op type."""
    name = tensor.split(":")[0]
    stem = name.rsplit("/", 1)[-1].split("_")[0].lower()
    return name in ir.nodes and not ir.nodes[name].op.lower().startswith(stem)


def _dtype(ir, ref: str) -> str:
    from tensorflow.python.framework import dtypes

    try:
        return dtypes.as_dtype(ir.output_dtype(ref)).name
    except (TypeError, KeyError, ValueError):
        return "?"


def _warnings(ir, analysis, report, meta_def, meta) -> list[str]:
    """Sentences about things that are legal but probably not what the user wants."""
    out: list[str] = []
    if analysis.static_batch is not None:
        out.append(f"the batch inputs have a static batch size {analysis.static_batch}: every "
                   "global batch must hold exactly that many examples")
    if report.rebatched:
        out.append(f"{len(report.rebatched)} constants bake in the batch size "
                   f"{analysis.static_batch} (first: '{report.rebatched[0]}'); they are rewritten "
                   "per tower")
    trained = {a.variable for a in analysis.apply_ops}
    if meta_def is not None and "trainable_variables" in meta_def.collection_def:
        from tensorflow.core.framework import variable_pb2

        for raw in meta_def.collection_def["trainable_variables"].bytes_list.value:
            var = variable_pb2.VariableDef.FromString(raw)
            name = var.variable_name.split(":")[0]
            if name and name not in trained:
                out.append(f"trainable variable '{name}' gets no gradient: the train op "
                           f"'{analysis.train_op}' never updates it")
    for apply in analysis.apply_ops:
        rate = _constant_rate(ir, ir.nodes[apply.name])
        if rate is not None and not rate.any():
            out.append(f"train op '{analysis.train_op}' changes nothing in '{apply.variable}': "
                       f"the learning rate of '{apply.name}' is 0")
    applies = [a.name for a in analysis.apply_ops]
    for key in meta.TRAIN_OP_KEYS:
        for name in meta.collection_ops(meta_def, key):
            if name in ir.nodes and name != analysis.train_op and not (
                    ir.ancestors([name]) & set(applies)):
                out.append(f"'{name}' (collection '{key}') changes no variable from a gradient")
    return out + list(report.warnings)


def _constant_rate(ir, node):
    """The learning rate of an update op when it is a constant (through Identity/Cast)."""
    for arg in _RATE_ARGS:
        pos = ir.arg_index(node, arg)
        if pos is None or pos >= len(node.inputs):
            continue
        name = node.inputs[pos].split(":")[0]
        while name in ir.nodes and ir.nodes[name].op in ("Identity", "Cast") and ir.nodes[name].inputs:
            name = ir.nodes[name].inputs[0].split(":")[0]
        return ir.const_value(name)
    return None


def render(info: dict[str, Any]) -> str:
    """The human-readable report of :func:`collect`'s data."""
    fmt = FORMAT_NAMES.get(info["format"], info["format"])
    lines = [f"{info['input']}  ({fmt}, {info['nodes']} nodes)", "", "Training"]
    kinds = reductions(info["loss_reductions"])
    lines.append(table(["role", "name", "note"], [
        ["train op", info["train_op"], "run by the driver; keeps its name"],
        ["loss", info["loss"] or "(not found)", kinds],
        ["global step", info["global_step"] or "-", "incremented once per step"],
    ]))
    lines += ["", "Inputs"]
    rows = [[i["tensor"], i["axis"], "dynamic" if i["static_size"] is None else i["static_size"],
             i["dtype"], _shape(i["shape"]), "split across towers"] for i in info["inputs"]]
    rows += [[t, "-", "-", "", "", "shared (not split)"] for t in info["shared_inputs"]]
    lines.append(table(["tensor", "batch axis", "batch size", "dtype", "shape", "role"], rows))
    lines += ["", "Optimizers"]
    lines.append(table(["optimizer", "updates"], sorted(info["optimizers"].items())))
    var = info["variables"]
    lines += ["", f"Variables: {var['count']}, {human_bytes(var['bytes'])} "
                  f"({var['trained']} updated by the optimizer)"]
    rows = [[v["name"], v["kind"], v["dtype"], _shape(v["shape"]), human_bytes(v["bytes"]),
             "yes" if v["trained"] else "no"] for v in var["list"][:MAX_ROWS]]
    lines.append(table(["name", "kind", "dtype", "shape", "size", "trained"], rows))
    if len(var["list"]) > MAX_ROWS:
        lines.append(f"  ... {len(var['list']) - MAX_ROWS} more (--json lists all)")
    assumed = " (assumed; pass --devices)" if info.get("devices_assumed") else ""
    lines += ["", f"Replication over {count(len(info['devices']), 'tower')}: {', '.join(info['devices'])}"
                  f"{assumed}; shared state on {info['controller']}"]
    ops = ", ".join(f"{op} {n}" for op, n in list(info["replicated"]["ops"].items())[:8])
    shared = info["shared"]
    lines.append(table(["", "nodes", "what"], [
        ["replicated", f"{info['replicated']['nodes_per_tower']} per tower",
         f"forward and backward pass ({ops})"],
        ["shared", shared["nodes"], f"{shared['variables']} variables, {shared['optimizer_updates']} "
                                    f"optimizer updates, {shared['inputs']} inputs, savers, summaries"],
        ["merged", len(info["merged_outputs"]), "forward tensors under their original names"
         + (": " + ", ".join(info["named_outputs"][:6]) if info["named_outputs"] else "")],
    ] + ([["tower 0", len(info["tower0_outputs"]),
           "forward tensors under their original names holding tower 0's value only (not "
           "mergeable; see the warnings)"]] if info.get("tower0_outputs") else [])))
    if info.get("mirrored"):
        lines.append(f"Mirrored: {len(info['mirrored'])} variables (weights and optimizer state) "
                     "copied on every tower device; the update runs on each device")
    if info.get("phases"):
        lines.append(f"Phases: {len(info['phases']) + 1} in one step; the towers' later gradients "
                     f"wait for {', '.join(info['phases'])}, applied once from the merged gradients")
    acc = info.get("accumulate") or {}
    if acc.get("micro", 1) > 1:
        lines.append(f"Accumulation: {acc['micro']} micro-batches per device, gradients summed on "
                     "each device, optimizer once; " + ("run one after the other" if acc["chained"]
                                                         else f"run side by side: {acc['why']}"))
    lines += _memory(info["memory"], info["controller"])
    lines += _random(info["random"])
    lines.append("")
    if info["exact"]:
        lines.append("Exact: yes (N towers train as one device on the same global batch)")
    else:
        lines.append(f"Exact: NO ({count(len(info['reasons']), 'reason')})")
        lines.append(table(["node", "why", "what to do"],
                           [[r["node"], r["what"], r["fix"]] for r in info["reasons"]]))
    lines += ["", f"Warnings: {len(info['warnings']) or 'none'}"]
    lines += [f"  - {w}" for w in info["warnings"]]
    return "\n".join(lines)


def _memory(mem: dict[str, Any], controller: str) -> list[str]:
    """The memory estimate's lines (see :mod:`replicate.memory`)."""
    state = f"state (variables, optimizer slots): {human_bytes(mem['state_bytes'])} on {controller}"
    per_example = human_bytes(mem["saved_activation_bytes_per_example"])
    unknown = (f"; {count(mem['unknown_saved_tensors'], 'saved tensor')} of unknown size not "
               "counted" if mem["unknown_saved_tensors"] else "")
    if mem["batch"] is None:
        return ["", f"Memory (estimate): {per_example} of saved activations per example{unknown}; "
                    f"pass --batch B for a step's totals; {state}"]
    rows = [[f"each tower device ({count(mem['examples_per_micro_batch'], 'example')} at a time)",
             *(human_bytes(mem["per_device"][k]) for k in ("activations", "gradients", "step"))],
            ["one device, for comparison",
             *(human_bytes(mem["one_device"][k]) for k in ("activations", "gradients", "step"))]]
    deferred = mem.get("deferred_gradients") or []
    later = ([f"  computed once from the micro-batches' kept slices (smaller than a running sum "
              f"at this batch): {', '.join(deferred[:4])}{' ...' if len(deferred) > 4 else ''}"]
             if deferred else [])
    return ["", f"Memory per step (estimate from static shapes, global batch {mem['batch']}; "
                f"{per_example} of saved activations per example{unknown})",
            table(["", "activations", "gradients", "step"], rows), *later, f"  {state}"]


def _shape(shape) -> str:
    if shape is None:
        return "?"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
