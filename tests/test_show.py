"""`replicate show`: the collapse to name-scope boxes, the pictures, and the command.

The collapse is checked on hand-built graphs (exact boxes, op and edge counts, groups)
and on real transforms (every op counted once, towers cut alike, within the budget).
The pictures: the SVG parses and names every tower and device, the PNG is a PNG of a
sensible size, the DOT text needs no Graphviz, and a missing ``dot`` is one clear error.
A ResNet-50 on 4 towers stays within the box budget. The command writes atomically,
refuses to overwrite without --force, and fails with exit 2 and one line.
"""

import importlib
import os
import re
import struct
import xml.etree.ElementTree as ET

import breadth_models
import models
import pytest
from tensorflow.core.framework import graph_pb2

import replicate
from replicate import cli
from replicate.errors import OutputError, ReplicateError
from replicate.graph.ir import IR
from replicate.viz import collapse, dot_source, partition, render, roles_from_analysis, show
from replicate.viz.collapse import MORE
from replicate.viz.groups import Roles, assign, tower_prefixes
from replicate.viz.layout import inversions, relabel, tower_classes

DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]
SVG = "{http://www.w3.org/2000/svg}"


# ---------------------------------------------------------------- partition


def _paths(*names):
    return [tuple(n.split("/")) for n in names]


def _boxes(cut, paths):
    return {cut.box(p) for p in paths}


def test_partition_opens_the_biggest_scope_and_keeps_the_budget():
    paths = _paths(*[f"big/s{i}/op{j}" for i in range(6) for j in range(5)], "small/a", "small/b")
    cut = partition(paths, max_nodes=8)
    boxes = _boxes(cut, paths)
    assert len(boxes) <= 8
    assert {("big", f"s{i}") for i in range(6)} <= boxes   # the big scope is opened
    assert ("small",) in boxes                              # the small one is not


def test_partition_budget_of_one_is_one_box_per_group():
    paths = _paths("a/b/c", "a/b/d", "a/e")
    assert len(_boxes(partition(paths, max_nodes=1), paths)) == 1


def test_partition_lumps_leftover_children_into_one_box():
    paths = _paths(*[f"s{i}/op{j}" for i in range(10) for j in range(3)])
    cut = partition(paths, max_nodes=4)
    boxes = _boxes(cut, paths)
    assert len(boxes) == 4 and (MORE,) in boxes
    assert len(cut.opened[()]) == 7 and {("s0",), ("s1",), ("s2",)} <= boxes


def test_partition_keeps_ops_and_gradient_scopes_closed():
    paths = _paths("MatMul", "MatMul/ReadVariableOp", "gradients/MatMul_grad/a",
                   "gradients/MatMul_grad/b", "gradients/MatMul_grad/c/d")
    boxes = _boxes(partition(paths, max_nodes=50), paths)
    assert boxes == {("MatMul",), ("gradients", "MatMul_grad")}


def test_partition_depth_limit():
    paths = _paths(*[f"a/b{i}/c{j}/op" for i in range(3) for j in range(3)])
    assert max(len(b) for b in _boxes(partition(paths, 100, depth=2), paths)) == 2
    assert max(len(b) for b in _boxes(partition(paths, 100), paths)) == 3


def test_partition_is_deterministic():
    paths = _paths(*[f"s{i % 7}/t{i % 3}/op{i}" for i in range(60)])
    assert partition(paths, 9).opened == partition(list(reversed(paths)), 9).opened


# ---------------------------------------------------------------- collapse (hand-built)


def _graph_def(nodes):
    gd = graph_pb2.GraphDef()
    for name, op, inputs, device in nodes:
        nd = gd.node.add(name=name, op=op, device=device)
        nd.input.extend(inputs)
    return gd


C, G0, G1 = "/device:CPU:0", "/device:GPU:0", "/device:GPU:1"


