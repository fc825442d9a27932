"""Unit tests per pass on tiny hand-built graphs: structural asserts, order-insensitive."""

import models
import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.api import prepare
from replicate.errors import PassError
from replicate.graph.ir import IR
from replicate.passes.aggregate import Aggregate
from replicate.passes.clone import Clone
from replicate.passes.pipeline import run_pipeline
from replicate.passes.place import Place
from replicate.passes.rewire import Rewire
from replicate.passes.split import Split
from replicate.passes.validate import Validate

v1 = tf.compat.v1
DEVICES = ["/device:CPU:1", "/device:CPU:2"]
CONTROLLER = "/device:CPU:0"


def tiny(static_batch=None, resource=True):
    """x -> matmul(w) -> mean square loss -> SGD, plus accuracy-like forward leaf."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [static_batch, 3], name="x")
        with v1.variable_scope("", use_resource=resource):
            w = v1.get_variable("w", [3, 2])
        out = tf.matmul(x, w, name="out")
        loss = tf.reduce_mean(tf.square(out), name="loss")
        tf.reduce_max(out, name="peak")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return graph


def run_until(graph, last, **options):
    ir, _, analyze = prepare(graph)
    passes = [analyze, Place(CONTROLLER), Split(DEVICES, CONTROLLER), Clone(),
              Aggregate(CONTROLLER), Rewire(CONTROLLER), Validate()]
    names = [p.name for p in passes]
    ir, _ = run_pipeline(ir, passes[: names.index(last) + 1])
    return ir


def test_ancestors_walk_the_nodes_as_the_networkx_view_does():
    """``IR.ancestors`` without a view walks the nodes' own inputs: the same sets, with and
    without control edges, for every node of a rewrite (control edges included)."""
    ir = run_until(tiny(), "rewire")
    with_control, data_only = ir.to_networkx(), ir.to_networkx(control=False)
    assert any(n.control for n in ir)
    for name in ir.nodes:
        assert ir.ancestors([name]) == ir.ancestors([name], with_control), name
        assert ir.ancestors([name], control=False) == ir.ancestors([name], data_only), name
    assert ir.ancestors(["train"], stop=["loss"]) == ir.ancestors(["train"], with_control, stop=["loss"])


def test_one_walk_finds_the_ancestors_of_many_writes_through_a_loop():
    """``_evict.reaching`` (one walk for every write run once) marks exactly the ancestors
    ``IR.ancestors`` finds for each target, in a graph whose TF1 while loop has back edges
    (a cycle) and a graph given in reverse order (nodes later than their consumers)."""
    from replicate.passes._evict import reaching

    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        with v1.variable_scope("", use_resource=False):
            a, b = v1.get_variable("a", [3]), v1.get_variable("b", [])
        v1.disable_control_flow_v2()
        try:
            h = tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * a), [0, x])[1]
        finally:
            v1.enable_control_flow_v2()
        v1.assign_add(b, tf.reduce_sum(h), name="late")
        v1.assign(a, tf.reduce_mean(x, 0), name="early")
        v1.assign_sub(b, tf.reduce_sum(a), name="other")
    for order in (1, -1):
        definition = graph.as_graph_def()
        nodes = list(definition.node)[::order]
        del definition.node[:]
        definition.node.extend(nodes)
        ir = IR.from_graph_def(definition)
        view = ir.to_networkx()
        assert any(n.op == "NextIteration" for n in ir)
        targets = ["late", "early", "other", "x"]
        masks = reaching(ir, view, targets)
        for i, target in enumerate(targets):
            assert {n for n, m in masks.items() if m >> i & 1} == ir.ancestors([target], view), target


def test_analyze_roles():
    ir = run_until(tiny(), "analyze")
    a = ir.facts["analysis"]
    assert a.train_op == "train"
    assert a.loss == "loss:0"
    assert [b.tensor for b in a.batch_inputs] == ["x:0"]
    assert set(a.variables) == {"w"}
    assert [(o.optimizer, o.variable) for o in a.apply_ops] == [("GradientDescent", "w")]
    assert {f.role for f in a.frontier} == {"dense"} and len(a.frontier) == 1
    assert {"out", "loss"} <= set(a.region) and "w" not in a.region and "x" not in a.region
    assert {o.tensor: o.role for o in a.outputs}["loss:0"] == "mean"
    assert {o.tensor: o.role for o in a.outputs}["out:0"] == "concat"
    assert not a.reasons


def test_analyze_leaves_the_graph_unchanged():
    graph = tiny()
    before = graph.as_graph_def().SerializeToString(deterministic=True)
    ir = run_until(graph, "analyze")
    assert len(ir) == len(graph.as_graph_def().node)
    replicate.transform(graph, DEVICES)
    assert graph.as_graph_def().SerializeToString(deterministic=True) == before


def test_place_puts_variables_and_their_readers_on_the_controller():
    ir = run_until(tiny(), "place")
    assert ir.node("w").device == CONTROLLER
    assert ir.node("train/update_w/ResourceApplyGradientDescent").device == CONTROLLER


def test_place_spreads_variables_by_size():
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        big = v1.get_variable("big", [4, 100])
        small = [v1.get_variable(f"s{i}", [100, 1]) for i in range(3)]
        loss = tf.reduce_mean(tf.add_n([tf.matmul(tf.matmul(x, big), s) for s in small]))
        v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    ir, _, analyze = prepare(graph)
    ps = ["/device:CPU:2", "/device:CPU:3"]
    run_pipeline(ir, [analyze, Place(CONTROLLER, ps)])
    devices = ir.facts["var_devices"]
    assert devices["big"] != devices["s0"]
    assert {devices[f"s{i}"] for i in range(3)} == {ps[1]}


def test_split_makes_one_slice_per_tower():
    ir = run_until(tiny(), "split")
    split = ir.node("replicate/split/x_0")
    assert split.op == "SplitV" and split.attr("num_split") == 2
    towers = ir.facts["towers"]
    assert [t["x:0"] for t in towers.inputs] == ["replicate/split/x_0:0", "replicate/split/x_0:1"]
    assert towers.static_counts is None and len(towers.counts) == 2


def test_split_static_batch_uses_constant_counts():
    ir = run_until(tiny(static_batch=5), "split")
    assert ir.facts["towers"].static_counts == [3, 2]


def test_clone_copies_region_per_tower_with_devices():
    ir = run_until(tiny(), "clone")
    for k, device in enumerate(DEVICES):
        node = ir.node(f"tower_{k}/out")
        assert node.device == device
        assert node.inputs[0] == f"replicate/split/x_0:{k}" if k else node.inputs[0] == "replicate/split/x_0"
        read = next(n for n in node.inputs if "ReadVariableOp" in n)
        assert read.startswith(f"tower_{k}/")
        assert ir.node(read).device == CONTROLLER      # reads stay with the variable
    assert "out" in ir  # originals stay until rewire


def test_each_tower_weighs_its_loss_by_its_share():
    """A mean loss is weighed where its gradient enters each tower (one scalar multiply), so
    the aggregate only adds the towers' gradients (no multiply per parameter per tower)."""
    res = replicate.transform(tiny(), DEVICES, controller=CONTROLLER)
    nodes = {n.name: n for n in res.graph_def.node}
    (aggregate,) = res.aggregates.values()
    assert nodes[aggregate].op == "AddN" and len(nodes[aggregate].input) == 2
    assert not {nodes[i].op for i in nodes[aggregate].input} & {"MulNoNan", "Mul"}
    weighed = [n for n in nodes if "/replicate/weigh/" in n]
    assert sorted(n.split("/")[0] for n in weighed) == ["tower_0", "tower_1"], weighed


