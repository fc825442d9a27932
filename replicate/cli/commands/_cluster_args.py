"""``--cluster`` for the subcommands that transform (convert, inspect).

With ``--cluster SPEC`` (a ClusterSpec-style JSON file, or ``TF_CONFIG`` for the environment
variable), ``--devices`` and ``--controller`` may name the cluster's jobs and tasks::

    replicate convert model.meta -o out.meta --cluster cluster.json --devices worker --controller ps

``worker`` stands for every worker task; ``ps`` with several ps tasks spreads the variables
over them by size; ``/job:worker/task:1/device:GPU:0`` names one device; a device without a
job is on the master task. Every job and task named is checked against the cluster.
"""

from __future__ import annotations

import argparse
import logging

from replicate.errors import DeviceError, InputError, ReplicateError

__all__ = ["add_cluster_arguments", "cluster_value", "resolve_devices", "default_devices"]

log = logging.getLogger(__name__)


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """``--cluster SPEC``."""
    parser.add_argument(
        "--cluster", metavar="SPEC",
        help="a TensorFlow cluster: a ClusterSpec JSON file ({\"ps\": [...], \"worker\": [...]}, "
             "or TF_CONFIG-style with a \"cluster\" field) or TF_CONFIG for the environment "
             "variable; --devices and --controller may then name its jobs and tasks, e.g. "
             "--devices worker --controller ps")


def cluster_value(args: argparse.Namespace):
    """The cluster ``--cluster`` names, read and checked, or None without the option.

    Returns:
        A :class:`replicate.runtime.cluster.Cluster`: pass it as ``transform(..., cluster=...)``.

    Raises:
        InputError: the file or variable cannot be read or is not a cluster (the message
            starts with ``--cluster``).
    """
    spec = getattr(args, "cluster", None)
    if spec is None:
        return None
    from replicate.runtime.cluster import load

    try:
        return load(spec)
    except InputError as exc:
        raise InputError(f"--cluster {spec}: {exc}" if not str(exc).startswith(spec)
                         else f"--cluster {exc}") from None


def default_devices(cluster) -> str:
    """Tower devices to assume when ``--devices`` is not given: every task of the master's job."""
    return cluster.master_task()[0]


def resolve_devices(cluster, devices: str, controller: str
                    ) -> tuple[list[str], str, list[str] | None]:
    """``--devices`` and ``--controller`` resolved against ``cluster``.

    Returns:
        (tower devices, controller, parameter devices or None): canonical strings to pass to
        ``replicate.transform`` with ``param_devices=`` and ``cluster=``.

    Raises:
        DeviceError: a device is malformed or names a job or task the cluster lacks (the
            message names the option).
    """
    from replicate.runtime.cluster import resolve

    if "," in controller:
        raise DeviceError(f"--controller '{controller}': give one device or one job")
    try:
        return resolve(cluster, devices, controller)
    except ReplicateError as exc:
        text = str(exc)
        option = "--controller" if text.startswith("controller") else "--devices"
        raise DeviceError(f"{option}: {text}") from None
