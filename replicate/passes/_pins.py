"""Helper of the analyze pass: take shapeless placeholders for scalars, checked at run time.

A legacy program often declares a hyperparameter without a shape
(``scale = tf.placeholder(tf.float32)``) and feeds it a Python float. Without a rank, the
ops that read it (``x + scale * noise``, then a ``matmul``) have no layout the analysis can
prove, so the result was inexact although every step the driver runs is exact.

Requires: an IR with static shapes and its ``tf_graph``; the analysis' placeholders that
left a layout unknown (``ctx.shapeless``, shared inputs only: a batch input is never pinned).

Produces: an ``EnsureShape(shape=[])`` after each such placeholder, read by all its
consumers, and the static shapes (and ``ir.tf_graph``) inferred again with it. The analyze
pass keeps the pins only when the analysis then proves more, and names each in a warning;
the emitted graph keeps the check, so a step fed anything but a scalar stops with
TensorFlow's error naming the pin instead of training on an unproved layout.
"""

from __future__ import annotations

from typing import Callable

from tensorflow.core.framework import attr_value_pb2, tensor_shape_pb2

from replicate import registry
from replicate.errors import InputError
from replicate.ir import IR, tensor_name

__all__ = ["candidates", "pin_scalars", "warning"]

#: Suffix of the node that checks a placeholder is fed a scalar.
SUFFIX = "replicate_scalar"


def candidates(ir: IR, analysis) -> list[str]:
    """Shared placeholders without a static rank that left an op's layout unknown, when the
    analysis has reasons (nothing to gain otherwise)."""
    if not analysis.reasons or analysis.flow is None:
        return []
    shared = set(analysis.shared_inputs)
    return sorted(n for n in analysis.flow.ctx.shapeless
                  if tensor_name(n) in shared and ir.static_shape(tensor_name(n)) is None)


def pin_scalars(ir: IR, names: list[str]) -> tuple[dict[str, str], Callable[[], None]] | None:
    """Insert the checks after ``names`` and infer the shapes again; return placeholder ->
    check, and a function that undoes all of it. None, with nothing changed, when an op
    cannot read a scalar there (a ``tf.gather`` of class weights fed as a vector)."""
    saved_shapes, saved_graph = dict(ir.static_shapes), ir.tf_graph
    pins = {}
    for name in names:
        node = ir.nodes[name]
        pin = ir.unique_name(f"{name}/{SUFFIX}")
        readers = [c.name for c, _ in ir.data_consumers(tensor_name(name))]
        ir.add(pin, "EnsureShape", [tensor_name(name)], device=node.device,
               attrs={"shape": attr_value_pb2.AttrValue(shape=tensor_shape_pb2.TensorShapeProto()),
                      "T": node.attrs["dtype"]})
        ir.replace_uses(tensor_name(name), tensor_name(pin), only=readers)
        pins[name] = pin

    def undo() -> None:
        for name, pin in pins.items():
            ir.replace_uses(tensor_name(pin), tensor_name(name))
            ir.remove(pin)
        ir.static_shapes = saved_shapes
        ir.tf_graph = saved_graph

    try:
        graph = registry.import_checked(ir.to_graph_def(), "shapeless inputs taken for scalars")
    except InputError:
        undo()
        return None
    ir.load_static_shapes(graph)
    ir.tf_graph = graph
    return pins, undo


def warning(name: str, pin: str) -> str:
    """What the report says about a pin."""
    return (f"input '{tensor_name(name)}' has no static shape: it is taken to be a scalar, "
            f"which the ops reading it need to be proved exact; the rewritten graph checks this "
            f"when it runs ('{pin}' stops a step fed anything else); give the placeholder a "
            "shape to say otherwise")
