"""One task of a TensorFlow cluster in its own process, kept on the loopback interface.

``python -m replicate.runtime.cluster_server --cluster SPEC --job worker --task 1`` starts a
``tf.distribute.Server`` for that task, prints ``ready JOB:TASK ADDRESS`` on stdout, and
serves until it is terminated (or, with ``--parent PID``, until that process is gone).
:class:`LocalCluster` (and ``replicate cluster``) starts one per task of a cluster on this
machine, on free loopback ports, and stops them all.

TensorFlow's gRPC server always listens on every interface (``0.0.0.0``), whatever host the
cluster gives the task. When the task's own address is a loopback address (``127.0.0.1``,
``localhost``), this module keeps the server off every other interface: it preloads a tiny
shim (C, built once with ``cc`` and cached) that rewrites wildcard binds to ``127.0.0.1``, and
checks ``/proc/net/tcp*`` after start-up that nothing listens on a wildcard address. Linux only;
``--bind-all`` accepts TensorFlow's default instead (needed for addresses other machines reach).
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from replicate.errors import ReplicateError

__all__ = ["LocalCluster", "main", "shim_path", "is_loopback_host", "listening_addresses",
           "serve", "READY", "EXIT_BIND", "EXIT_SHIM", "EXIT_EXPOSED"]

log = logging.getLogger(__name__)

#: First word of the line a task prints once it serves.
READY = "ready"
#: Exit codes: the port could not be bound; no loopback shim; listening beyond loopback.
EXIT_BIND, EXIT_SHIM, EXIT_EXPOSED = 3, 4, 5

_SHIM_ENV = "REPLICATE_LOOPBACK_SHIM"

_SHIM_SOURCE = r"""
/* replicate: rewrite wildcard binds (0.0.0.0, ::) to the loopback interface. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);
int bind(int fd, const struct sockaddr *addr, socklen_t len) {
  static bind_fn real = 0;
  if (!real) real = (bind_fn)dlsym(RTLD_NEXT, "bind");
  if (addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
    struct sockaddr_in a;
    memcpy(&a, addr, sizeof a);
    if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      return real(fd, (const struct sockaddr *)&a, sizeof a);
    }
  } else if (addr && addr->sa_family == AF_INET6 &&
             len >= (socklen_t)sizeof(struct sockaddr_in6)) {
    struct sockaddr_in6 a;
    memcpy(&a, addr, sizeof a);
    if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
      /* ::ffff:127.0.0.1 on a dual-stack socket: IPv4 loopback clients only. */
      static const unsigned char mapped[16] = {0, 0, 0, 0, 0, 0, 0, 0,
                                               0, 0, 0xff, 0xff, 127, 0, 0, 1};
      memcpy(&a.sin6_addr, mapped, sizeof mapped);
      return real(fd, (const struct sockaddr *)&a, sizeof a);
    }
  }
  return real(fd, addr, len);
}
"""


def shim_path() -> str:
    """The loopback shim's shared library, built with ``cc`` on first use and cached.

    Raises:
        ReplicateError: not Linux, or no C compiler, or the build failed.
    """
    if not sys.platform.startswith("linux"):
        raise ReplicateError("keeping TensorFlow's server on loopback needs Linux; pass "
                             "--bind-all to let it listen on every interface")
    digest = hashlib.sha256(_SHIM_SOURCE.encode()).hexdigest()[:16]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for directory in (os.path.join(base, "replicate"),
                      os.path.join(tempfile.gettempdir(), f"replicate-{os.getuid()}")):
        path = os.path.join(directory, f"loopback-{digest}.so")
        if os.path.isfile(path) and os.stat(path).st_uid == os.getuid():
            return path
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError:
            continue
        if os.access(directory, os.W_OK) and os.stat(directory).st_uid == os.getuid():
            return _build(path)
    raise ReplicateError("no writable cache directory for the loopback shim")


def _build(path: str) -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise ReplicateError("keeping TensorFlow's server on loopback needs a C compiler (cc) "
                             "to build a small bind shim; install one, or pass --bind-all")
    directory = os.path.dirname(path)
    fd, source = tempfile.mkstemp(suffix=".c", dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write(_SHIM_SOURCE)
    partial = f"{source[:-2]}.so"
    try:
        done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", partial, source, "-ldl"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise ReplicateError(f"building the loopback shim with {compiler} failed: "
                                 f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
        os.replace(partial, path)
    finally:
        for leftover in (source, partial):
            if os.path.exists(leftover):
                os.remove(leftover)
    log.info("built the loopback shim %s", path)
    return path


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _decode(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_address)
    # /proc/net/tcp* prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listening_addresses(port: int) -> list[str]:
    """Local addresses of the TCP sockets listening on ``port`` (from ``/proc/net/tcp*``)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            address, _, hex_port = fields[1].partition(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:
                found.append(str(_decode(address)))
    return found


def _loopback_only(addresses: list[str]) -> bool:
    for text in addresses:
        ip = ipaddress.ip_address(text)
        mapped = getattr(ip, "ipv4_mapped", None)
        if not (ip.is_loopback or (mapped is not None and mapped.is_loopback)):
            return False
    return bool(addresses)


def _watch_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def serve(cluster, job: str, task: int, cpus: int = 1, threads: int = 1,
          loopback: bool = True) -> int:
    """Start the task's server, print the ready line, and serve forever; return an exit code
    only when start-up fails."""
    import tensorflow as tf

    address = cluster.address(job, task)
    config = tf.compat.v1.ConfigProto(device_count={"CPU": cpus})
    leader_job, leader_task = cluster.master_task()
    # Collective all-reduce across tasks (aggregation="allreduce", mirrored variables) needs
    # every server to agree on the task that resolves collective groups.
    config.experimental.collective_group_leader = f"/job:{leader_job}/replica:0/task:{leader_task}"
    if threads:
        config.intra_op_parallelism_threads = threads
        config.inter_op_parallelism_threads = threads
    try:
        server = tf.distribute.Server(cluster.cluster_spec(), job_name=job, task_index=task,
                                      config=config, start=True)
    except (tf.errors.OpError, ValueError) as exc:
        print(f"error: {job}:{task} cannot serve on {address}: {exc}", file=sys.stderr, flush=True)
        return EXIT_BIND
    port = int(address.rsplit(":", 1)[1])
    if loopback:
        seen = listening_addresses(port)
        if not _loopback_only(seen):
            print(f"error: {job}:{task} listens on {', '.join(seen) or 'an unknown address'}, "
                  "not only on loopback; stopping", file=sys.stderr, flush=True)
            return EXIT_EXPOSED
    print(f"{READY} {job}:{task} {address} {server.target}", flush=True)
    while True:
        time.sleep(3600)


class LocalCluster:
    """A cluster of ``tf.distribute.Server`` processes on this machine, one per task.

    Ports are free loopback ports (or ``port_base``, ``port_base + 1``, ... in job order: ps,
    then worker); a start that loses a port to another program is retried on new ports.
    Servers exit with the process that started them. Use as a context manager, or call
    :meth:`start` and :meth:`stop`.

    Args:
        ps: parameter-server tasks (job ``ps``; 0 for none).
        workers: worker tasks (job ``worker``).
        port_base: first port; free ports when None.
        cpus_per_task: logical CPU devices of each task (``/device:CPU:0`` ...).
        threads: intra- and inter-op threads of each task (0: TensorFlow's default).
        bind_all: let servers listen on every interface instead of loopback only.
        timeout: seconds to wait for the servers to come up.
        attempts: start-ups tried on fresh ports before giving up.
        log_dir: where each task's stderr goes (a temporary directory when None).
    """

    def __init__(self, ps: int = 1, workers: int = 2, *, port_base: int | None = None,
                 cpus_per_task: int = 1, threads: int = 1, bind_all: bool = False,
                 timeout: float = 300.0, attempts: int = 3, log_dir: str | None = None):
        if workers < 1 or ps < 0 or cpus_per_task < 1:
            raise ReplicateError("a local cluster needs at least one worker, no negative ps "
                                 "count and at least one CPU per task")
        self.sizes = {job: n for job, n in (("ps", ps), ("worker", workers)) if n}
        self.port_base, self.cpus, self.threads = port_base, cpus_per_task, threads
        self.bind_all, self.timeout, self.attempts = bind_all, timeout, attempts
        self._own_logs = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="replicate-cluster-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.spec_file = os.path.join(self.log_dir, "cluster.json")
        self.cluster = None
        self.procs: dict[tuple[str, int], subprocess.Popen] = {}
        self._shim: str | None = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def tasks(self) -> list[tuple[str, int]]:
        """Every (job, task), ps first."""
        return [(job, i) for job, n in self.sizes.items() for i in range(n)]

    def start(self) -> LocalCluster:
        """Start every task and wait until all serve.

        Raises:
            ReplicateError: a task failed for another reason than a taken port, the ports
                stayed taken for ``attempts`` start-ups, or the servers were not up in time.
        """
        self._shim = None if self.bind_all else shim_path()
        try:
            return self._start()
        except BaseException:
            self.stop(remove_logs=False)
            raise

    def _start(self) -> LocalCluster:
        from replicate.runtime.cluster import Cluster

        for attempt in range(1, self.attempts + 1):
            ports = iter(self._ports())
            self.cluster = Cluster({job: {i: f"127.0.0.1:{next(ports)}" for i in range(n)}
                                    for job, n in self.sizes.items()})
            with open(self.spec_file, "w", encoding="utf-8") as f:
                f.write(self.cluster.to_json() + "\n")
            for job, task in self.tasks:
                self.procs[(job, task)] = self._spawn(job, task)
            failed = self._wait_ready(self.tasks)
            if not failed:
                log.info("local cluster up: %s", self.cluster.describe())
                return self
            self.stop(remove_logs=False)
            clash = all(code == EXIT_BIND for code, _ in failed.values())
            if not clash or self.port_base is not None or attempt == self.attempts:
                (job, task), (code, tail) = next(iter(failed.items()))
                raise ReplicateError(f"{job}:{task} did not start (exit code {code}): {tail}")
            log.info("a port was taken; retrying on new ports (attempt %d)", attempt + 1)
        raise AssertionError("unreachable")

    def _ports(self) -> list[int]:
        count = len(self.tasks)
        if self.port_base is not None:
            return list(range(self.port_base, self.port_base + count))
        import socket

        holders = []
        try:
            for _ in range(count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind(("127.0.0.1", 0))
                holders.append(s)
            return [s.getsockname()[1] for s in holders]
        finally:
            for s in holders:
                s.close()

    def _spawn(self, job: str, task: int) -> subprocess.Popen:
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        if job == "ps":
            env["CUDA_VISIBLE_DEVICES"] = ""
        if self._shim is not None:
            env[_SHIM_ENV] = self._shim
            env["LD_PRELOAD"] = " ".join(p for p in (self._shim, env.get("LD_PRELOAD", "")) if p)
        cmd = [sys.executable, "-m", "replicate.runtime.cluster_server", "--cluster", self.spec_file,
               "--job", job, "--task", str(task), "--cpus", str(self.cpus),
               "--threads", str(self.threads), "--parent", str(os.getpid())]
        if self.bind_all:
            cmd.append("--bind-all")
        with open(self._log(job, task), "ab") as err:
            return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env,
                                    start_new_session=True)

    def _log(self, job: str, task: int) -> str:
        return os.path.join(self.log_dir, f"{job}-{task}.log")

    def _tail(self, job: str, task: int) -> str:
        try:
            with open(self._log(job, task), encoding="utf-8", errors="replace") as f:
                lines = [ln for ln in f.read().splitlines() if ln.strip()]
        except OSError:
            return "no log"
        errors = [ln for ln in lines if ln.startswith("error:")]
        return (errors or lines or ["no output"])[-1][:400]

    def _wait_ready(self, keys: list[tuple[str, int]]) -> dict[tuple[str, int], tuple[int, str]]:
        import selectors

        selector = selectors.DefaultSelector()
        for key in keys:
            selector.register(self.procs[key].stdout, selectors.EVENT_READ, key)
        failed: dict[tuple[str, int], tuple[int, str]] = {}
        pending = set(keys)
        deadline = time.monotonic() + self.timeout
        try:
            while pending and not failed and time.monotonic() < deadline:
                for event, _ in selector.select(timeout=min(1.0, deadline - time.monotonic())):
                    key = event.data
                    line = event.fileobj.readline().decode(errors="replace")
                    if line.startswith(READY):
                        pending.discard(key)
                    elif not line:
                        code = self.procs[key].wait()
                        failed[key] = (code, self._tail(*key))
                        pending.discard(key)
                    if key not in pending:
                        selector.unregister(event.fileobj)
        finally:
            selector.close()
        if pending and not failed:
            names = ", ".join(f"{j}:{t}" for j, t in sorted(pending))
            self.stop(remove_logs=False)
            raise ReplicateError(f"{names} not serving after {self.timeout:.0f} s "
                                 f"(logs in {self.log_dir})")
        return failed

    def poll(self) -> dict[tuple[str, int], int]:
        """Tasks that have exited, with their exit codes (negative: killed by that signal)."""
        return {key: p.returncode for key, p in self.procs.items() if p.poll() is not None}

    def kill(self, job: str, task: int, sig: int = 9) -> None:
        """Send ``sig`` (SIGKILL by default) to one task and wait for it to exit."""
        proc = self.procs[(job, task)]
        if proc.poll() is None:
            os.kill(proc.pid, sig)
        proc.wait(timeout=60)

    def restart(self, job: str, task: int) -> None:
        """Start an exited task again on its port, retrying while the port is still held.

        Raises:
            ReplicateError: the task is running, or would not start.
        """
        old = self.procs[(job, task)]
        if old.poll() is None:
            raise ReplicateError(f"{job}:{task} is running (pid {old.pid})")
        for attempt in range(self.attempts):
            if old.stdout is not None:
                old.stdout.close()
            self.procs[(job, task)] = old = self._spawn(job, task)
            failed = self._wait_ready([(job, task)])
            if not failed:
                return
            code, tail = failed[(job, task)]
            if code != EXIT_BIND or attempt == self.attempts - 1:
                raise ReplicateError(f"{job}:{task} did not restart (exit code {code}): {tail}")
            time.sleep(1.0)

    def stop(self, grace: float = 10.0, remove_logs: bool = True) -> None:
        """Terminate every task (SIGTERM, then SIGKILL after ``grace`` seconds) and wait."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.procs = {}
        if remove_logs and self._own_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m replicate.runtime.cluster_server",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", required=True,
                        help="ClusterSpec JSON file or text, or TF_CONFIG")
    parser.add_argument("--job", required=True, help="this task's job, e.g. worker")
    parser.add_argument("--task", type=int, required=True, help="this task's index")
    parser.add_argument("--cpus", type=int, default=1, help="logical CPU devices (default 1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra- and inter-op threads, 0 for TensorFlow's default (default 1)")
    parser.add_argument("--bind-all", action="store_true",
                        help="listen on every interface, as TensorFlow does by default")
    parser.add_argument("--parent", type=int, help="exit when this process is gone")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Serve one task; exit codes: 2 bad arguments, 3 bind failure, 4 no shim, 5 exposed."""
    from replicate.runtime.cluster import load

    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        cluster = load(args.cluster)
        address = cluster.address(args.job, args.task)
    except (ReplicateError, KeyError) as exc:
        print(f"error: {args.job}:{args.task}: {exc}", file=sys.stderr)
        return 2
    loopback = not args.bind_all and is_loopback_host(address.rsplit(":", 1)[0])
    if loopback and os.environ.get(_SHIM_ENV) is None:
        try:
            shim = shim_path()
        except ReplicateError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_SHIM
        env = dict(os.environ, **{_SHIM_ENV: shim})
        env["LD_PRELOAD"] = " ".join(p for p in (shim, env.get("LD_PRELOAD", "")) if p)
        os.execve(sys.executable, [sys.executable, "-m", "replicate.runtime.cluster_server", *argv], env)
    if args.parent:
        _watch_parent(args.parent)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return serve(cluster, args.job, args.task, args.cpus, args.threads, loopback)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
