"""The registry check: malformed NodeDefs fail with one line naming the node or attribute,
before TensorFlow sees them, and structural mutations of real graphs never crash.

Hand-written cases pin each check's message; a subprocess shows that TensorFlow itself
dies on one of them (a recursive function) while ``transform`` fails cleanly. The fuzz
test applies random structural mutations (deleted, retyped, renamed or duplicated nodes,
dangling, extra, dropped or swapped inputs, bad output indexes, missing, mistyped or
extreme attributes, cycles, devices, colocation, tensors, shapes, functions, collections)
to several real training graphs; each case must give a valid result or a ReplicateError.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import models
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from soak import SCALE, Tally, fuzz, transform_cleanly
from tensorflow.core.framework import attr_value_pb2, graph_pb2, tensor_shape_pb2, types_pb2
from tensorflow.core.protobuf import meta_graph_pb2

import replicate
from replicate.errors import InputError, OutputError
from replicate.graph import registry

v1 = tf.compat.v1
DEVICES = ["/cpu:0", "/cpu:1"]


def tiny(optimizer: str = "sgd", resource: bool = True, dataset: bool = False,
         function: bool = False) -> tf.Graph:
    """A small linear regression trained by ``optimizer``, fed by placeholders or a dataset;
    with ``function``, its forward pass calls a tf.function (a library function)."""
    graph = tf.Graph()
    with graph.as_default():
        if dataset:
            data = tf.data.Dataset.from_tensor_slices((np.ones((8, 2), np.float32),
                                                       np.ones((8, 1), np.float32))).batch(4)
            x, y = v1.data.make_one_shot_iterator(data).get_next()
        else:
            x = v1.placeholder(tf.float32, [None, 2], name="x")
            y = v1.placeholder(tf.float32, [None, 1], name="y")
        w = v1.get_variable("w", [2, 1], use_resource=resource)
        out = tf.matmul(x, w)
        if function:
            out = tf.function(lambda a: tf.nn.relu(a) * 2.0)(out)
        loss = tf.reduce_mean(tf.square(tf.identity(out, name="logits") - y), name="loss")
        models.OPTIMIZERS[optimizer]().minimize(loss, name="train")
    return graph


@functools.lru_cache(maxsize=None)
def bases() -> tuple[meta_graph_pb2.MetaGraphDef, ...]:
    """Real training graphs (as MetaGraphDefs) that the mutations start from."""
    built = [models.mlp("sgd", hidden=4, global_step=False).graph, tiny("momentum", resource=False),
             models.clipped().graph, tiny("adam", dataset=True), tiny(function=True)]
    return tuple(v1.train.export_meta_graph(graph=g) for g in built)


def _graph(index: int = 0) -> graph_pb2.GraphDef:
    gd = graph_pb2.GraphDef()
    gd.CopyFrom(bases()[index].graph_def)
    return gd


def _node(gd, name):
    return next(n for n in gd.node if n.name == name)


def _shape_const(gd):
    return _node(gd, "model/w1/Initializer/random_uniform/shape")


def _recursive(gd):
    """Make the function the forward PartitionedCall calls call itself."""
    name = _node(gd, "PartitionedCall").attr["f"].func.name
    fdef = next(f for f in gd.library.function if f.signature.name == name)
    call = fdef.node_def.add(name="again", op="PartitionedCall", input=[fdef.signature.input_arg[0].name])
    call.attr["f"].func.name = name
    call.attr["Tin"].list.type.append(types_pb2.DT_FLOAT)
    call.attr["Tout"].list.type.extend(a.type for a in fdef.signature.output_arg)


# (mutation of the first base graph, or of the function model's for index 4; message fragment)
def _broken_attr_name(gd):
    """An attribute name with a line break (a corrupted file: soak seed 1795464586)."""
    node = _node(gd, "y")
    node.attr["\nhape"].CopyFrom(node.attr["shape"])


CASES = {
    "line break in a name": (0, _broken_attr_name,
                             "node 'y' (Placeholder) has attribute '\\nhape', which Placeholder does "
                             "not define"),
    "unknown op": (0, lambda gd: setattr(_node(gd, "logits"), "op", "NoSuchOp"),
                   "node 'logits' (NoSuchOp) has unknown op type 'NoSuchOp'"),
    "missing attr": (0, lambda gd: _node(gd, "loss").attr.pop("T"),
                     "node 'loss' (Mean) lacks required attribute 'T'"),
    "mistyped attr": (0, lambda gd: _node(gd, "loss").attr["T"].CopyFrom(attr_value_pb2.AttrValue(i=3)),
                      "node 'loss' (Mean) attribute 'T' should be type, not i"),
    "invalid dtype": (0, lambda gd: setattr(_node(gd, "x").attr["dtype"], "type", 1000),
                      "node 'x' (Placeholder) attribute 'dtype' holds invalid DataType 1000"),
    "disallowed dtype": (0, lambda gd: setattr(_node(gd, "loss").attr["T"], "type", types_pb2.DT_STRING),
                         "attribute 'T' holds type DT_STRING, which the op does not allow"),
    "below minimum": (2, lambda gd: setattr(next(n for n in gd.node if n.op == "Pack").attr["N"], "i", 0),
                      "attribute 'N' is 0, below its minimum 1"),
    "unknown attr": (0, lambda gd: setattr(_node(gd, "loss").attr["bogus"], "i", 1),
                     "has attribute 'bogus', which Mean does not define"),
    "placeholder attr": (0, lambda gd: setattr(_node(gd, "loss").attr["T"], "placeholder", "T"),
                         "attribute 'T' is an unresolved placeholder"),
    "bad shape": (0, lambda gd: setattr(_node(gd, "x").attr["shape"].shape.dim[1], "size", -5),
                  "node 'x' (Placeholder) attribute 'shape' shape has dimension -5"),
    "rank 300": (0, lambda gd: _node(gd, "x").attr["shape"].shape.dim.extend(
        [tensor_shape_pb2.TensorShapeProto.Dim(size=1)] * 300), "above TensorFlow's limit of 254"),
    "huge splat": (0, lambda gd: _shape_const(gd).attr["value"].tensor.tensor_shape.dim[0]
                   .__setattr__("size", 1 << 40), "declares 4096.0 GiB"),
    "short content": (0, lambda gd: setattr(_shape_const(gd).attr["value"].tensor, "tensor_content",
                                            b"\0\0"), "holds 2 bytes for a 8-byte shape"),
    "const dtype": (0, lambda gd: setattr(_shape_const(gd).attr["dtype"], "type", 1),
                    "attribute 'value' has a dtype other than attribute 'dtype'"),
    "dangling input": (0, lambda gd: _node(gd, "loss").input.__setitem__(0, "gone"),
                       "node 'loss' (Mean) reads 'gone', which does not exist"),
    "output index": (0, lambda gd: _node(gd, "loss").input.__setitem__(
        0, _node(gd, "loss").input[0] + ":7"), "reads output 7 of"),
    "extra input": (0, lambda gd: _node(gd, "logits").input.insert(1, "x"),
                    "node 'logits' (Identity) has 2 data inputs, expected 1"),
    "control first": (0, lambda gd: _node(gd, "logits").input.insert(0, "^x"),
                      "lists data input 'add_1' after a control input"),
    "missing control": (0, lambda gd: _node(gd, "logits").input.append("^gone"),
                        "node 'logits' (Identity) waits for 'gone'"),
    "duplicate name": (0, lambda gd: gd.node.add().CopyFrom(_node(gd, "logits")),
                       "duplicate node name 'logits'"),
    "bad name": (0, lambda gd: setattr(_node(gd, "logits"), "name", "bad name!"),
                 "node name 'bad name!' has invalid characters"),
    "cycle": (0, lambda gd: _node(gd, "logits").input.append("^loss"), "is on a cycle"),
    "bad device": (0, lambda gd: setattr(_node(gd, "logits"), "device", "/gpu:x::"),
                   "node 'logits' (Identity) has malformed device '/gpu:x::'"),
    "colocation": (0, lambda gd: _node(gd, "logits").attr["_class"].list.s.append(b"loc:@gone"),
                   "node 'logits' (Identity) is colocated with 'gone'"),
    "missing function": (4, lambda gd: setattr(next(n for n in gd.node if n.op.endswith("PartitionedCall"))
                                               .attr["f"].func, "name", "gone"),
                         "attribute 'f' names function 'gone', which the library does not define"),
    "recursive function": (4, _recursive, "calls itself"),
    "function body op": (4, lambda gd: setattr(gd.library.function[0].node_def[0], "op", "NoSuchOp"),
                         "has unknown op type 'NoSuchOp'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_node_fails_with_one_line_naming_it(case):
    index, mutate, fragment = CASES[case]
    gd = _graph(index)
    mutate(gd)
    with pytest.raises(InputError) as info:
        registry.check_graph_def(gd, "model.pb")
    message = str(info.value)
    assert message.startswith("model.pb: ") and "\n" not in message
    assert fragment in message
    with pytest.raises(replicate.ReplicateError, match="^GraphDef: ") as info:
        replicate.transform(gd, DEVICES)
    assert fragment in str(info.value)


@pytest.mark.parametrize("index", range(5))
def test_real_graphs_pass_and_results_pass(index):
    gd = _graph(index)
    registry.check_graph_def(gd, "input")
    kind, res = transform_cleanly(bases()[index], DEVICES)
    if res is not None:
        registry.check_graph_def(res.graph_def, "output")
    assert kind in ("ok", "analysis"), kind


def test_recursive_function_kills_tensorflow_but_not_transform(tmp_path):
    gd = _graph(4)
    _recursive(gd)
    path = tmp_path / "recursive.pb"
    path.write_bytes(gd.SerializeToString())
    script = textwrap.dedent(f"""
        import tensorflow as tf
        gd = tf.compat.v1.GraphDef.FromString(open({str(path)!r}, "rb").read())
        with tf.Graph().as_default():
            tf.graph_util.import_graph_def(gd, name="")
    """)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    died = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=300)
    assert died.returncode < 0, "TensorFlow no longer aborts on a recursive function"
    with pytest.raises(InputError, match="recursive.pb: function '.*' calls itself"):
        replicate.transform(str(path), DEVICES)


def test_colocation_with_removed_gradient_node():
    gd = tiny().as_graph_def()
    _node(gd, "logits").attr["_class"].list.s.append(b"loc:@gradients/sub_grad/tuple/control_dependency_1")
    registry.import_checked(gd, "input")
    res = replicate.transform(gd, DEVICES)
    registry.import_checked(res.graph_def, "result")


class _Oversized:
    """Stands in for a message over 2 GiB: protobuf (upb) refuses even to size one."""

    def ByteSize(self):  # noqa: N802 - the protobuf method name
        from google.protobuf.message import EncodeError
        raise EncodeError("Failed to serialize proto")


def test_message_size_limit(monkeypatch):
    gd = _graph(0)
    assert registry.check_message_size(gd, "out.meta") == gd.ByteSize()
    with pytest.raises(OutputError, match=r"^out.meta: the graph is over 2 GiB, above protobuf's "
                       r"2 GiB limit; move large constants into variables"):
        registry.check_message_size(_Oversized(), "out.meta")
    monkeypatch.setattr(registry, "PROTOBUF_LIMIT", 1000)
    with pytest.raises(InputError, match=r"^GraphDef: the graph is 0.00 GiB, above protobuf's 2 GiB"):
        replicate.transform(gd, DEVICES)


# ---------------------------------------------------------------------------- structural fuzz
OPS = ("Identity", "NoOp", "Const", "AddV2", "MatMul", "Placeholder", "VariableV2", "VarHandleOp",
       "ReadVariableOp", "ApplyGradientDescent", "ResourceApplyGradientDescent", "Mean", "Sum",
       "Reshape", "Fill", "Shape", "ConcatV2", "IteratorGetNext", "PartitionedCall", "Enter",
       "Merge", "NextIteration", "Switch", "SplitV", "AssignAddVariableOp", "NoSuchOp")
INTS = (0, 1, -1, 2, 3, 7, 255, 1 << 31, -(1 << 31), 1 << 62)
DEVICE_STRINGS = ("", "/cpu:0", "/gpu:3", "/job:ps/task:0", "/device:CPU:9", "cpu", "/gpu:x::", "//")
KINDS = ("i", "f", "b", "s", "type", "shape", "list", "tensor", "func", "placeholder", None)


def _attr(kind: str | None, n: int) -> attr_value_pb2.AttrValue:
    """An AttrValue of ``kind`` built from ``n`` (possibly invalid on purpose)."""
    value = attr_value_pb2.AttrValue()
    if kind == "i":
        value.i = INTS[n % len(INTS)]
    elif kind == "f":
        value.f = float(INTS[n % len(INTS)])
    elif kind == "b":
        value.b = bool(n & 1)
    elif kind == "s":
        value.s = (b"VALID", b"SAME", b"NHWC", b"", b"\xff")[n % 5]
    elif kind == "type":
        value.type = (1, 3, 9, 7, 20, 101, 0, 1000)[n % 8]
    elif kind == "shape":
        value.shape.dim.extend(tensor_shape_pb2.TensorShapeProto.Dim(size=INTS[(n + k) % 5])
                               for k in range(n % 3))
        value.shape.unknown_rank = n % 7 == 6
    elif kind == "list":
        (value.list.i if n & 1 else value.list.type).extend([1, 3][: n % 3])
    elif kind == "tensor":
        value.tensor.dtype = (1, 3, 7, 0)[n % 4]
        value.tensor.tensor_shape.dim.add().size = INTS[n % len(INTS)]
        value.tensor.int_val.extend([1, 2][: n % 3])
    elif kind == "func":
        value.func.name = ("gone", "Identity", "")[n % 3]
    elif kind == "placeholder":
        value.placeholder = "T"
    return value


def _pick(seq, n: int):
    return seq[n % len(seq)] if len(seq) else None


def _set_input(node, j: int, ref: str) -> None:
    if node.input:
        node.input[j % len(node.input)] = ref
    else:
        node.input.append(ref)


def _mutate(meta: meta_graph_pb2.MetaGraphDef, kind: int, a: int, b: int, c: int) -> None:
    """Apply structural mutation number ``kind`` with integer parameters ``a``, ``b``, ``c``."""
    gd = meta.graph_def
    nodes = gd.node
    node, other = _pick(nodes, a), _pick(nodes, b)
    keys = sorted(node.attr) if node is not None else []
    mutation = MUTATIONS[kind % len(MUTATIONS)]
    if node is None and mutation not in ("library", "collection"):
        return
    if mutation == "delete":
        del nodes[a % len(nodes)]
    elif mutation == "retype":
        node.op = OPS[b % len(OPS)]
    elif mutation == "dangling":
        _set_input(node, b, ("gone", f"{other.name}:{INTS[c % len(INTS)]}", "", "^gone", ":")[c % 5])
    elif mutation == "extra":
        data = [i for i in node.input if not i.startswith("^")]
        node.input.insert(len(data) if c & 1 else 0, f"{other.name}:{c % 3}" if c % 3 else other.name)
    elif mutation == "drop" and node.input:
        del node.input[b % len(node.input)]
    elif mutation == "rewire":
        _set_input(node, c, f"{other.name}:{c % 2}" if c % 2 else other.name)
    elif mutation == "swap" and len(node.input) > 1:
        i = b % len(node.input)
        j = (i + 1 + c % (len(node.input) - 1)) % len(node.input)
        node.input[i], node.input[j] = node.input[j], node.input[i]
    elif mutation == "drop_attr" and keys:
        del node.attr[keys[b % len(keys)]]
    elif mutation == "mistype_attr" and keys:
        node.attr[keys[b % len(keys)]].CopyFrom(_attr(KINDS[c % len(KINDS)], c // 7))
    elif mutation == "extreme_attr" and keys:
        key = keys[b % len(keys)]
        kind_name = node.attr[key].WhichOneof("value") or "i"
        node.attr[key].CopyFrom(_attr(kind_name if kind_name in KINDS else "i", c))
    elif mutation == "duplicate":
        node.name = other.name if c & 1 else node.name
        if not c & 1:
            nodes.add().CopyFrom(node)
    elif mutation == "rename":
        node.name = (f"{node.name}_renamed", "bad name", f"{node.name}/", "_internal", "a:1")[c % 5]
    elif mutation == "cycle":
        consumers = [n.name for n in nodes if any(i.lstrip("^").split(":")[0] == node.name for i in n.input)]
        target = _pick(consumers, c) or node.name
        node.input.append(f"^{target}" if c & 1 else target)
    elif mutation == "device":
        node.device = DEVICE_STRINGS[c % len(DEVICE_STRINGS)]
    elif mutation == "colocate":
        node.attr["_class"].list.s.append(f"loc:@{other.name if c & 1 else 'gone'}".encode())
    elif mutation == "tensor":
        consts = [n for n in nodes if n.op == "Const"]
        target = _pick(consts, b)
        if target is not None:
            target.attr["value"].CopyFrom(_attr("tensor", c))
    elif mutation == "library":
        if not gd.library.function:
            added = gd.library.function.add()
            added.signature.name = ("f", "", "Identity", "f/g")[a % 4]
            added.node_def.add(name="n", op=OPS[b % len(OPS)])
        fdef = _pick(gd.library.function, a)
        inner = _pick(fdef.node_def, b)
        if inner is not None and c % 4 == 0:
            inner.op = OPS[c % len(OPS)]
        elif inner is not None and c % 4 == 1:
            inner.input.append(("gone", f"{inner.name}:output:0", "^gone")[c % 3])
        elif inner is not None and c % 4 == 2:
            inner.op = fdef.signature.name
        else:
            fdef.signature.name = _pick(gd.library.function, c).signature.name
    elif mutation == "collection" and meta.collection_def:
        key = sorted(meta.collection_def)[a % len(meta.collection_def)]
        col = meta.collection_def[key]
        if col.node_list.value:
            col.node_list.value[b % len(col.node_list.value)] = ("gone:0", other.name, "")[c % 3]
        elif col.bytes_list.value:
            col.bytes_list.value[b % len(col.bytes_list.value)] = bytes([c % 256]) * (c % 5)
        else:
            del meta.collection_def[key]


MUTATIONS = ("delete", "retype", "dangling", "extra", "drop", "rewire", "swap", "drop_attr",
             "mistype_attr", "extreme_attr", "duplicate", "rename", "cycle", "device", "colocate",
             "tensor", "library", "collection")

STEPS = st.lists(st.tuples(st.integers(0, len(MUTATIONS) - 1), st.integers(0, 1 << 16),
                           st.integers(0, 1 << 16), st.integers(0, 1 << 16)), min_size=1, max_size=3)


def test_fuzz_structural_mutations_fail_cleanly():
    tally = Tally("structural mutations")

    seen: set[bytes] = set()

    @fuzz(examples=800)
    @given(st.integers(0, len(bases()) - 1), STEPS, st.booleans())
    def check(index, steps, as_graph_def):
        meta = meta_graph_pb2.MetaGraphDef()
        meta.CopyFrom(bases()[index])
        for step in steps:
            _mutate(meta, *step)
        source = meta.graph_def if as_graph_def else meta
        key = source.SerializeToString(deterministic=True)
        if key in seen:  # a mutation that changed nothing, or a graph already checked
            tally.add("repeat")
            return
        seen.add(key)
        kind, _ = transform_cleanly(source, DEVICES)
        tally.add(kind)

    try:
        check()
    finally:
        tally.flush()
    assert tally.total - tally.counts["repeat"] >= 500 * min(1.0, SCALE), tally.counts
    assert tally.counts["crash"] == 0, tally.counts
