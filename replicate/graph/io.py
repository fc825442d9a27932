"""Load graphs from every supported form and write results atomically.

Inputs: a ``tf.Graph``, a ``GraphDef``, a ``MetaGraphDef``, or a path to a ``.meta``
(binary MetaGraphDef), ``.pb`` (binary GraphDef), ``.pbtxt`` (text MetaGraphDef or
GraphDef) or a TF1 SavedModel directory. Every failure is an
:class:`~replicate.errors.InputError` whose message starts with the path.

Outputs: :func:`output_format` picks the format to write (the input's kind, text when the
name ends in ``.pbtxt``), :func:`save` writes it. Files are written to a temporary name
and renamed; a SavedModel directory is assembled next to its destination (the input's
``variables/`` and ``assets/`` copied in) and renamed. Failures are
:class:`~replicate.errors.OutputError` and leave nothing behind.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from typing import Any

from google.protobuf import message, text_format
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

from replicate.errors import InputError, OutputError
from replicate.graph import outputs

__all__ = ["Loaded", "load", "export_graph", "importable", "write_atomic", "FORMATS", "output_format",
           "encode", "save", "check_writable", "TEXT_SUFFIXES"]

log = logging.getLogger(__name__)

FORMATS = ("meta", "metatxt", "pb", "pbtxt", "savedmodel")

#: File name endings read and written as text protobufs.
TEXT_SUFFIXES = (".pbtxt", ".txt", ".pbtext")

#: SavedModel sub-directories copied from the input (variable values, asset files).
_SAVED_MODEL_DIRS = ("variables", "assets", "assets.extra")


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
        meta = export_graph(source)
        return Loaded(meta.graph_def, meta, source, "tf.Graph", "graph")
    if isinstance(source, meta_graph_pb2.MetaGraphDef):
        return _checked(Loaded(source.graph_def, source, None, "MetaGraphDef", "meta_graph_def"))
    if isinstance(source, graph_pb2.GraphDef):
        return _checked(Loaded(source, None, None, "GraphDef", "graph_def"))
    if isinstance(source, (str, os.PathLike)):
        return _checked(_load_path(os.fspath(source), tags))
    raise InputError(f"cannot read a graph from a {type(source).__name__}; pass a tf.Graph, "
                     "GraphDef, MetaGraphDef or a path")


def export_graph(graph: Any, clear_devices: bool = False) -> meta_graph_pb2.MetaGraphDef:
    """The MetaGraphDef of a ``tf.Graph``, also with eager execution on (TF2's default), where
    exporting needs the graph to be the default one. Its GraphDef has no ``_output_shapes``
    attributes (TensorFlow's exporter adds them unless given the GraphDef; they cost a third
    of the export and nothing here reads them: static shapes come from the graph itself)."""
    import tensorflow as tf

    with graph.as_default():
        meta = tf.compat.v1.train.export_meta_graph(graph=graph, graph_def=graph.as_graph_def(),
                                                    clear_devices=clear_devices)
    return importable(meta)


def importable(meta: meta_graph_pb2.MetaGraphDef) -> meta_graph_pb2.MetaGraphDef:
    """``meta``, or a copy without the names its collections give of ops not in its graph: a
    layer built inside a v2 ``tf.cond`` adds its moving-average updates, ops of the branch's
    function body, to the graph's ``UPDATE_OPS``. Exported as they are, the MetaGraphDef cannot
    be imported ("refers to an Operation not in the graph"), by TensorFlow or here."""
    names = {node.name for node in meta.graph_def.node}

    def stale(m: meta_graph_pb2.MetaGraphDef):
        for collection in m.collection_def.values():
            if collection.HasField("node_list"):
                values = list(collection.node_list.value)
                kept = [v for v in values if v.split(":")[0].lstrip("^") in names]
                if len(kept) != len(values):
                    yield collection.node_list, kept

    if next(stale(meta), None) is None:
        return meta
    meta = meta_graph_pb2.MetaGraphDef.FromString(meta.SerializeToString())
    for node_list, kept in list(stale(meta)):
        del node_list.value[:]
        node_list.value.extend(kept)
    return meta


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
    if lower.endswith(TEXT_SUFFIXES):
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


def check_writable(path: str, force: bool = False, source: str | None = None,
                   directory: bool | None = None) -> None:
    """Fail before any work when ``path`` cannot become the output (``source``, the
    input, never can, even with ``force``); the rules are :mod:`replicate.graph.outputs`'.

    Args:
        directory: the output is a directory (a SavedModel); ``None`` when not known yet
            (an existing real directory is then judged as one, anything else as a file).

    Raises:
        OutputError: ``path`` is the input, a link, a device or other non-regular file,
            exists without ``force``, or its directory is missing, not a directory or not
            writable.
    """
    if directory is None:
        directory = os.path.isdir(path) and not os.path.islink(path)
    if directory:
        outputs.check_directory(path, force=force, source=source)
    else:
        outputs.check_file(path, force=force, source=source)


def write_atomic(path: str, data: bytes, force: bool = False) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename
    (:func:`replicate.graph.outputs.write_file`).

    Raises:
        OutputError: ``path`` exists and ``force`` is False, is not a regular file, or it
            cannot be written.
    """
    outputs.write_file(path, data, force=force)


def output_format(path: str, input_format: str, requested: str | None = None) -> str:
    """The format to write ``path`` in: ``requested``, else the input's kind (SavedModel,
    MetaGraphDef or GraphDef) as text when ``path`` ends in ``.pbtxt``; a SavedModel input
    written to a ``.meta`` (or ``.pbtxt``) name gives that file alone.

    Raises:
        OutputError: ``requested`` is not one of :data:`FORMATS`.
    """
    if requested is not None:
        if requested not in FORMATS:
            raise OutputError(f"--format '{requested}': choose one of {', '.join(FORMATS)}")
        return requested
    lower = path.lower()
    text = lower.endswith(TEXT_SUFFIXES)
    if input_format == "savedmodel" and not text and not lower.endswith(".meta"):
        return "savedmodel"
    if input_format in ("pb", "pbtxt", "graph_def"):
        return "pbtxt" if text else "pb"
    return "metatxt" if text else "meta"


def encode(meta: meta_graph_pb2.MetaGraphDef, fmt: str) -> bytes:
    """``meta`` (or its GraphDef, for ``pb``/``pbtxt``) as the bytes of a ``fmt`` file.

    Binary output is deterministic: the same graph always gives the same bytes.
    """
    if fmt not in ("meta", "metatxt", "pb", "pbtxt"):
        raise OutputError(f"format '{fmt}' is not a single file")
    return _serialize(meta if fmt.startswith("meta") else meta.graph_def, fmt.endswith("txt"))


def _serialize(proto, text: bool = False) -> bytes:
    try:
        if text:
            return text_format.MessageToString(proto).encode("utf-8")
        return proto.SerializeToString(deterministic=True)
    except (ValueError, message.EncodeError) as exc:
        raise OutputError(f"cannot serialize the {type(proto).__name__} ({exc})") from None


def save(meta: meta_graph_pb2.MetaGraphDef, path: str, fmt: str, *, force: bool = False,
         source: Loaded | None = None) -> None:
    """Write ``meta`` to ``path`` (a directory for ``savedmodel``) as ``fmt``, atomically.

    Args:
        meta: the graph with its collections, saver and signatures.
        path: where to write.
        fmt: one of :data:`FORMATS`; see :func:`output_format`.
        force: replace an existing ``path``.
        source: the loaded input; required for ``savedmodel`` (its other meta graphs,
            variables and assets are carried over).

    Raises:
        OutputError: the output cannot be written; nothing is left behind.
    """
    if fmt != "savedmodel":
        write_atomic(path, encode(meta, fmt), force)
        return
    if source is None or source.saved_model is None:
        raise OutputError(f"{path}: a SavedModel is written only from a SavedModel input "
                          "(its variables are copied); choose --format meta")
    from replicate.graph.meta import replace_meta_graph

    check_writable(path, force, directory=True)
    model = replace_meta_graph(source.saved_model, source.meta_index, meta)
    _replace_dir(path, _serialize(model), source.origin)


def _replace_dir(path: str, data: bytes, source_dir: str) -> None:
    """Assemble a SavedModel directory next to ``path`` and rename it into place."""
    tmp = outputs.new_staging_directory(path, beside=True)
    try:
        with open(os.path.join(tmp, "saved_model.pb"), "wb") as fh:
            fh.write(data)
        for sub in _SAVED_MODEL_DIRS:
            if os.path.isdir(os.path.join(source_dir, sub)):
                shutil.copytree(os.path.join(source_dir, sub), os.path.join(tmp, sub))
    except (OSError, shutil.Error) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = getattr(exc, "strerror", None) or str(exc)
        raise OutputError(f"{path}: cannot write ({reason})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    outputs.commit_directory(tmp, path, replace=True)
