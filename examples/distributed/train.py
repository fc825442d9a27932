"""Train the seeds' MNIST CNN over a TensorFlow cluster: 1 ps + 2 workers, in-graph.

The model is the ordinary single-device TF1 graph (``replicate.demo.build_cnn``).
``replicate.transform(..., devices="worker", controller="ps", cluster=...)`` puts one tower on
each worker task and the variables and Adam's update on the ps task; one client session on
the master (worker 0) runs the whole replicated graph. The same global batches train the
single-device graph in this process, from the same initial values; after ``--check-step``
steps every variable must agree within ``--rtol``.

    replicate cluster --ps 1 --workers 2 --json /tmp/cluster.json &
    python examples/distributed/train.py --cluster /tmp/cluster.json --steps 20

``--local`` starts (and stops) the servers itself. ``--checkpoint-dir DIR`` then trains the
same steps again with ``MonitoredTrainingSession``, checkpointing every ``--save-steps``;
the batch of each step is chosen by the global step, so a run that loses a worker and
resumes from the last checkpoint must end where the uninterrupted run did. With ``--local``,
``--kill-at STEP`` kills worker 1 after that step and restarts it, to watch the recovery.
Exit code 0 when everything agrees, 1 when not.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

import tensorflow as tf

import replicate
from replicate.check.equivalence import Trainer, relative_difference
from replicate.demo import FULL_SIZE, SMALL_SIZE, batches, build_cnn, load
from replicate.runtime.step_feeder import StepFeeder

__all__ = ["make_feeds", "train_single", "train_in_graph", "StepFeeder", "train_monitored",
           "checkpoint_steps", "checkpoint_values", "largest_difference", "kill_and_restart",
           "once_at", "main", "SIZES"]

log = logging.getLogger(__name__)
v1 = tf.compat.v1

#: A resumed run replays the same ops on the same values as an uninterrupted one.
RESUME_RTOL = 1e-6

#: CNN sizes (conv1 filters, conv2 filters, dense units) by name.
SIZES = {"full": FULL_SIZE, "small": SMALL_SIZE, "tiny": (4, 8, 32)}


def make_feeds(model, batch: int, steps: int, data_source: str = "auto", seed: int = 0
               ) -> list[dict]:
    """One feed dict per global step (the same batches for every training)."""
    data = load(source=data_source)
    log.info("data: %s", data.source)
    return [{model.images: x, model.labels: y} for x, y in batches(data, batch, steps, seed)]


def train_single(model, feeds: list[dict], keep: tuple[int, ...] = (),
                 fetch: str = "loss:0") -> tuple[dict[int, dict], list[float]]:
    """Single-device training in this process.

    Returns:
        (variable values by step: 0 (initial), each step in ``keep`` and ``len(feeds)``;
        the loss of every step).
    """
    trainer = Trainer(model.graph, model.train_op, cpus=1)
    try:
        values, losses = {0: trainer.values()}, []
        for step, feed in enumerate(feeds, 1):
            losses.append(float(trainer.step(feed, [fetch])[0]))
            if step in keep or step == len(feeds):
                values[step] = trainer.values()
        return values, losses
    finally:
        trainer.close()


def train_in_graph(result, master: str, feeds: list[dict], initial: dict,
                   keep: tuple[int, ...] = (), fetch: str = "loss:0"
                   ) -> tuple[dict[int, dict], list[float]]:
    """Train the replicated graph with one client session on ``master``, from ``initial``.

    Returns:
        (variable values by step as in :func:`train_single`, the loss of every step).
    """
    graph = tf.Graph()
    with graph.as_default():
        v1.train.import_meta_graph(result.meta_graph_def, clear_devices=False)
        variables = {v.op.name: v for v in v1.global_variables()}
        init = v1.global_variables_initializer()
    values, losses = {0: dict(initial)}, []
    with v1.Session(master, graph=graph) as sess:
        sess.run(init)
        for name, value in initial.items():
            variables[name].load(value, sess)
        for step, feed in enumerate(feeds, 1):
            losses.append(float(sess.run([result.analysis.train_op, fetch], feed)[1]))
            if step in keep or step == len(feeds):
                values[step] = dict(zip(variables, sess.run(list(variables.values()))))
    return values, losses


def train_monitored(result, master: str, feeds: list[dict], checkpoint_dir: str,
                    save_steps: int, on_step=None) -> StepFeeder:
    """Train to ``len(feeds)`` global steps with MonitoredTrainingSession on ``master``.

    Checkpoints go to ``checkpoint_dir`` every ``save_steps`` steps (and at start and end).
    An AbortedError or UnavailableError (a lost worker or ps) makes the session recreate
    itself and restore the last checkpoint; training then continues from its step.
    """
    graph = tf.Graph()
    with graph.as_default():
        v1.train.import_meta_graph(result.meta_graph_def, clear_devices=False)
        train_op = graph.get_operation_by_name(result.analysis.train_op)
        feeder = StepFeeder(lambda step: feeds[step], on_step=on_step)
        hooks = [feeder, v1.train.StopAtStepHook(last_step=len(feeds))]
        with v1.train.MonitoredTrainingSession(
                master=master, is_chief=True, checkpoint_dir=checkpoint_dir, hooks=hooks,
                save_checkpoint_steps=save_steps, save_checkpoint_secs=None,
                save_summaries_steps=None, save_summaries_secs=None,
                log_step_count_steps=None) as sess:
            while not sess.should_stop() and feeder.step < len(feeds):
                sess.run(train_op)
    return feeder


def checkpoint_steps(checkpoint_dir: str) -> list[int]:
    """Global step of every checkpoint the directory lists, each read back in full.

    Raises:
        ValueError: no checkpoint, a listed checkpoint is missing or unreadable, its
            global step disagrees with its name, or the steps are not increasing.
    """
    state = tf.train.get_checkpoint_state(checkpoint_dir)
    if state is None or not state.all_model_checkpoint_paths:
        raise ValueError(f"{checkpoint_dir}: no checkpoint")
    steps = []
    for path in state.all_model_checkpoint_paths:
        reader = tf.train.load_checkpoint(path)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
        step = int(reader.get_tensor("global_step"))
        if not path.endswith(f"-{step}"):
            raise ValueError(f"{path}: holds global step {step}")
        steps.append(step)
    if steps != sorted(set(steps)):
        raise ValueError(f"{checkpoint_dir}: checkpoint steps {steps} are not increasing")
    return steps


def largest_difference(a: dict, b: dict) -> tuple[float, str]:
    """(largest relative difference, variable name) over the variables of ``a``."""
    diffs = {n: relative_difference(a[n], b[n]) for n in a}
    worst = max(diffs, key=diffs.get)
    return diffs[worst], worst


def kill_and_restart(local, job: str = "worker", task: int = 1) -> threading.Thread:
    """SIGKILL one task of a LocalCluster and start it again on its port, in the background."""
    local.kill(job, task)
    print(f"killed {job}:{task}; restarting it on {local.cluster.address(job, task)}", flush=True)
    thread = threading.Thread(target=local.restart, args=(job, task), name="restart", daemon=True)
    thread.start()
    return thread


def once_at(step: int, action):
    """An ``on_step`` callback running ``action()`` the first time ``step`` is reached (a
    resumed run passes the same steps again)."""
    done: list[object] = []

    def on_step(current: int) -> None:
        if current == step and not done:
            done.append(action())
    on_step.done = done
    return on_step


def checkpoint_values(checkpoint_dir: str) -> dict:
    """Every variable of the newest checkpoint in ``checkpoint_dir``."""
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(checkpoint_dir))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--cluster", help="ClusterSpec JSON file (from `replicate cluster --json`) "
                                         "or TF_CONFIG; needs jobs 'ps' and 'worker'")
    where.add_argument("--local", action="store_true",
                       help="start 1 ps + 2 workers on loopback for the run, then stop them")
    parser.add_argument("--steps", type=int, default=20, help="global steps (default 20)")
    parser.add_argument("--batch", type=int, default=32, help="global batch (default 32)")
    parser.add_argument("--size", choices=sorted(SIZES), default="full",
                        help="full: the seeds' 32/64 filters and 1024 dense units (default); "
                             "small: 16/32/256; tiny: 4/8/32, for tests")
    parser.add_argument("--data", choices=("auto", "mnist", "digits", "synthetic"), default="auto")
    parser.add_argument("--check-step", type=int, default=3,
                        help="compare with single-device training after this step (default 3)")
    parser.add_argument("--rtol", type=float, default=1e-4,
                        help="largest relative difference allowed there (default 1e-4: the "
                             "full CNN's Adam update on 2 x 16 examples differs by ~1e-5 from "
                             "one device's on 32 by float rounding alone, in one process as "
                             "on a cluster)")
    parser.add_argument("--checkpoint-dir", help="also train with MonitoredTrainingSession, "
                                                 "checkpointing here (resumes what it finds)")
    parser.add_argument("--save-steps", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--kill-at", type=int, metavar="STEP",
                        help="with --local --checkpoint-dir: kill worker 1 after STEP, restart it")
    return parser


def _verdict(label: str, a: dict, b: dict, rtol: float) -> bool:
    diff, worst = largest_difference(a, b)
    ok = diff <= rtol
    print(f"{label}: largest relative difference {diff:.2g} ({worst}): "
          f"{'agree' if ok else 'DIFFER'} (rtol {rtol:g})")
    return ok


def main(argv: list[str] | None = None) -> int:
    """Train on the cluster and on one device; print and return whether they agree."""
    from replicate.runtime.cluster import load as load_cluster
    from replicate.runtime.cluster_server import LocalCluster

    args = _parser().parse_args(argv)
    if args.kill_at is not None and not (args.local and args.checkpoint_dir):
        raise SystemExit("--kill-at needs --local and --checkpoint-dir")
    if not 1 <= args.check_step <= args.steps:
        raise SystemExit("--check-step must be between 1 and --steps")
    v1.disable_eager_execution()
    model = build_cnn(SIZES[args.size])
    feeds = make_feeds(model, args.batch, args.steps, args.data)
    single, single_losses = train_single(model, feeds, keep=(args.check_step,))
    local = LocalCluster(1, 2) if args.local else None
    try:
        cluster = local.start().cluster if local else load_cluster(args.cluster)
        print(f"cluster: {cluster.describe()}  (master {cluster.master()})")
        res = replicate.transform(model.graph, "worker", controller="ps", cluster=cluster)
        print(f"towers on {', '.join(res.report.devices)}; variables on {res.report.controller}")
        multi, losses = train_in_graph(res, cluster.master(), feeds, single[0],
                                       keep=(args.check_step,))
        print(f"loss over {len(losses)} steps: one device {single_losses[0]:.4f} -> "
              f"{single_losses[-1]:.4f}, in-graph on the cluster {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}")
        ok = _verdict(f"step {args.check_step} vs one device", single[args.check_step],
                      multi[args.check_step], args.rtol)
        largest, _ = largest_difference(single[args.steps], multi[args.steps])
        print(f"step {args.steps} vs one device: {largest:.2g} (float rounding drifts with "
              "steps; `replicate demo` measures how much)")
        if args.checkpoint_dir:
            on_step = None
            if args.kill_at is not None:
                on_step = once_at(args.kill_at, lambda: kill_and_restart(local))
            feeder = train_monitored(res, cluster.master(), feeds, args.checkpoint_dir,
                                     args.save_steps, on_step)
            print(f"MonitoredTrainingSession: sessions began at global steps {feeder.starts}; "
                  f"checkpoints at steps {checkpoint_steps(args.checkpoint_dir)}")
            ok &= _verdict("its last checkpoint vs the uninterrupted run",
                           multi[args.steps], checkpoint_values(args.checkpoint_dir), RESUME_RTOL)
    finally:
        if local is not None:
            local.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
