"""replicate: rewrite a single-device TensorFlow training graph into exact in-graph
data-parallel training over N devices.

>>> res = replicate.transform(graph, devices=["/gpu:0", "/gpu:1"])
>>> sess.run(res.train_op, feed_dict=...)
"""

from __future__ import annotations

import os as _os

_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from replicate.api import Result, analyze_only, normalize_device, transform  # noqa: E402
from replicate.errors import (AnalysisError, DeviceError, InputError, OutputError,  # noqa: E402
                              PassError, ReplicateError)
from replicate.report import Report  # noqa: E402

__all__ = ["transform", "analyze_only", "normalize_device", "Result", "Report", "ReplicateError",
           "InputError", "AnalysisError", "DeviceError", "OutputError", "PassError"]
__version__ = "0.1.0"
