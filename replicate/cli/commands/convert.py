"""Rewrite a saved single-device training graph into exact N-tower training.

IN is a MetaGraphDef (.meta, or text .pbtxt), a TF1 SavedModel directory, or a GraphDef
(.pb/.pbtxt). OUT keeps IN's format (text when its name ends in .pbtxt) unless --format
says otherwise; a SavedModel's variables and assets are copied along. Nodes keep their
names, so a driver that imports OUT, restores a checkpoint of the single-device model,
feeds the same placeholders and runs the same train op trains on all devices, exactly as
one device would on the same global batches.

Unless --no-check, the original and the rewrite are trained a few steps side by side on
logical CPUs with synthetic inputs (ops that read files, call Python or reach other processes
are never run; the report says what was skipped); exit code 1 means OUT was written but the
numbers contradict a claim of exactness, and the report names the variable.

Nothing is written when anything fails (exit code 2) or is interrupted before the outputs
are put in place (exit code 130); IN is never modified. Outputs that are devices (/dev/null),
FIFOs, directories where a file is expected, or symbolic links are refused even with
--force; --tensorboard and --dump-dir create their last directory only, like -o.

example:
  replicate convert model.meta -o model_x4.meta --devices /gpu:0,/gpu:1,/gpu:2,/gpu:3
"""

from __future__ import annotations

import argparse
import logging
import shutil

from replicate.cli.commands._cluster_args import add_cluster_arguments
from replicate.cli.commands._common import (
    Progress,
    add_device_arguments,
    add_graph_arguments,
    add_strategy_arguments,
    check_input,
    name_list,
    relabel,
    targets,
    train_op_hint,
)
from replicate.errors import OutputError, ReplicateError
from replicate.graph import outputs
from replicate.wording import count

__all__ = ["HELP", "add_arguments", "run"]

log = logging.getLogger(__name__)

HELP = "rewrite a saved training graph for N devices (.meta, .pb, .pbtxt, SavedModel)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``replicate convert``."""
    from replicate.graph.io import FORMATS

    parser.add_argument("input", metavar="IN", help="a .meta, .pb or .pbtxt file, or a SavedModel directory")
    parser.add_argument("-o", "--output", required=True, metavar="OUT",
                        help="where to write the result (refused if it exists, unless --force; "
                             "always if it is a device, FIFO, link or the input)")
    add_device_arguments(parser, required=False)     # required unless --between-graph (run)
    add_graph_arguments(parser)
    add_strategy_arguments(parser)
    add_cluster_arguments(parser)
    parser.add_argument("--between-graph", action="store_true",
                        help="between-graph replication over --cluster: one template every worker "
                             "imports (replicate.runtime.between.import_meta_graph); --devices are the "
                             "towers inside each worker task (default: one per worker)")
    parser.add_argument("--task-index", type=int, default=None, metavar="N",
                        help="with --between-graph: pin the output to worker task N")
    parser.add_argument("--no-sparse-on-ps", dest="sparse_on_ps", action="store_false",
                        help="with --between-graph: keep sparsely trained variables on every "
                             "worker (all-gathered gradients) even when the cluster has ps tasks")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="output format (default: IN's, as text when OUT ends in .pbtxt)")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--dump-dir", metavar="DIR", help="write the IR after each pass here")
    parser.add_argument("--verify-each", action="store_true", help="validate the IR after every pass")
    parser.add_argument("--tensorboard", metavar="LOGDIR",
                        help="also write the rewritten graph as an event file for TensorBoard")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the numeric check: by default convert trains the original and "
                        "the rewrite a few steps side by side on logical CPUs, on synthetic inputs, "
                        "and a claimed exact that the numbers contradict is reported inexact "
                        "(exit code 1); graphs that read files, call Python or reach other "
                        "processes are never run")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")