def test_rewire_removes_originals_and_merges_under_original_names():
    ir = run_until(tiny(), "rewire")
    assert ir.node("out").op == "ConcatV2"
    assert ir.node("loss").op == "AddN"
    peak = ir.node("peak")      # outside the region: computed once on the merged output
    assert peak.op == "Max" and peak.inputs[0] == "out"
    apply = ir.node("train/update_w/ResourceApplyGradientDescent")
    assert apply.inputs[2].startswith("replicate/aggregate/")


def test_validate_rejects_dangling_inputs_and_cross_tower_edges():
    ir = run_until(tiny(), "rewire")
    ir.set_input("tower_1/out", 0, "tower_0/out")
    with pytest.raises(Exception, match="reads"):
        Validate().run(ir)
    graph_def = tiny().as_graph_def()
    graph_def.node[-1].input.append("nowhere")
    bad = IR.from_graph_def(graph_def)
    with pytest.raises(Exception, match="does not exist"):
        Validate().run(bad)


def test_pipeline_names_the_failing_pass():
    class Broken:
        name = "broken"

        def run(self, ir):
            raise RuntimeError("boom")

    ir, _, analyze = prepare(tiny())
    with pytest.raises(PassError, match=r"^internal error in pass 'broken' \(after analyze\): "
                                        r"RuntimeError: boom; this is a bug in replicate"):
        run_pipeline(ir, [analyze, Broken()])