def _tiny():
    """Two towers of a dense layer, named as the passes name them (no TensorFlow needed)."""
    nodes = [("x", "Placeholder", [], C), ("w", "VarHandleOp", [], C), ("b", "VarHandleOp", [], C),
             ("w/Read", "ReadVariableOp", ["w"], C),
             ("replicate/split/x_0", "SplitV", ["x"], C)]
    for k, dev in enumerate((G0, G1)):
        t, g = f"tower_{k}", f"tower_{k}/gradients/dense/MatMul_grad"
        nodes += [(f"{t}/dense/read", "ReadVariableOp", ["w"], C),
                  (f"{t}/dense/MatMul", "MatMul", [f"replicate/split/x_0:{k}", f"{t}/dense/read"], dev),
                  (f"{t}/dense/bias", "ReadVariableOp", ["b"], C),
                  (f"{t}/dense/BiasAdd", "BiasAdd", [f"{t}/dense/MatMul", f"{t}/dense/bias"], dev),
                  (f"{t}/dense/Relu", "Relu", [f"{t}/dense/BiasAdd"], dev),
                  (f"{t}/AddN_1", "AddN", [f"{t}/dense/Relu"], dev),           # stray ops
                  (f"{t}/Identity_1", "Identity", [f"{t}/AddN_1"], dev),
                  (f"{t}/loss/Const", "Const", [], dev),
                  (f"{t}/loss/Mean", "Mean", [f"{t}/Identity_1", f"{t}/loss/Const"], dev),
                  (f"{t}/loss/value", "Identity", [f"{t}/loss/Mean"], dev),
                  (f"{g}/MatMul", "MatMul", [f"{t}/loss/Mean", f"{t}/dense/read"], dev),
                  (f"{g}/MatMul_1", "MatMul", [f"{g}/MatMul"], dev),
                  (f"{g}/Sum", "Sum", [f"{g}/MatMul_1"], dev),
                  (f"{g}/Reshape", "Reshape", [f"{g}/Sum"], dev)]
    nodes += [("replicate/aggregate/g", "AddN", [f"tower_{k}/gradients/dense/MatMul_grad/MatMul"
                                                 for k in range(2)], C),
              ("train/update_w/Apply", "ResourceApplyGradientDescent", ["w", "replicate/aggregate/g"], C),
              ("step", "NoOp", ["^train/update_w/Apply"], C)]
    return IR.from_graph_def(_graph_def(nodes))


def test_groups_from_names_and_op_types():
    groups, placed = assign(_tiny())
    assert [g.key for g in groups] == ["inputs", "variables", "split", "tower_0", "tower_1",
                                       "aggregate", "update", "shared"]
    assert placed["w/Read"] == "variables" and placed["tower_1/dense/read"] == "tower_1"
    assert placed["train/update_w/Apply"] == "update" and placed["x"] == "inputs"
    assert placed["step"] == "shared"
    assert tower_prefixes(["tower_0/a", "tower_1/b", "tower_3/c"]) == []   # not a 0..N-1 run


def test_collapse_counts_ops_devices_and_edges():
    boxes = collapse(_tiny(), max_nodes=4, shared_max_nodes=5)
    assert sum(a["ops"] for _, a in boxes.nodes(data=True)) == boxes.graph["nodes"] == 36
    dense = boxes.nodes["tower_1:dense"]
    assert dense["ops"] == 6 and dense["joined"] == 1           # AddN_1 joined the box it reads
    assert dense["devices"] == {C: 2, G1: 4}
    assert dense["types"]["ReadVariableOp"] == 2 and dense["types"]["AddN"] == 1
    assert boxes.nodes["tower_1:loss"]["ops"] == 4              # Identity_1 joined its consumer
    assert boxes.edges["split:", "tower_0:dense"]["data"] == 1
    assert boxes.edges["variables:", "tower_0:dense"]["data"] == 2
    assert boxes.edges["tower_0:dense", "tower_0:gradients/dense/MatMul_grad"]["data"] == 1
    assert boxes.edges["tower_0:gradients/dense/MatMul_grad", "aggregate:aggregate"]["data"] == 1
    assert boxes.edges["aggregate:aggregate", "update:train/update_w"]["data"] == 1
    assert boxes.edges["update:train/update_w", "shared:"] == {"data": 0, "control": 1}
    tower_scopes = [{a["scope"] for _, a in boxes.nodes(data=True) if a["group"] == g}
                    for g in ("tower_0", "tower_1")]
    assert tower_scopes[0] == tower_scopes[1] == {"dense", "loss", "gradients/dense/MatMul_grad"}
    assert not any(a["scope"].endswith(MORE) for _, a in boxes.nodes(data=True))


