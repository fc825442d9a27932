"""Which devices can run an op: TensorFlow's registered kernels, by device type and dtype.

Used to keep a drop-in driver working without ``allow_soft_placement``: a tower op with no
kernel for the tower's device type (a string op on a GPU tower, say) goes to the same task's
CPU instead, as soft placement would have done.
"""

from __future__ import annotations

import functools
import logging

import tensorflow as tf
from tensorflow.python.framework import kernels

__all__ = ["has_kernel", "host_of", "runnable_on"]

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _kernels(op_type: str) -> tuple:
    """Registered kernels of ``op_type`` (none for library functions and unknown ops)."""
    return tuple(kernels.get_registered_kernels_for_op(op_type).kernel)


def has_kernel(op_type: str, device_type: str, attrs: dict) -> bool:
    """True when some kernel of ``op_type`` runs on ``device_type`` for these type attrs.

    Ops with no registered kernels at all (library functions, unknown ops) count as runnable:
    the function's own ops are placed by TensorFlow.
    """
    names = _constraint_names(op_type)
    key = tuple(attrs[n].SerializeToString(deterministic=True) if n in attrs else b"" for n in names)
    return _has_kernel(op_type, device_type, key)


@functools.lru_cache(maxsize=None)
def _constraint_names(op_type: str) -> tuple[str, ...]:
    return tuple(sorted({c.name for k in _kernels(op_type) for c in k.constraint}))


@functools.lru_cache(maxsize=None)
def _has_kernel(op_type: str, device_type: str, key: tuple) -> bool:
    from tensorflow.core.framework import attr_value_pb2

    attrs = {}
    for name, raw in zip(_constraint_names(op_type), key):
        if raw:
            attrs[name] = attr_value_pb2.AttrValue.FromString(raw)
    registered = _kernels(op_type)
    if not registered:
        return True
    for kernel in registered:
        if kernel.device_type not in (device_type, "DEFAULT"):
            continue
        if all(_allowed(c, attrs) for c in kernel.constraint):
            return True
    return False


def _allowed(constraint, attrs: dict) -> bool:
    value = attrs.get(constraint.name)
    allowed = constraint.allowed_values.list.type
    if value is None or not allowed:
        return True
    kind = value.WhichOneof("value")
    if kind == "type":
        return value.type in allowed
    if kind == "list":
        return all(t in allowed for t in value.list.type)
    return True


def host_of(device: str) -> str:
    """The CPU of the same job and task as ``device`` (``/device:CPU:0`` locally)."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()


def runnable_on(op_type: str, attrs: dict, device: str) -> str:
    """``device`` when it has a kernel for the op, else the CPU of the same task."""
    kind = tf.DeviceSpec.from_string(device).device_type or "CPU"
    return device if has_kernel(op_type, kind, attrs) else host_of(device)
