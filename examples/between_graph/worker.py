"""One worker of a between-graph job: its own server and its own client, its own data.

    python worker.py --cluster cluster.json --task 1 --template model_between.meta \
        --steps 5 --batch 16 --out final_1.npz [--checkpoint-dir DIR --save-steps 2]

The worker starts this task's ``tf.distribute.Server`` (``replicate.runtime.task_server.start_server``:
on 127.0.0.1 only for loopback addresses; collective group leader: worker 0, as
``replicate.between.server_config`` says), waits for every task of the cluster (a clear error
after ``--wait`` seconds instead of a hang), imports the template pinned to its task
(``replicate.between.import_meta_graph``) and trains with ``MonitoredTrainingSession``: the
chief (task 0) initializes or restores and saves checkpoints; every worker starts from the
chief's values (the template's ``local_init_op`` broadcasts them). Each worker feeds its *own*
batches: batch ``s`` of task ``t`` is ``local_batch(t, s)``, chosen by the global step
(``replicate.runtime.step_feeder.StepFeeder``), so a restarted job replays exactly the batches of the
steps it lost. At the end it writes its variables to ``--out``.

Losing a task: from the moment its session exists, each worker watches the tasks it depends on
(``replicate.runtime.recovery.peer_watch_hook``: the chief watches every worker and ps task, the
others watch the chief and every ps task). When one dies or restarts, or a step fails, the
survivors re-execute themselves in place (same pid and port, a new TensorFlow runtime:
TensorFlow's collectives refuse a restarted member otherwise) and wait for every task again
(announcing the wait, at most ``--wait`` seconds, then exit 75); so after a crash only the lost
task needs starting again, and the job resumes from the chief's last checkpoint.
``--on-peer-failure exit`` exits with status 75 and the reason instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

from replicate.between import import_meta_graph, server_config, wait_for_cluster  # noqa: E402
from replicate.errors import ReplicateError  # noqa: E402
from replicate.runtime.cluster import load  # noqa: E402
from replicate.runtime.recovery import EXIT_CODE, error_reason, peer_watch_hook, recover  # noqa: E402
from replicate.runtime.step_feeder import StepFeeder  # noqa: E402
from replicate.runtime.task_server import start_server  # noqa: E402

v1 = tf.compat.v1


def local_batch(kind: str, task: int, step: int, size: int) -> dict:
    """Task ``task``'s batch of step ``step`` (deterministic; size may differ per task)."""
    rng = np.random.RandomState(1000 * step + task)
    if kind == "embedding":
        return {"ids:0": rng.randint(0, 1000, size=(size, 4)).astype(np.int64),
                "y:0": rng.randint(0, 10, size=size).astype(np.int64)}
    from replicate.demo.data import synthetic

    data = synthetic(512, seed=3)
    idx = rng.randint(0, len(data), size=size)
    return {"x:0": data.images[idx], "y:0": data.labels[idx]}


class Feeder(StepFeeder):
    """replicate's StepFeeder for this task's batches, saying where each session begins."""

    def __init__(self, kind: str, task: int, size: int, last: int, on_step=None, delay: float = 0):
        super().__init__(lambda step: local_batch(kind, task, step, size), last, on_step)
        self.task, self.delay = task, delay

    def after_create_session(self, session, coord) -> None:
        super().after_create_session(session, coord)
        print(f"worker {self.task}: session at global step {self.step}", flush=True)

    def after_run(self, run_context, run_values) -> None:
        super().after_run(run_context, run_values)
        if self.delay:
            time.sleep(self.delay)


