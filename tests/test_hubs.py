"""Control hubs (replicate/graph/hubs.py): a control set many nodes share goes through one NoOp
inside the IR, and the output has the user's control edges as if there had been no hub."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare
from replicate.graph import hubs
from replicate.graph.ir import IR

v1 = tf.compat.v1


def bn_model(layers=8, batch_norm_deps=True):
    """An MLP of ``layers`` batch-normalized layers whose ``minimize`` runs under
    ``control_dependencies(UPDATE_OPS)``, as the tf.layers documentation recommends: every
    gradient op without another input waits for all 2 x ``layers`` moving-average updates."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(5)
        x = v1.placeholder(tf.float32, [None, 6], name="x")
        y = v1.placeholder(tf.float32, [None, 1], name="y")
        net = x
        for i in range(layers):
            with v1.variable_scope(f"layer{i}"):
                w = v1.get_variable("w", [net.shape[-1], 6],
                                    initializer=v1.truncated_normal_initializer(stddev=0.5, seed=i))
                net = tf.matmul(net, w)
                mean, var = tf.nn.moments(net, [0])
                for stat, value in (("mean", mean), ("var", var)):
                    moving = v1.get_variable(f"moving_{stat}", [6], trainable=False,
                                             initializer=v1.zeros_initializer())
                    v1.add_to_collection(v1.GraphKeys.UPDATE_OPS,
                                         v1.assign_sub(moving, 0.1 * (moving - value)))
                net = tf.nn.relu((net - mean) * tf.math.rsqrt(var + 1e-3))
        loss = tf.reduce_mean(tf.square(tf.reduce_sum(net, 1, keepdims=True) - y), name="loss")
        step = v1.train.get_or_create_global_step()
        deps = v1.get_collection(v1.GraphKeys.UPDATE_OPS) if batch_norm_deps else []
        with tf.control_dependencies(deps):
            v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step, name="train")
    return graph


def entries(graph_def):
    """A GraphDef's (name, op, control inputs), as the loader hands them to hubs.plan."""
    return [(n.name, n.op, [i[1:] for i in n.input if i.startswith("^")]) for n in graph_def.node]


def feeds(batch, steps=3):
    rng = np.random.RandomState(0)
    return [{"x:0": rng.randn(batch, 6).astype(np.float32),
             "y:0": rng.randn(batch, 1).astype(np.float32)} for _ in range(steps)]


def shape_of(graph_def):
    """Every node's op, data inputs, control set, device and attributes."""
    return {n.name: (n.op, tuple(i for i in n.input if not i.startswith("^")),
                     frozenset(i for i in n.input if i.startswith("^")), n.device,
                     {k: v.SerializeToString() for k, v in n.attr.items()})
            for n in graph_def.node}


def test_plan_finds_the_shared_set_and_the_ir_round_trips():
    graph_def = bn_model().as_graph_def()
    members, names = hubs.plan(entries(graph_def))
    assert names == ["replicate/control_hub_0"]
    assert len(members[0]) == 16 and all("Assign" in m or "moving" in m for m in members[0])
    plain, hubbed = IR.from_graph_def(graph_def), IR.from_graph_def(graph_def, hubs=True)
    assert hubbed.nodes[names[0]].op == "NoOp" and hubs.is_hub(hubbed.nodes[names[0]].attrs)
    assert hubbed.edge_count() < plain.edge_count() / 2
    assert shape_of(hubbed.to_graph_def()) == shape_of(plain.to_graph_def())


def test_no_hub_below_the_thresholds_or_in_tf1_control_flow():
    assert hubs.plan(entries(bn_model(layers=7).as_graph_def())) == ([], [])      # 14 members
    assert hubs.plan(entries(bn_model(batch_norm_deps=False).as_graph_def())) == ([], [])
    graph = bn_model()
    with graph.as_default():
        v1.disable_control_flow_v2()
        try:
            tf.cond(v1.placeholder_with_default(True, []), lambda: tf.constant(1.0),
                    lambda: tf.constant(2.0))
        finally:
            v1.enable_control_flow_v2()
    assert hubs.plan(entries(graph.as_graph_def())) == ([], [])


def test_hub_names_avoid_the_graphs_own():
    graph = bn_model()
    with graph.as_default():
        tf.no_op(name="replicate/control_hub_0")
    assert hubs.plan(entries(graph.as_graph_def()))[1] == ["replicate/control_hub_1"]


def test_nested_hubs_expand_transitively():
    assert hubs.expand(["a", "h1", "b"], {"h1": ["c", "h2"], "h2": ["d", "a"]}) == \
        ["a", "c", "d", "b"]


@pytest.mark.parametrize("options", [
    dict(devices=3), dict(devices=2, accumulate=2), dict(devices=3, batch_norm="sync"),
    dict(devices=2, aggregation="allreduce"),
])
def test_the_rewrite_is_the_same_with_and_without_hubs(monkeypatch, options):
    graph = bn_model()
    devices = [f"/cpu:{i}" for i in range(options.pop("devices"))]
    monkeypatch.setattr(hubs, "MIN_MEMBERS", 10 ** 9)
    plain = replicate.transform(graph, devices, **options)
    monkeypatch.setattr(hubs, "MIN_MEMBERS", 16)
    hubbed = replicate.transform(graph, devices, **options)
    assert not any(n.op == "NoOp" and n.name.startswith("replicate/control_hub")
                   for n in hubbed.graph_def.node)
    assert shape_of(hubbed.graph_def) == shape_of(plain.graph_def)
    assert hubbed.report.exact == plain.report.exact


def test_with_small_thresholds_the_rewrite_is_the_same_and_exact(monkeypatch):
    """Hubs over every shared set of two or more: the same output, and it trains as one
    device does with synchronized statistics (batch 7 on 3 towers; batch 2, an empty tower)."""
    graph = bn_model(layers=3)
    plain = replicate.transform(graph, [f"/cpu:{i}" for i in range(3)], batch_norm="sync")
    monkeypatch.setattr(hubs, "MIN_MEMBERS", 2)
    monkeypatch.setattr(hubs, "MIN_USES", 2)
    assert hubs.plan(entries(graph.as_graph_def()))[1]
    hubbed = replicate.transform(graph, [f"/cpu:{i}" for i in range(3)], batch_norm="sync")
    assert shape_of(hubbed.graph_def) == shape_of(plain.graph_def)
    assert hubbed.report.exact, hubbed.report.reasons
    for batch in (7, 2):
        result = compare(graph, hubbed.meta_graph_def, "train", feeds(batch))
        assert result.max_rel < 1e-5, (batch, result)