def test_verify_each_and_dump_dir(tmp_path):
    res = replicate.transform(tiny(), DEVICES, verify_each=True, dump_dir=str(tmp_path))
    dumps = sorted(p.name for p in tmp_path.iterdir())
    assert dumps[0] == "00_analyze.pbtxt" and dumps[-1].endswith("_validate.pbtxt")
    assert res.report.exact


@pytest.mark.parametrize("resource", [True, False])
def test_transform_is_deterministic(resource):
    model = models.mlp("adam", resource)
    first = replicate.transform(model.graph, DEVICES).graph_def.SerializeToString(deterministic=True)
    again = replicate.transform(model.graph, DEVICES).graph_def.SerializeToString(deterministic=True)
    assert first == again
    meta = v1.train.export_meta_graph(graph=model.graph)
    third = replicate.transform(meta, DEVICES).graph_def
    assert [n.SerializeToString(deterministic=True) for n in third.node] == [
        n.SerializeToString(deterministic=True) for n in replicate.transform(model.graph, DEVICES).graph_def.node]


def test_names_are_preserved():
    model = models.mlp("adam")
    before = {n.name for n in model.graph.as_graph_def().node}
    res = replicate.transform(model.graph, DEVICES)
    after = {n.name for n in res.graph_def.node}
    for name in ("train", "loss", "logits", "accuracy", "predictions", "x", "y", "global_step",
                 "model/w1", "model/w1/Adam", "beta1_power"):
        assert name in before and name in after, name
    assert res.tower_losses[1].name == "tower_1/loss:0"
    assert res.tower_tensor("logits:0", 0).name == "tower_0/logits:0"
    assert [v.op.name for _, v in res.grads_and_vars] == ["model/w1", "model/b1", "model/w2", "model/b2"]


