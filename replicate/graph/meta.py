"""Carry a MetaGraphDef's collections, saver and signatures over to the rewritten graph.

Names are the interface: collections keep every entry whose node survives (variables,
the train op, summaries, the saver); entries naming a node that now exists only per tower
(such as batch-norm update ops) point at tower 0's copy; while/cond contexts of replicated
control flow are dropped with a warning, since they only serve building new gradients.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from google.protobuf import message
from tensorflow.core.framework import graph_pb2, variable_pb2
from tensorflow.core.protobuf import (
    control_flow_pb2,
    meta_graph_pb2,
    queue_runner_pb2,
    saved_model_pb2,
    saver_pb2,
)
from tensorflow.python.framework import meta_graph as tf_meta_graph

from replicate.errors import InputError
from replicate.graph.ir import node_of

__all__ = ["referenced_names", "rewrite", "dangling", "collection_ops", "replace_meta_graph",
           "TRAIN_OP_KEYS"]

log = logging.getLogger(__name__)

_VARIABLE_FIELDS = ("variable_name", "initializer_name", "snapshot_name", "initial_value_name")
_QUEUE_FIELDS = ("queue_name", "close_op_name", "cancel_op_name")
_CONTEXT_KEYS = ("cond_context", "while_context")

#: Collections TensorFlow writes with serialized protos: an entry that does not parse is corrupt input.
_STANDARD_KEYS = frozenset({"variables", "trainable_variables", "local_variables", "model_variables",
                            "moving_average_variables", "metric_variables", "savers", "queue_runners",
                            "cond_context", "while_context"})

#: Collections that name a graph's train op (``tf.compat.v1.GraphKeys.TRAIN_OP``, SavedModel's).
TRAIN_OP_KEYS = ("train_op", "saved_model_train_op")


def _bytes_protos(key: str):
    if key in _CONTEXT_KEYS:
        return control_flow_pb2.CondContextDef if key == "cond_context" else control_flow_pb2.WhileContextDef
    if key == "queue_runners":
        return queue_runner_pb2.QueueRunnerDef
    if key == "savers":
        return saver_pb2.SaverDef
    if "variables" in key:
        return variable_pb2.VariableDef
    return None


def referenced_names(meta: meta_graph_pb2.MetaGraphDef | None) -> set[str]:
    """Node names that collections, the saver and signatures refer to."""
    if meta is None:
        return set()
    names: set[str] = set()
    for key, col in meta.collection_def.items():
        if col.HasField("node_list"):
            names.update(node_of(v) for v in col.node_list.value)
        elif col.HasField("bytes_list") and key not in _CONTEXT_KEYS:
            cls = _bytes_protos(key)
            for raw in col.bytes_list.value:
                names.update(_proto_names(cls, raw, key))
    if meta.HasField("saver_def"):
        names.update(node_of(getattr(meta.saver_def, f)) for f in
                     ("filename_tensor_name", "save_tensor_name", "restore_op_name") if getattr(meta.saver_def, f))
    for sig in meta.signature_def.values():
        for info in list(sig.inputs.values()) + list(sig.outputs.values()):
            if info.name:
                names.add(node_of(info.name))
    return names


def _proto_names(cls, raw: bytes, key: str = "") -> list[str]:
    """Node names in one serialized entry of collection ``key``.

    Raises:
        InputError: an entry of a collection TensorFlow itself writes is not the proto it must be.
    """
    if cls is None:
        return []
    proto = cls()
    try:
        proto.ParseFromString(raw)
    except message.DecodeError:
        if key in _STANDARD_KEYS:
            raise InputError(f"MetaGraphDef: collection '{key}' holds an entry that is not a "
                             f"{cls.__name__}") from None
        log.warning("collection '%s': an entry is not a %s; the names it holds are not tracked",
                    key, cls.__name__)
        return []
    if cls is variable_pb2.VariableDef:
        return [node_of(getattr(proto, f)) for f in _VARIABLE_FIELDS if getattr(proto, f)]
    if cls is queue_runner_pb2.QueueRunnerDef:
        return [node_of(getattr(proto, f)) for f in _QUEUE_FIELDS if getattr(proto, f)] + [
            node_of(n) for n in proto.enqueue_op_name]
    return []


def rewrite(meta: meta_graph_pb2.MetaGraphDef | None, graph_def: graph_pb2.GraphDef,
            renamed: dict[str, str], warn: Callable[[str], None]) -> meta_graph_pb2.MetaGraphDef:
    """A MetaGraphDef for ``graph_def`` with ``meta``'s collections, saver and signatures.

    Args:
        meta: the input MetaGraphDef, or None (then only the graph and op list are set).
        graph_def: the rewritten graph.
        renamed: removed node name -> the name that now plays its role (tower 0's copy).
        warn: called with a sentence for every entry that had to be dropped.
    """
    out = meta_graph_pb2.MetaGraphDef()
    if meta is not None:
        out.CopyFrom(meta)
        out.ClearField("graph_def")
        out.ClearField("collection_def")
    out.graph_def.CopyFrom(graph_def)
    out.meta_info_def.stripped_op_list.CopyFrom(tf_meta_graph.stripped_op_list_for_graph(graph_def))
    if meta is None:
        return out
    present = {n.name for n in graph_def.node}

    def fix(name: str) -> str | None:
        node = node_of(name)
        if node in present:
            return name
        if node in renamed:
            return renamed[node] + name[len(node):]
        return None

    for key, col in meta.collection_def.items():
        new = out.collection_def[key]
        if col.HasField("node_list"):
            kept = [fix(v) for v in col.node_list.value]
            dropped = [v for v, k in zip(col.node_list.value, kept) if k is None]
            new.node_list.value.extend(k for k in kept if k is not None)
            if dropped:
                warn(f"collection '{key}': dropped {len(dropped)} entries that no longer exist "
                     f"(first: '{dropped[0]}')")
        elif col.HasField("bytes_list"):
            cls = _bytes_protos(key)
            for raw in col.bytes_list.value:
                names = _proto_names(cls, raw, key)
                if key in _CONTEXT_KEYS:
                    warn(f"collection '{key}': dropped a control-flow context (only needed to "
                         "build new gradients of replicated loops)")
                    continue
                if any(fix(n) is None for n in names):
                    warn(f"collection '{key}': dropped an entry naming a removed node ({names[0]})")
                    continue
                new.bytes_list.value.append(raw)
        else:
            new.CopyFrom(col)
    for key in _CONTEXT_KEYS:
        if key in out.collection_def and not out.collection_def[key].bytes_list.value:
            del out.collection_def[key]
    for sig in out.signature_def.values():
        for info in list(sig.inputs.values()) + list(sig.outputs.values()):
            if info.name and fix(info.name) is not None:
                info.name = fix(info.name)
    return out


def collection_ops(meta: meta_graph_pb2.MetaGraphDef | None, key: str) -> list[str]:
    """Distinct node names in collection ``key`` of ``meta`` (a ``node_list``), in order."""
    if meta is None or key not in meta.collection_def:
        return []
    return list(dict.fromkeys(node_of(v) for v in meta.collection_def[key].node_list.value))


def dangling(meta: meta_graph_pb2.MetaGraphDef) -> list[str]:
    """References of collections, saver and signatures to nodes ``meta``'s graph lacks.

    Returns:
        One sentence per broken reference (empty when the MetaGraphDef is consistent).
    """
    present = {n.name for n in meta.graph_def.node}
    problems: list[str] = []
    for key in sorted(meta.collection_def):
        col = meta.collection_def[key]
        if col.HasField("node_list"):
            names = [node_of(v) for v in col.node_list.value]
        elif col.HasField("bytes_list") and key not in _CONTEXT_KEYS:
            cls = _bytes_protos(key)
            names = [n for raw in col.bytes_list.value for n in _proto_names(cls, raw, key)]
        else:
            continue
        problems.extend(f"collection '{key}' names missing node '{n}'" for n in names
                        if n not in present)
    if meta.HasField("saver_def"):
        for field in ("filename_tensor_name", "save_tensor_name", "restore_op_name"):
            name = getattr(meta.saver_def, field)
            if name and node_of(name) not in present:
                problems.append(f"saver_def.{field} names missing node '{name}'")
    for key in sorted(meta.signature_def):
        sig = meta.signature_def[key]
        for info in list(sig.inputs.values()) + list(sig.outputs.values()):
            if info.name and node_of(info.name) not in present:
                problems.append(f"signature '{key}' names missing tensor '{info.name}'")
    return problems


def replace_meta_graph(model: saved_model_pb2.SavedModel, index: int,
                       meta_graph_def: meta_graph_pb2.MetaGraphDef) -> saved_model_pb2.SavedModel:
    """A copy of ``model`` whose meta graph ``index`` is ``meta_graph_def``, the others kept.

    The tags of the replaced meta graph are kept, so loaders find it as before.
    """
    out = saved_model_pb2.SavedModel()
    out.CopyFrom(model)
    tags = list(model.meta_graphs[index].meta_info_def.tags)
    out.meta_graphs[index].CopyFrom(meta_graph_def)
    del out.meta_graphs[index].meta_info_def.tags[:]
    out.meta_graphs[index].meta_info_def.tags.extend(tags)
    return out
