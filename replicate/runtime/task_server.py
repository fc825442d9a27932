"""Start this process's own TensorFlow server for a task, kept on loopback when its address is.

A between-graph driver runs its worker's ``tf.distribute.Server`` in its own process. TensorFlow's
gRPC server listens on every interface (``0.0.0.0``) whatever address the cluster gives the task,
and executes any graph it is sent. :func:`start_server` is what a driver calls instead of
``tf.distribute.Server(...)``: when the task's address is a loopback one (``127.0.0.1``,
``localhost``) it makes sure replicate's bind shim (see :mod:`replicate.runtime.cluster_server`) is
preloaded, re-executing the process's own command line once with ``LD_PRELOAD`` set if it is not,
then starts the server and refuses to go on if anything listens beyond loopback. Call it early:
everything the script did before runs again after that one re-execution (as it does when
:mod:`replicate.runtime.recovery` restarts a worker).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from replicate.errors import ReplicateError

__all__ = ["start_server", "shim_loaded"]

log = logging.getLogger(__name__)


def shim_loaded(shim: str) -> bool:
    """True when the shared library ``shim`` is mapped into this process."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return any(line.rstrip().endswith(shim) for line in f)
    except OSError:
        return False


def _reexec_with(shim: str) -> None:
    from replicate.runtime.cluster_server import _SHIM_ENV

    if os.environ.get(_SHIM_ENV) == shim:
        raise ReplicateError(f"the loopback shim {shim} is in LD_PRELOAD but was not loaded "
                             "(a set-uid interpreter?); pass bind_all=True to accept "
                             "TensorFlow's listening on every interface")
    env = dict(os.environ, **{_SHIM_ENV: shim})
    env["LD_PRELOAD"] = " ".join(p for p in (shim, env.get("LD_PRELOAD", "")) if p)
    args = [sys.executable] + list(getattr(sys, "orig_argv", [None] + sys.argv)[1:])
    log.info("re-executing %s with the loopback shim preloaded", " ".join(args))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, args, env)


def start_server(cluster: Any, job: str = "worker", task: int = 0, config=None,
                 bind_all: bool = False):
    """Start and return the ``tf.distribute.Server`` of ``job:task`` in this process.

    Args:
        cluster: anything :func:`replicate.runtime.cluster.load` reads.
        job: the task's job.
        task: the task's index.
        config: the server's ``ConfigProto`` (for between-graph jobs
            :func:`replicate.runtime.between.server_config`).
        bind_all: accept TensorFlow's listening on every interface (for addresses other
            machines reach; on a trusted network only).

    Raises:
        ReplicateError: the shim cannot be built or loaded, or the server listens beyond
            loopback.
    """
    from replicate.runtime.cluster import load
    from replicate.runtime.cluster_server import (
        _loopback_only,
        is_loopback_host,
        listening_addresses,
        shim_path,
    )

    spec = load(cluster)
    address = spec.address(job, task)
    host, port = address.rsplit(":", 1)
    loopback = not bind_all and is_loopback_host(host)
    if loopback:
        shim = shim_path()
        if not shim_loaded(shim):
            _reexec_with(shim)                                   # does not return
    import tensorflow as tf

    server = tf.distribute.Server(spec.cluster_spec(), job_name=job, task_index=task,
                                  config=config, start=True)
    if loopback:
        seen = listening_addresses(int(port))
        if not _loopback_only(seen):
            where = ", ".join(seen) or "an unknown address"
            raise ReplicateError(f"{job}:{task} listens on {where}, not only on loopback")
    log.info("%s:%d serving on %s", job, task, address)
    return server