def test_ops_without_a_gpu_kernel_stay_on_the_towers_host():
    graph = tf.Graph()
    with graph.as_default():
        text = v1.placeholder(tf.string, [None], name="text")
        x = tf.strings.to_number(tf.strings.join([text, "1"]), name="number")
        w = v1.get_variable("w", [])
        loss = tf.reduce_mean(tf.square(x * w), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    gpus = ["/job:worker/task:0/device:GPU:0", "/job:worker/task:1/device:GPU:0"]
    res = replicate.transform(graph, gpus, controller="/job:ps/task:0/device:CPU:0")
    nodes = {n.name: n.device for n in res.graph_def.node}
    assert nodes["tower_1/StringJoin"] == "/job:worker/task:1/device:CPU:0"
    assert nodes["tower_1/mul"] == gpus[1]
    assert any("no kernel" in w for w in res.report.warnings)


def test_gpu_controller_keeps_the_input_pipeline_on_its_host():
    model = models.dataset_mlp()
    res = replicate.transform(model.graph, ["/gpu:0", "/gpu:1"], controller="/gpu:0")
    nodes = {n.name: n for n in res.graph_def.node}
    assert nodes["IteratorGetNext"].device == "/device:CPU:0"
    assert nodes["model/w1"].device == "/device:GPU:0"


@pytest.mark.parametrize("optimizer,resource", [("sgd", True), ("adam", True), ("momentum", False)])
def test_grads_and_vars_are_the_aggregated_gradients(optimizer, resource):
    """Result.grads_and_vars pairs each variable with the gradient its update reads, which has
    one device's value on the same batch (it returned the variable's handle)."""
    model = models.mlp(optimizer, resource=resource)
    res = replicate.transform(model.graph, ["/cpu:1", "/cpu:2", "/cpu:3"])
    feed = model.feeds(7, steps=1)[0]
    with model.graph.as_default():
        loss = model.graph.get_tensor_by_name("loss:0")
        variables = v1.trainable_variables()
        grads = tf.gradients(loss, variables)
        init = v1.global_variables_initializer()
    config = v1.ConfigProto(device_count={"CPU": 4})
    with v1.Session(graph=model.graph, config=config) as sess:
        sess.run(init)
        single = dict(zip([v.op.name for v in variables], sess.run(grads, feed)))
    pairs = res.grads_and_vars
    with res.graph.as_default():
        init = v1.global_variables_initializer()
    with v1.Session(graph=res.graph, config=config) as sess:
        sess.run(init)
        multi = sess.run([g for g, _ in pairs], feed)
    assert sorted(v.op.name for _, v in pairs) == sorted(single)
    for (g, v), value in zip(pairs, multi):
        assert g.dtype.base_dtype == tf.float32 and g.shape.as_list() == v.shape.as_list()
        np.testing.assert_allclose(value, single[v.op.name], rtol=1e-5, atol=1e-7)


def test_an_unmergeable_forward_tensor_stays_fetchable():
    """A forward tensor of the towers that they cannot merge (a Python function's result,
    which the loss reads through a named identity) keeps its name, with tower 0's value and
    a warning naming it: it used to vanish from the graph, and a driver fetching it by name
    failed with a KeyError."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        w = v1.get_variable("w", [3], use_resource=True)
        rows = tf.reduce_sum(x * w, axis=1)
        value = tf.py_function(lambda r: np.float32(np.prod(r.numpy())), [rows], tf.float32)
        scale = tf.stop_gradient(tf.identity(tf.reshape(value, []), name="prod"))
        loss = tf.reduce_mean(tf.square(rows) * scale, name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    raw = value.name
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2"])
    res.graph.get_tensor_by_name(raw)
    assert any(f"'{raw}'" in w and "forward tensors cannot be merged" in w
               for w in res.report.warnings), res.report.warnings


def test_values_a_driver_sees_from_tower_zero_are_all_named_first():
    """Every fetchable tensor that holds tower 0's value is named, in the report's first lines
    and in one untruncated warning (four here: the warning showed three and '... 1 more')."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        w = v1.get_variable("w", [3], use_resource=True)
        rows = tf.reduce_sum(x * w, axis=1)
        scale = 1.0
        for k in range(4):          # Python functions the loss needs in every tower
            value = tf.py_function(lambda r, k=k: np.float32(np.prod(r.numpy() + k)), [rows],
                                   tf.float32)
            value = tf.identity(tf.reshape(value, []), name=f"prod{k}")
            v1.summary.scalar(f"s{k}", value)
            scale = scale * tf.stop_gradient(value)
        loss = tf.reduce_mean(tf.square(rows) * scale, name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2"])
    names = [f"prod{k}:0" for k in range(4)]
    assert res.report.tower0_values == names + ["loss:0"]      # the loss mixes them too
    lines = str(res.report).splitlines()
    assert lines[1].startswith("  NOT MERGED") and all(n in lines[1] for n in names)
    assert any(all(n in w for n in names) for w in res.report.warnings)
