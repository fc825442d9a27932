"""The options of a transform: one frozen record, validated once, passed through the pipeline.

``replicate.transform(graph, devices, **options)`` builds an :class:`Options` from its keyword
arguments (or takes one as ``options=``); the rewrite, the numeric certificate and
``replicate verify`` read it, the report records it (:meth:`Options.recorded`) and so does
the output metagraph (collection :data:`COLLECTION`). This module imports no TensorFlow, so
the command line can build its parsers from the choices below.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from replicate.errors import ReplicateError

__all__ = ["Options", "AGGREGATIONS", "BATCH_NORM_MODES", "MIRRORED", "COLLECTION"]

#: How tower gradients are summed (see :mod:`replicate.passes.aggregate`).
AGGREGATIONS = ("add_n", "packed", "allreduce", "packed_allreduce")
#: Batch norm: each tower's own statistics, or the global batch's (see :mod:`replicate.passes.sync`).
BATCH_NORM_MODES = ("tower0", "sync")
#: ``param_devices`` value for a copy of every trained variable per tower device.
MIRRORED = "mirrored"
#: The output metagraph's collection that records the options, as one JSON string.
COLLECTION = "replicate_options"


@dataclasses.dataclass(frozen=True)
class Options:
    """What ``replicate.transform`` is asked to do besides the graph and its tower devices.

    Each field is a keyword argument of :func:`replicate.transform`, documented there.
    Construction validates every field and raises :class:`ReplicateError` naming the option;
    use :meth:`build` to build one from keyword arguments with a clear error for a misspelt
    option, and :func:`dataclasses.replace` to change one.
    """

    controller: str = "/cpu:0"
    train_op: str | None = None
    loss: str | None = None
    outputs: tuple[str, ...] = ()
    merge_forward: bool = True
    param_devices: tuple[str, ...] | str | None = None
    aggregation: str = "add_n"
    batch_norm: str = "tower0"
    batch_inputs: Any = None
    shared_inputs: Any = None
    cluster: Any = None
    verify_each: bool = False
    dump_dir: str | None = None
    progress: Callable[[str, int, int], None] | None = dataclasses.field(default=None, compare=False)
    between_graph: bool = False
    task_index: int | None = None
    sparse_on_ps: bool = True
    accumulate: int = 1
    check: bool = False

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen
        for name in ("merge_forward", "verify_each", "between_graph", "sparse_on_ps", "check"):
            if getattr(self, name) not in (True, False):    # 0 and 1 too, not "no"
                raise ReplicateError(f"{name}={getattr(self, name)!r}: give True or False")
        for name in ("train_op", "loss", "dump_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ReplicateError(f"{name}={value!r}: give a name (a string) or None")
        fix("outputs", _names(self.outputs, "outputs"))
        if isinstance(self.param_devices, str):
            if self.param_devices != MIRRORED:
                raise ReplicateError(f"param_devices='{self.param_devices}': give a list of "
                                     f"devices or '{MIRRORED}'")
        elif self.param_devices is not None:
            params = _names(self.param_devices, "param_devices")
            fix("param_devices", MIRRORED if params == (MIRRORED,) else params or None)
        if self.aggregation not in AGGREGATIONS:
            raise ReplicateError(f"aggregation='{self.aggregation}' is not one of "
                                 f"{', '.join(AGGREGATIONS)}")
        if self.batch_norm not in BATCH_NORM_MODES:
            raise ReplicateError(f"batch_norm='{self.batch_norm}' is not one of "
                                 f"{', '.join(BATCH_NORM_MODES)}")
        if (isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int)
                or self.accumulate < 1):
            raise ReplicateError(f"accumulate={self.accumulate!r}: give a whole number of "
                                 "micro-batches per device, 1 or more")
        if self.between_graph:
            if self.accumulate > 1:
                raise ReplicateError("between_graph with accumulate > 1 is not supported yet")
            if self.param_devices is not None or self.batch_norm != "tower0":
                raise ReplicateError("between_graph: param_devices and batch_norm='sync' are not "
                                     "supported (each worker keeps its own copy of dense variables)")
        if self.progress is not None and not callable(self.progress):
            raise ReplicateError(f"progress={self.progress!r}: give a function (pass, index, total)")

    @classmethod
    def build(cls, options: Options | None = None, **changes: Any) -> Options:
        """``options`` (or the defaults) with ``changes``; a misspelt option is named."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ReplicateError(f"unknown option{'s' if len(unknown) > 1 else ''} "
                                 f"{', '.join(unknown)}; the options are {', '.join(sorted(known))}")
        return dataclasses.replace(options or cls(), **changes)

    @property
    def mirrored(self) -> bool:
        """A copy of the trained variables on every tower device."""
        return self.param_devices == MIRRORED

    def recorded(self) -> dict[str, Any]:
        """The options as plain JSON data (the report's and the output metagraph's record);
        ``progress`` is left out and a cluster is written as its description."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "progress":
                continue
            out[field.name] = _plain(value)
        return out

    def to_json(self) -> str:
        """:meth:`recorded` as one JSON string."""
        return json.dumps(self.recorded(), sort_keys=True)


def _names(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ReplicateError(f"{what}={value!r}: give a list of names")
    return tuple(value)


def _plain(value: Any) -> Any:
    """JSON-able data for an option's value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    return repr(value)
