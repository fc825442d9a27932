"""replicate: rewrite a single-device TensorFlow training graph into exact in-graph
data-parallel training over N devices.

>>> res = replicate.transform(graph, devices=["/gpu:0", "/gpu:1"])
>>> sess.run(res.train_op, feed_dict=...)

The public names are loaded on first use, so ``import replicate`` (and the CLI's error
paths) do not pay for importing TensorFlow until it is needed.
"""

from __future__ import annotations

import importlib
import os as _os

from replicate.errors import (
    AnalysisError,
    DeviceError,
    InputError,
    OutputError,
    PassError,
    ReplicateError,
)

_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__all__ = ["transform", "Options", "analyze_only", "normalize_device", "Result", "Report", "ReplicateError",
           "InputError", "AnalysisError", "DeviceError", "OutputError", "PassError", "StepFeeder"]
__version__ = "0.1.0"

_LAZY = {"transform": "replicate.api", "analyze_only": "replicate.api",
         "normalize_device": "replicate.api", "Result": "replicate.api",
         "Report": "replicate.report", "StepFeeder": "replicate.runtime.step_feeder",
         "Options": "replicate.options"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'replicate' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names (and the subpackages imported so far), not this module's helpers."""
    return sorted(set(__all__) | {"__version__"} | {k for k, v in globals().items()
                                                    if type(v) is type(_os)
                                                    and v.__name__.startswith("replicate.")})