def test_collapse_with_one_box_per_group():
    boxes = collapse(_tiny(), max_nodes=1)
    groups = [a["group"] for _, a in boxes.nodes(data=True)]
    assert sorted(groups) == ["aggregate", "inputs", "shared", "split", "tower_0", "tower_1",
                              "update", "variables"]
    assert boxes.edges["tower_0:", "aggregate:aggregate"]["data"] == 1
    assert boxes.nodes["tower_0:"]["ops"] == 14


def test_only_identical_towers_are_relabelled():
    boxes = collapse(_tiny(), max_nodes=4)
    assert tower_classes(boxes) == [["tower_0", "tower_1"]]
    assert relabel(boxes, [1, 0]) == {"tower_1": "tower_0", "tower_0": "tower_1"}
    assert relabel(boxes, [0, 1]) == {} and inversions(boxes, [1, 0], {}) == 1
    ir = _tiny()
    ir.add("tower_1/dense/Extra", "NoOp", [], device=G1, defaults=False)   # tower 1 differs now
    uneven = collapse(ir, max_nodes=4)
    assert len(tower_classes(uneven)) == 2 and relabel(uneven, [1, 0]) == {}


def test_collapse_rejects_an_empty_budget():
    with pytest.raises(ValueError):
        collapse(_tiny(), max_nodes=0)


# ---------------------------------------------------------------- collapse (transforms)


@pytest.fixture(scope="module")
def mlp_result():
    return replicate.transform(models.mlp("adam").graph, DEVICES, controller="/cpu:0")


def test_collapse_of_a_transform(mlp_result):
    boxes = show.cluster_graph(mlp_result, max_nodes=12)
    nodes = boxes.nodes(data=True)
    assert sum(a["ops"] for _, a in nodes) == len(mlp_result.graph_def.node)
    kinds = {a["kind"] for _, a in nodes}
    assert {"inputs", "split", "tower", "aggregate", "update", "variables", "outputs"} <= kinds
    for k, device in enumerate(mlp_result.towers.devices):
        mine = [a for _, a in nodes if a["group"] == f"tower_{k}"]
        assert 3 <= len(mine) <= 12
        assert sum(a["devices"][device] for a in mine) > sum(a["ops"] for a in mine) / 2
        assert any(boxes.nodes[s]["kind"] == "split" for s, _ in boxes.in_edges(
            [n for n, a in nodes if a["group"] == f"tower_{k}"]))
    # every variable is in the one variables box, on the controller
    variables = [a for _, a in nodes if a["kind"] == "variables"]
    assert len(variables) == 1 and set(variables[0]["devices"]) == {"/device:CPU:0"}


def test_roles_from_analysis_know_the_train_op(mlp_result):
    roles = roles_from_analysis(mlp_result.analysis)
    assert isinstance(roles, Roles) and "train" in roles.update
    assert {"x", "y"} <= roles.inputs and "model/w1" in roles.variables


# ---------------------------------------------------------------- pictures


def _svg_texts(data):
    root = ET.fromstring(data)
    return root, " ".join(t.text or "" for t in root.iter(f"{SVG}text"))


def test_svg_parses_and_names_every_tower_and_device(mlp_result):
    data = show.picture(mlp_result, "svg", max_nodes=12)
    root, texts = _svg_texts(data)
    assert root.tag == f"{SVG}svg"
    for k in range(3):
        assert f"tower {k} · /cpu:{k + 1}" in texts
    for part in ("split of the batch", "gradient aggregation", "optimizer update", "controller"):
        assert part in texts
    assert "exact" in texts and "3 towers" in texts