def run(args: argparse.Namespace) -> int:
    """Convert ``args.input`` into ``args.output``; return the exit code."""
    from replicate.graph import io

    progress = Progress("replicate convert")
    check_input(args.input)
    if args.devices is None and not args.between_graph:
        raise ReplicateError("--devices is required (the tower devices, e.g. "
                             "/gpu:0,/gpu:1), unless --between-graph")
    where = _between_targets(args) if args.between_graph else targets(args)
    devices = where["devices"]
    io.check_writable(args.output, args.force, source=args.input)
    for option, directory in (("--tensorboard", args.tensorboard), ("--dump-dir", args.dump_dir)):
        if directory:
            outputs.check_directory(directory, source=args.input, option=option)
    loaded = io.load(args.input)
    fmt = io.output_format(args.output, loaded.format, args.format)
    if fmt == "savedmodel" and loaded.saved_model is None:
        raise OutputError(f"{args.output}: --format savedmodel needs a SavedModel input "
                          "(its variables are copied)")
    io.check_writable(args.output, args.force, source=args.input, directory=fmt == "savedmodel")
    result = _transform(args, loaded, where, progress)
    progress.note("checking the result")
    from replicate.graph.registry import check_message_size

    check_message_size(result.meta_graph_def, args.output)
    _check_consistent(result.meta_graph_def, args.output)
    graph = _imported(result.graph_def, args.output)
    staging = _stage_events(graph, args.tensorboard) if args.tensorboard else None
    progress.note(f"writing {args.output}")
    try:
        io.save(result.meta_graph_def, args.output, fmt, force=args.force, source=loaded)
    except BaseException:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if staging:
        progress.note(f"writing the graph to {args.tensorboard}")
        outputs.commit_directory(staging, args.tensorboard, option="--tensorboard")
    progress.done("done")
    if not args.quiet:
        print(result.report)
        dropped = " (collections and saver dropped: a GraphDef has none)" if (
            fmt in ("pb", "pbtxt") and loaded.meta is not None) else ""
        print(f"wrote {args.output} ({fmt}, {count(len(devices), 'tower')}){dropped}")
    if result.report.check.get("contradicted"):
        return 1            # written, but the numbers contradict the analysis: the report says where
    return 0


def _between_targets(args: argparse.Namespace) -> dict:
    """transform() keyword arguments of ``--between-graph`` (devices inside each worker)."""
    from replicate.cli.commands._cluster_args import cluster_value
    from replicate.cli.commands._common import strategy_options

    options = strategy_options(args)
    cluster = cluster_value(args)
    if cluster is None:
        raise ReplicateError("--between-graph needs --cluster (a cluster file or TF_CONFIG)")
    return {"devices": (args.devices or "worker").split(","), "controller": args.controller, "cluster": cluster,
            "between_graph": True, "task_index": args.task_index,
            "sparse_on_ps": args.sparse_on_ps, **options}


def _transform(args: argparse.Namespace, loaded, where: dict, progress):
    """Run the transform on the loaded graph; errors name IN."""
    from replicate.api import transform

    source = loaded.meta if loaded.meta is not None else loaded.graph_def
    train_op = train_op_hint(args.train_op, loaded.meta)
    try:
        return transform(source, train_op=train_op,
                         loss=args.loss, outputs=name_list(args.outputs),
                         verify_each=args.verify_each, dump_dir=args.dump_dir, progress=progress,
                         check=args.check, **where)
    except ReplicateError as exc:
        raise relabel(exc, args.input) from None


def _check_consistent(meta_graph_def, output: str) -> None:
    """Refuse to write a MetaGraphDef whose collections name nodes it lacks."""
    from replicate.graph import meta

    problems = meta.dangling(meta_graph_def)
    if problems:
        raise OutputError(f"{output}: not written: the rewritten graph's {problems[0]}"
                          + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


def _imported(graph_def, output: str):
    """The rewritten graph in a new tf.Graph; OutputError if TensorFlow rejects it (a bug in
    a pass, not the user's: shapes or attributes that no longer agree)."""
    import tensorflow as tf

    graph = tf.Graph()
    try:
        with graph.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
    except (ValueError, TypeError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise OutputError(f"{output}: not written: TensorFlow cannot import the rewritten graph "
                          f"({first[:300]}); please report this with the input") from None
    return graph


def _stage_events(graph, logdir: str) -> str:
    """An event file holding exactly the rewritten graph (TensorBoard's Graphs tab), in a
    staging directory that :func:`replicate.graph.outputs.commit_directory` later renames into
    ``logdir`` (created if absent; its parent must exist), like every output."""
    import tensorflow as tf

    staging = outputs.new_staging_directory(logdir, "--tensorboard")
    try:
        with graph.as_default():
            writer = tf.compat.v1.summary.FileWriter(staging, graph=graph)
            writer.flush()
            writer.close()
    except (OSError, ValueError, tf.errors.OpError) as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise OutputError(f"--tensorboard {logdir}: cannot write ({exc})") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("staged the graph for TensorBoard in %s", staging)
    return staging
