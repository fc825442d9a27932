"""Helper of the draw passes: bring a tensor of the root frame into TF1 loop frames.

Requires: the graph and its frames (:func:`replicate.graph.frames.frames`, re-exported here).
Produces: :func:`enter`, which brings a tensor from the root frame into the innermost frame of
a chain.
"""

from __future__ import annotations

from tensorflow.python.framework import dtypes

from replicate.graph.frames import Frame, frames
from replicate.graph.ir import IR

__all__ = ["Frame", "frames", "enter"]


def enter(ir: IR, tensor: str, chain: list[Frame], base: str, device: str, dtype=dtypes.int32) -> str:
    """``tensor`` (of the root frame, int32 unless ``dtype`` says otherwise) entered as a loop
    constant into each frame of ``chain`` in turn; returns the tensor inside the innermost one."""
    for depth, frame in enumerate(chain):
        tensor = ir.add(f"{base}/enter_{depth}", "Enter", [tensor], device=device,
                        attrs={"T": dtype, "frame_name": frame.name, "is_constant": True,
                               "parallel_iterations": frame.parallel}).name
    return tensor
