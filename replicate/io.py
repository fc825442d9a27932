"""Load graphs from every supported form and write results atomically.

Inputs: a ``tf.Graph``, a ``GraphDef``, a ``MetaGraphDef``, or a path to a ``.meta``
(binary MetaGraphDef), ``.pb`` (binary GraphDef), ``.pbtxt`` (text MetaGraphDef or
GraphDef) or a TF1 SavedModel directory. Every failure is an
:class:`~replicate.errors.InputError` whose message starts with the path.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from typing import Any

from google.protobuf import message, text_format
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

from replicate.errors import InputError, OutputError

__all__ = ["Loaded", "load", "write_atomic", "FORMATS"]

log = logging.getLogger(__name__)

FORMATS = ("meta", "metatxt", "pb", "pbtxt", "savedmodel")


@dataclasses.dataclass
class Loaded:
    """A graph as read: its GraphDef, the MetaGraphDef around it if any, and where it came from.

    Attributes:
        graph_def: the nodes and function library.
        meta: the MetaGraphDef (collections, saver) or None for a bare GraphDef.
        graph: a tf.Graph already holding these nodes (when the input was one), else None.
        origin: a description for messages (path or type).
        format: one of :data:`FORMATS`, or "graph" / "graph_def" / "meta_graph_def" in memory.
    """

    graph_def: graph_pb2.GraphDef
    meta: meta_graph_pb2.MetaGraphDef | None
    graph: Any
    origin: str
    format: str
    saved_model: saved_model_pb2.SavedModel | None = None
    meta_index: int = 0


def load(source: Any, tags: tuple[str, ...] = ("train",)) -> Loaded:
    """Read ``source`` (see module doc) into a :class:`Loaded`."""
    import tensorflow as tf

    if isinstance(source, tf.Graph):
        meta = tf.compat.v1.train.export_meta_graph(graph=source, clear_devices=False)
        return Loaded(meta.graph_def, meta, source, "tf.Graph", "graph")
    if isinstance(source, meta_graph_pb2.MetaGraphDef):
        return _checked(Loaded(source.graph_def, source, None, "MetaGraphDef", "meta_graph_def"))
    if isinstance(source, graph_pb2.GraphDef):
        return _checked(Loaded(source, None, None, "GraphDef", "graph_def"))
    if isinstance(source, (str, os.PathLike)):
        return _checked(_load_path(os.fspath(source), tags))
    raise InputError(f"cannot read a graph from a {type(source).__name__}; pass a tf.Graph, "
                     "GraphDef, MetaGraphDef or a path")


def _checked(loaded: Loaded) -> Loaded:
    if not loaded.graph_def.node:
        raise InputError(f"{loaded.origin}: the graph has no nodes")
    for node in loaded.graph_def.node:
        if not node.name or not node.op:
            raise InputError(f"{loaded.origin}: a node has an empty name or op type")
    return loaded


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file or directory") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory without saved_model.pb") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None


def _load_path(path: str, tags: tuple[str, ...]) -> Loaded:
    if os.path.isdir(path):
        return _load_saved_model(path, tags)
    if not os.path.exists(path):
        raise InputError(f"{path}: no such file or directory")
    data = _read(path)
    if not data:
        raise InputError(f"{path}: the file is empty")
    lower = path.lower()
    if lower.endswith((".pbtxt", ".txt", ".pbtext")):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{path}: not a text protobuf (not UTF-8)") from None
        for cls, fmt in ((meta_graph_pb2.MetaGraphDef, "metatxt"), (graph_pb2.GraphDef, "pbtxt")):
            proto = cls()
            try:
                text_format.Parse(text, proto)
            except (text_format.ParseError, message.DecodeError):
                continue
            if cls is meta_graph_pb2.MetaGraphDef and not proto.graph_def.node:
                continue
            return _wrap(proto, path, fmt)
        raise InputError(f"{path}: not a text GraphDef or MetaGraphDef")
    order = ((meta_graph_pb2.MetaGraphDef, "meta"), (graph_pb2.GraphDef, "pb"))
    if lower.endswith(".pb"):
        order = order[::-1]
    if os.path.basename(lower) == "saved_model.pb":
        return _load_saved_model(os.path.dirname(path) or ".", tags)
    for cls, fmt in order:
        proto = cls()
        try:
            proto.ParseFromString(data)
        except (message.DecodeError, RuntimeError, ValueError):
            continue
        nodes = proto.graph_def.node if cls is meta_graph_pb2.MetaGraphDef else proto.node
        if nodes and all(n.name and n.op for n in nodes):
            return _wrap(proto, path, fmt)
    raise InputError(f"{path}: not a TensorFlow graph (truncated, corrupt, or another format)")


def _wrap(proto, path: str, fmt: str) -> Loaded:
    if isinstance(proto, meta_graph_pb2.MetaGraphDef):
        return Loaded(proto.graph_def, proto, None, path, fmt)
    return Loaded(proto, None, None, path, fmt)


def _load_saved_model(path: str, tags: tuple[str, ...]) -> Loaded:
    model = saved_model_pb2.SavedModel()
    pb, pbtxt = os.path.join(path, "saved_model.pb"), os.path.join(path, "saved_model.pbtxt")
    try:
        if os.path.exists(pb):
            model.ParseFromString(_read(pb))
        elif os.path.exists(pbtxt):
            text_format.Parse(_read(pbtxt).decode("utf-8"), model)
        else:
            raise InputError(f"{path}: a directory without saved_model.pb")
    except (message.DecodeError, text_format.ParseError, UnicodeDecodeError, RuntimeError):
        raise InputError(f"{path}: saved_model.pb is corrupt") from None
    if not model.meta_graphs:
        raise InputError(f"{path}: the SavedModel holds no meta graph")
    index = 0
    for i, meta in enumerate(model.meta_graphs):
        if set(tags) <= set(meta.meta_info_def.tags):
            index = i
            break
    meta = model.meta_graphs[index]
    return Loaded(meta.graph_def, meta, None, path, "savedmodel", model, index)


def write_atomic(path: str, data: bytes, force: bool = False) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename.

    Raises:
        OutputError: ``path`` exists and ``force`` is False, or it cannot be written.
    """
    if os.path.exists(path) and not force:
        raise OutputError(f"{path}: already exists (use --force to overwrite)")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise OutputError(f"{path}: directory {directory} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".replicate-", dir=directory)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({exc.strerror})") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise OutputError(f"{path}: cannot write ({exc.strerror})") from None