def _tower_columns(svg):
    """Tower numbers in the SVG's cluster captions, left to right."""
    found = re.findall(rb'<text[^>]*x="([\d.]+)"[^>]*>tower (\d+) ', svg)
    return [int(k) for _, k in sorted((float(x), k) for x, k in found)]


def test_towers_read_left_to_right_in_order(mlp_result):
    assert _tower_columns(show.picture(mlp_result, "svg")) == [0, 1, 2]
    four = replicate.transform(models.cnn().graph, [f"/gpu:{k}" for k in range(4)])
    assert _tower_columns(show.picture(four, "svg")) == [0, 1, 2, 3]


def _png_size(data):
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_png_is_a_png_of_a_sensible_size(mlp_result):
    width, height = _png_size(show.picture(mlp_result, "png", max_nodes=12))
    assert 600 < width < 4000 and 400 < height < 4000


def test_dot_text_needs_no_graphviz_and_is_deterministic(mlp_result, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))     # no `dot` on PATH
    data = show.picture(mlp_result, "dot")
    assert data.startswith(b"digraph") and data == show.picture(mlp_result, "dot")
    assert b"cluster_" in data and b"lhead=" in data
    # pygraphviz's wheel carries Graphviz: pictures need no `dot` program...
    assert show.picture(mlp_result, "svg").lstrip().startswith(b"<?xml")
    # ...and without pygraphviz or `dot`, one clear error says what to install.
    monkeypatch.setattr(importlib.import_module("replicate.viz.render"), "_pygraphviz", lambda: None)
    with pytest.raises(ReplicateError, match=r"'dot' program is not on PATH.*apt-get install graphviz"):
        show.picture(mlp_result, "svg")


def _drawn_edges(source):
    return [line for line in source.splitlines() if " -> " in line and "invis" not in line]


def test_bundled_edges_join_each_pair_of_groups(mlp_result):
    boxes = show.cluster_graph(mlp_result)
    assert len(_drawn_edges(dot_source(boxes, bundle=False))) == boxes.number_of_edges()
    bundled = _drawn_edges(dot_source(boxes))
    inner = [e for e in boxes.edges if boxes.nodes[e[0]]["group"] == boxes.nodes[e[1]]["group"]]
    pairs = {(boxes.nodes[a]["group"], boxes.nodes[b]["group"]) for a, b in boxes.edges
             if boxes.nodes[a]["group"] != boxes.nodes[b]["group"]}
    assert len(bundled) == len(inner) + len(pairs) < boxes.number_of_edges()
    into_tower = sum(boxes.edges[e]["data"] for e in boxes.edges
                     if boxes.nodes[e[0]]["kind"] == "split" and boxes.nodes[e[1]]["group"] == "tower_0")
    assert into_tower >= 2        # x and y at least
    ids = {node: f"n{i}" for i, node in enumerate(boxes.nodes)}
    split_ids = {ids[n] for n in boxes.nodes if boxes.nodes[n]["kind"] == "split"}
    split_edges = [line for line in bundled if "lhead=" in line and line.split()[0] in split_ids
                   and re.search(rf"\btaillabel={into_tower}\b", line)]
    assert len(split_edges) == 3 and len({line.split()[0] for line in split_edges}) == 1


def test_render_rejects_unknown_formats(mlp_result):
    with pytest.raises(ReplicateError, match="jpeg"):
        render(show.cluster_graph(mlp_result), "jpeg")
    with pytest.raises(OutputError, match=r"\.jpg"):
        show.picture_format("towers.jpg")