class Values(v1.train.SessionRunHook):
    """Fetches every global variable when the session ends."""

    def begin(self) -> None:
        self.variables = v1.global_variables()
        self.values = {}

    def end(self, session) -> None:
        values = session.run(self.variables)
        self.values = {v.op.name: np.asarray(x) for v, x in zip(self.variables, values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--task", type=int, required=True)
    parser.add_argument("--template", required=True)
    parser.add_argument("--kind", choices=("cnn", "embedding"), default="cnn")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", default="16", help="local batch size (or sizes, comma-separated, "
                                                      "one per task)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--save-steps", type=int, default=None)
    parser.add_argument("--wait", type=float, default=60.0,
                        help="seconds to wait for every task to come up")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--die-after", type=int, default=None,
                        help="(fault drills) exit abruptly after this many local steps")
    parser.add_argument("--on-peer-failure", choices=("restart", "exit"), default="restart",
                        help="when another worker dies or restarts, or a step fails: re-execute "
                             "this worker (resume from the chief's last checkpoint) or exit 75")
    parser.add_argument("--max-restarts", type=int, default=10)
    parser.add_argument("--watch-interval", type=float, default=0.2,
                        help="seconds between two looks at the tasks this worker depends on")
    parser.add_argument("--close-timeout", type=float, default=30.0,
                        help="seconds closing the session may take before this worker restarts "
                             "or exits (closing waits for every task the session uses)")
    parser.add_argument("--create-timeout", type=float, default=600.0,
                        help="seconds creating the session may take (a worker other than the "
                             "chief waits there for the chief to initialize or restore)")
    parser.add_argument("--reset-after", type=int, default=100,
                        help="healthy steps after which the restart count goes back to 0")
    parser.add_argument("--step-delay", type=float, default=0.0,
                        help="(fault drills) seconds to sleep after every step")
    parser.add_argument("--step-timeout", type=float, default=600.0,
                        help="seconds any one session run may take (0: no limit); the last "
                             "resort for hangs the watch cannot see, e.g. a peer lost while the "
                             "session is being created, or alive but stuck")
    args = parser.parse_args(argv)
    tf.compat.v1.disable_eager_execution()
    cluster = load(args.cluster)
    sizes = [int(b) for b in args.batch.split(",")]
    size = sizes[args.task % len(sizes)]
    config = server_config(cluster, threads=args.threads)
    # Kept on 127.0.0.1 when the cluster says so (re-executes once to preload the bind shim).
    server = start_server(cluster, "worker", args.task, config=config)

    def failed(message: str) -> None:
        recover(message, restart=args.on_peer_failure == "restart", limit=args.max_restarts)

    try:
        wait_for_cluster(cluster, timeout=args.wait)
    except ReplicateError as exc:
        print(f"{exc}; exiting with status {EXIT_CODE}", file=sys.stderr, flush=True)
        return EXIT_CODE
    watch = peer_watch_hook(cluster, args.task, failed, interval=args.watch_interval,
                            close_timeout=args.close_timeout, reset_after=args.reset_after,
                            create_timeout=args.create_timeout)
    graph = tf.Graph()
    with graph.as_default():
        import_meta_graph(args.template, task_index=args.task)
        train_op = graph.get_operation_by_name("train")
        values = Values()

        def die(step: int) -> None:
            if args.die_after is not None and step >= args.die_after:
                print(f"worker {args.task}: dying after step {step}", flush=True)
                os._exit(9)

        feeder = Feeder(args.kind, args.task, size, args.steps, die, args.step_delay)
        hooks = [feeder, values, watch]
        try:
            train(args, server, config, hooks, train_op)
        except tf.errors.OpError as exc:
            failed(f"between-graph: worker {args.task}: a step failed ({type(exc).__name__}: "
                   f"{error_reason(exc)})")
    np.savez(args.out, **{k.replace("/", "|"): v for k, v in values.values.items()})
    print(f"worker {args.task}: done, global step {int(values.values.get('global_step', -1))}",
          flush=True)
    return 0


def train(args, server, config, hooks, train_op) -> None:
    """The training loop of ``MonitoredTrainingSession`` (chief: task 0)."""
    session_config = v1.ConfigProto()
    session_config.CopyFrom(config)
    # A timed-out run is cancelled by the session: unlike CollectiveReduceV2's timeout_seconds,
    # that does not poison the server's collectives (measured), and the step fails clearly.
    session_config.operation_timeout_in_ms = int(args.step_timeout * 1000)
    with v1.train.MonitoredTrainingSession(
            master=server.target, is_chief=args.task == 0, checkpoint_dir=args.checkpoint_dir,
            save_checkpoint_steps=args.save_steps if args.checkpoint_dir else None,
            save_checkpoint_secs=None, save_summaries_steps=None, save_summaries_secs=None,
            log_step_count_steps=None, hooks=hooks, config=session_config) as sess:
        while not sess.should_stop():
            sess.run(train_op)


if __name__ == "__main__":
    sys.exit(main())
