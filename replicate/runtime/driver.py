"""A small between-graph driver: one client per worker, for tests, examples and benchmarks.

:func:`run_worker` is what each worker's own client does (import the template for its task,
chief initializes, everyone takes the chief's values, train on local batches);
:func:`train_threads` runs one such client per worker in threads of this process (each with
its own graph and session on its own worker's server), and :func:`train_single` trains the
original graph on one device from the same initial values on the concatenated batches.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["run_worker", "train_threads", "train_single", "largest_difference", "variable_values"]


def variable_values(session, graph) -> dict[str, np.ndarray]:
    """Every global variable's value by variable name (the original names)."""
    import tensorflow as tf

    with graph.as_default():
        variables = tf.compat.v1.global_variables()
    values = session.run([v.value() if hasattr(v, "value") else v for v in variables])
    return {v.op.name: np.asarray(x) for v, x in zip(variables, values)}


def run_worker(template, task_index: int, target: str, feeds: Sequence[dict], train_op: str,
               config=None, fetch: Sequence[str] = (), initial: dict | None = None,
               timeout_ms: int = 120_000, after=None) -> dict[str, Any]:
    """One worker's client: returns ``{"initial": values, "final": values, "fetched": [...]}``."""
    import tensorflow as tf

    from replicate.runtime.between import CHIEF, import_meta_graph

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        import_meta_graph(template, task_index)
        init = v1.global_variables_initializer()
        local_init = graph.get_collection(v1.GraphKeys.LOCAL_INIT_OP)[0]
    options = v1.RunOptions(timeout_in_ms=timeout_ms)
    config = config or v1.ConfigProto()
    with v1.Session(target, graph=graph, config=config) as sess:
        if task_index == CHIEF:
            sess.run(init, options=options)
            if initial:
                with graph.as_default():
                    for v in v1.global_variables():
                        if v.op.name in initial:
                            v.load(initial[v.op.name], sess)
        sess.run(local_init, options=options)
        start = variable_values(sess, graph)
        fetched = []
        for feed in feeds:
            out = sess.run([train_op] + list(fetch), feed, options=options)
            fetched.append(out[1:])
        final = variable_values(sess, graph)
        if after is not None:
            after(sess, graph)
    return {"initial": start, "final": final, "fetched": fetched}


def train_threads(template, targets: Sequence[str], feeds: Sequence[Sequence[dict]], train_op: str,
                  after: dict | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    """Run :func:`run_worker` for every worker in its own thread; ``feeds[i]`` are worker ``i``'s
    local batches. Re-raises the first worker's error."""
    results: list[Any] = [None] * len(targets)
    errors: list[BaseException | None] = [None] * len(targets)

    def work(i: int) -> None:
        try:
            results[i] = run_worker(template, i, targets[i], feeds[i], train_op,
                                    after=(after or {}).get(i), **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors[i] = exc

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in errors:
        if exc is not None:
            raise exc
    return results


def concat_feeds(per_worker: Sequence[Sequence[dict]]) -> list[dict]:
    """Step ``s``'s global batch: the workers' step-``s`` batches concatenated in task order."""
    out = []
    for step in zip(*per_worker):
        out.append({k: np.concatenate([f[k] for f in step]) for k in step[0]})
    return out


def train_single(graph_or_meta, train_op: str, initial: dict[str, np.ndarray],
                 feeds: Sequence[dict]) -> dict[str, np.ndarray]:
    """Train the single-device graph from ``initial`` on ``feeds``; final variable values."""
    import tensorflow as tf

    v1 = tf.compat.v1
    if isinstance(graph_or_meta, tf.Graph):
        from replicate.graph.io import export_graph

        meta = export_graph(graph_or_meta, clear_devices=True)
    else:
        meta = graph_or_meta
    graph = tf.Graph()
    with graph.as_default():
        from tensorflow.python.framework import meta_graph

        meta_graph.import_scoped_meta_graph(meta)
        init = v1.global_variables_initializer()
        variables = v1.global_variables()
    config = v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
    with v1.Session(graph=graph, config=config) as sess:
        sess.run(init)
        for v in variables:
            if v.op.name in initial:
                v.load(initial[v.op.name], sess)
        for feed in feeds:
            sess.run(train_op, feed)
        return variable_values(sess, graph)


def largest_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray],
                       names: Sequence[str] | None = None) -> tuple[float, str]:
    """(largest :func:`~replicate.check.equivalence.relative_difference`, variable name) over the
    variables both hold (or ``names``): ``max |a-b| / max(max |b|, 1e-3)`` per variable, the
    measure of the project's equivalence tests."""
    from replicate.check.equivalence import relative_difference

    worst, where = 0.0, ""
    for name in names or sorted(set(a) & set(b)):
        d = relative_difference(b[name], a[name])
        if d > worst:
            worst, where = d, name
    return worst, where