def test_resnet50_on_four_towers_stays_readable(tmp_path):
    graph = breadth_models.slim_resnet(full=True).graph
    devices = [f"/gpu:{k}" for k in range(4)]
    shown = show.show(graph, devices, str(tmp_path / "resnet.svg"), max_nodes=24)
    towers = [[a for _, a in shown.boxes.nodes(data=True) if a["group"] == f"tower_{k}"]
              for k in range(4)]
    assert all(12 <= len(t) <= 24 for t in towers)
    assert all({a["scope"] for a in t} == {a["scope"] for a in towers[0]} for t in towers)
    assert any("block3" in a["scope"] for a in towers[0])
    assert shown.boxes.number_of_nodes() < 120
    svg = open(tmp_path / "resnet.svg", "rb").read()
    root, texts = _svg_texts(svg)
    assert all(f"tower {k} · /gpu:{k}" in texts for k in range(4))
    assert _tower_columns(svg) == [0, 1, 2, 3]
    width_pt = float(root.get("width").removesuffix("pt"))
    assert width_pt < 4000            # four towers side by side, not a 20,000-point strip


# ---------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def meta_file(tmp_path_factory):
    import tensorflow as tf

    path = str(tmp_path_factory.mktemp("show") / "mlp.meta")
    tf.compat.v1.train.export_meta_graph(path, graph=models.mlp("sgd").graph)
    return path


def _main(capsys, *args):
    code = cli.main(["show", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_writes_svg_png_and_dot(meta_file, tmp_path, capsys):
    for ext in ("svg", "png", "dot"):
        out = tmp_path / f"towers.{ext}"
        code, stdout, _ = _main(capsys, meta_file, "--devices", "/cpu:1,/cpu:2", "-o", out)
        assert code == 0 and f"wrote {out} ({ext}, 2 towers" in stdout
    assert _png_size((tmp_path / "towers.png").read_bytes())[0] > 500
    assert "tower 1 · /cpu:2" in _svg_texts((tmp_path / "towers.svg").read_bytes())[1]
    assert (tmp_path / "towers.dot").read_text().startswith("digraph")
    assert sorted(os.listdir(tmp_path)) == ["towers.dot", "towers.png", "towers.svg"]


def test_cli_refuses_to_overwrite_without_force(meta_file, tmp_path, capsys):
    out = tmp_path / "towers.svg"
    out.write_text("keep me")
    code, stdout, err = _main(capsys, meta_file, "--devices", "/cpu:1,/cpu:2", "-o", out)
    assert code == 2 and stdout == "" and out.read_text() == "keep me"
    assert err.strip().splitlines() == [f"replicate show: error: {out}: already exists "
                                        "(use --force to overwrite)"]
    code, _, _ = _main(capsys, meta_file, "--devices", "/cpu:1,/cpu:2", "-o", out, "--force",
                       "--max-nodes", "6", "--depth", "1", "-q")
    assert code == 0 and out.read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize("args, message", [
    (["--devices", "/cpu:1", "-o", "{tmp}/t.jpg"], "unknown picture type '.jpg'"),
    (["--devices", "/cpu:1,/cpu:1", "-o", "{tmp}/t.svg"], "listed twice"),
    (["--devices", "/cpu:1", "-o", "{tmp}/no/such/dir/t.svg"], "does not exist"),
    (["--devices", "/cpu:1", "-o", "{tmp}/t.svg", "--loss", "nope:0"], "nope"),
])
def test_cli_errors_are_one_line_and_write_nothing(meta_file, tmp_path, capsys, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    code, stdout, err = _main(capsys, meta_file, *args)
    lines = err.strip().splitlines()
    assert code == 2 and stdout == "" and len(lines) == 1 and message in lines[0]
    assert lines[0].startswith("replicate show: error: ")
    assert os.listdir(tmp_path) == []


def test_cli_without_dot_says_how_to_install_it(meta_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(importlib.import_module("replicate.viz.render"), "_pygraphviz", lambda: None)
    code, _, err = _main(capsys, meta_file, "--devices", "/cpu:1,/cpu:2", "-o", tmp_path / "t.png")
    assert code == 2 and "apt-get install graphviz" in err and len(err.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == []
