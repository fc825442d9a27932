"""Issue 4: model families beyond MLPs transform, train, and are exact where exact is possible."""

import breadth_models as bm
import numpy as np
import pytest
from test_equivalence import CPUS, check

import replicate
from replicate.check.equivalence import Trainer


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adagrad", "momentum", "ftrl"])
@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
def test_sparse_gradients_stay_sparse(optimizer, resource):
    model = bm.embedding(optimizer, resource)
    res, _ = check(model, towers=3, batch=10)
    assert res.report.gradients.get("sparse_values") == 1
    assert res.report.gradients.get("sparse_indices") == 1
    table = next(a for a in res.analysis.apply_ops if a.variable == "m/embedding")
    nodes = {n.name: n for n in res.graph_def.node}
    # The optimizer reads concatenated slices, never a dense [50, 4] tensor.
    producers = _ancestor_ops(nodes, table.grad, depth=6)
    assert "ConcatV2" in producers and "UnsortedSegmentSum" not in {
        nodes[n].op for n in nodes if n.startswith("replicate/aggregate/")}


def _ancestor_ops(nodes, ref, depth):
    seen, work, ops = set(), [ref.split(":")[0]], set()
    for _ in range(depth):
        nxt = []
        for name in work:
            if name in seen or name not in nodes:
                continue
            seen.add(name)
            ops.add(nodes[name].op)
            nxt.extend(i.lstrip("^").split(":")[0] for i in nodes[name].input)
        work = nxt
    return ops


@pytest.mark.parametrize("loss,optimizer,resource,static,num_true", [
    ("nce", "adam", True, False, 1), ("nce", "sgd", False, True, 1), ("nce", "adagrad", True, True, 2),
    ("sampled_softmax", "momentum", False, False, 1), ("sampled_softmax", "adam", True, True, 1),
    ("sampled_softmax", "sgd", True, False, 2)])
def test_sampled_losses_are_exact(loss, optimizer, resource, static, num_true):
    """nce_loss and sampled_softmax_loss: one draw of the sampler per step for the whole batch,
    the towers' sparse gradients of the shared sampled rows add up (static and dynamic batch,
    dense and deduplicated sparse updates, several true classes, an uneven split)."""
    model = bm.sampled(loss, optimizer, resource, batch=10 if static else None, num_true=num_true)
    res, result = check(model, towers=3, batch=10)
    assert res.report.exact, str(res.report)
    assert {"m/out_w", "m/out_b", "m/embedding"} <= set(result.per_variable) - set(result.unchanged)
    assert res.report.gradients.get("sparse_values") == 3
    samplers = [n for n in res.graph_def.node if n.op == "LogUniformCandidateSampler"]
    assert len(samplers) == 1 and not samplers[0].name.startswith("tower_"), \
        "the sampler must draw once for the whole batch"


@pytest.mark.parametrize("options", [{"param_devices": "mirrored"}, {"aggregation": "packed_allreduce"},
                                     {"accumulate": 2}], ids=["mirrored", "packed_allreduce", "accumulate"])
def test_sampled_losses_under_other_strategies(options):
    res, _ = check(bm.sampled("nce", "adam"), towers=3, batch=7, **options)
    assert res.report.exact, str(res.report)
    if "param_devices" in options:
        assert any(n.name.startswith("replicate/mirror_") for n in res.graph_def.node)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "moments"])
@pytest.mark.parametrize("towers,batch", [(2, 8), (3, 10)])
def test_sync_batch_norm_is_exact(fused, towers, batch):
    res, _ = check(bm.batch_norm_cnn(fused), towers=towers, batch=batch, batch_norm="sync")
    assert res.report.exact, str(res.report)
    assert res.report.synced, "no batch statistics were synchronized"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "moments"])
def test_tower0_batch_norm_is_reported(fused):
    model = bm.batch_norm_cnn(fused)
    res = replicate.transform(model.graph, CPUS[:2])
    assert not res.report.exact
    named = " ".join(r.node for r in res.report.reasons)
    assert "bn1" in named and "bn2" in named
    assert any("sync" in r.fix for r in res.report.reasons)
    assert res.report.batch_norm["mode"] == "tower0" and res.report.batch_norm["ops"]


@pytest.mark.parametrize("mode", ["tower0", "sync"])
def test_moving_statistics_move_once_per_step(mode):
    momentum, towers, batch = 0.9, 2, 8
    model = bm.batch_norm_inputs(momentum)
    res = replicate.transform(model.graph, CPUS[:towers], batch_norm=mode)
    trainer = Trainer(res.meta_graph_def, "train")
    feed = model.feeds(batch, steps=1)[0]
    trainer.step(feed)
    got = trainer.values()["bn/moving_mean"]
    trainer.close()
    # The batch mean merges exactly across towers (a weighted mean), so in both modes the
    # moving mean is updated once from the global batch; in tower0 mode only the moving
    # variance (computed around each tower's own mean) stays tower 0's, and is reported.
    seen = feed["x:0"]
    expected = (1 - momentum) * seen.mean(axis=0)      # moving mean starts at 0, updated once
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    twice = expected + (1 - momentum) * (seen.mean(axis=0) - expected)
    assert not np.allclose(got, twice, rtol=1e-3)
    reported = [r.node for r in res.report.reasons if "state update" in r.what]
    assert (mode == "tower0") == bool(reported) and all("moving_variance" in n or "AssignMovingAvg_1" in n
                                                       for n in reported), reported


@pytest.mark.parametrize("towers", [2, 4])
def test_static_batch_lstm_with_tf1_while_loops(towers):
    """A static batch of 6 and ``zero_state(6)``: the towers' TensorArrays must not insist on
    6 rows, and per-tower constants inside the gradient loop stay in its frame (both failed:
    an InternalError at import, then a frame error at the first step). 4 towers: 2, 2, 1, 1."""
    res, _ = check(bm.lstm(1, static_batch=6), towers=towers, batch=6)
    assert res.report.exact, str(res.report)


def test_static_batch_lstm_with_v2_while_loops_is_refused():
    with pytest.raises(replicate.AnalysisError, match="dynamic batch dimension"):
        replicate.transform(bm.lstm(2, static_batch=6).graph, CPUS[:2])


@pytest.mark.parametrize("version", [1, 2], ids=["while_v1", "while_v2"])
@pytest.mark.parametrize("towers,batch", [(2, 8), (3, 10)])
def test_lstm_control_flow(version, towers, batch):
    res, _ = check(bm.lstm(version), towers=towers, batch=batch)
    assert res.report.exact, str(res.report)
    if version == 1:
        frames = {n.attr["frame_name"].s.decode() for n in res.graph_def.node if n.op == "Enter"}
        assert any(f.startswith("tower_1/") for f in frames) and any(f.startswith("tower_0/") for f in frames)


@pytest.mark.parametrize("towers", [2, 3])
def test_state_in_resource_variables_carries_over_steps(towers):
    """A stateful LSTM: each tower reads its rows of the state variables, the final state is
    stored once from the towers' rows in order, and the next step starts from it (3 steps;
    3 towers split 7 sequences 3, 2, 2)."""
    res, result = check(bm.stateful_lstm(), towers=towers, batch=7)
    assert res.report.exact, str(res.report)
    assert {"state/c", "state/h"} <= set(result.per_variable) - set(result.unchanged)
    stores = [n.name for n in res.graph_def.node if n.op == "AssignVariableOp"
              and n.input[0] in ("state/c", "state/h") and n.name.startswith("tower_")]
    assert not stores, f"the state is stored per tower: {stores}"


@pytest.mark.parametrize("resource,trainable,match", [
    (False, False, "share the variable's buffer"), (True, True, "trained per example")])
def test_state_variables_that_cannot_be_split_are_refused(resource, trainable, match):
    """Reference variables: on one device the store rewrites the buffer the gradient kept from
    the read; a trained batch-shaped variable would need its gradient assembled from rows."""
    model = bm.stateful_lstm(resource=resource, trainable=trainable)
    with pytest.raises(replicate.AnalysisError, match=match):
        replicate.transform(model.graph, CPUS[:2])


def test_reference_state_variables_on_one_tower_run():
    """On one tower the reference variables' state is not refused (no split). The store, run
    once outside the tower, was made to wait for the tower's reads of the state, which include
    the RNN loop's ``Enter``: a control edge out of a loop frame, and the step failed ("inputs
    from different frames"). Reads inside TF1 loops are left out."""
    from replicate.check.equivalence import Trainer
    model = bm.stateful_lstm(resource=False)
    res = replicate.transform(model.graph, CPUS[:1])
    trainer = Trainer(res.meta_graph_def, model.train_op)
    try:
        for feed in model.feeds(7, 2):
            trainer.step(feed)
    finally:
        trainer.close()


def test_cond_on_a_flag_is_exact():
    res, _ = check(bm.conditional(on_batch=False), towers=3, batch=10)
    assert res.report.exact


def test_cond_on_a_batch_sum_is_reported_then_synced():
    model = bm.conditional(on_batch=True)
    res = replicate.transform(model.graph, CPUS[:3])
    assert not res.report.exact and any(r.node == "batch_sum" for r in res.report.reasons)
    res, _ = check(model, towers=3, batch=10, batch_norm="sync")
    assert res.report.exact, str(res.report)


def test_seeded_dropout_draws_the_single_device_mask():
    """The towers' masks are rows of one global draw with the original seeds (they were
    drawn per tower with changed seeds): one draw per step outside the towers, with the
    original seeds, and exact."""
    model = bm.dropout(seed=4)
    res, _ = check(model, towers=3, batch=9)
    assert res.report.exact, res.report.reasons
    original = {(n.attr["seed"].i, n.attr["seed2"].i) for n in model.graph.as_graph_def().node
                if n.op == "RandomUniform"}
    draws = [n for n in res.graph_def.node if n.op == "RandomUniform"
             and (n.name.startswith("tower_") or n.name.startswith("replicate/draw/"))]
    seeds = {(n.attr["seed"].i, n.attr["seed2"].i) for n in draws}
    assert seeds == original and len(original) == 1
    assert [n.name.startswith("replicate/draw/") for n in draws] == [True]


@pytest.mark.parametrize("build", [bm.layers_cnn, bm.keras_in_graph], ids=["v1_layers", "keras"])
@pytest.mark.parametrize("towers,batch", [(2, 8), (3, 10)])
def test_model_libraries(build, towers, batch):
    res, _ = check(build(), towers=towers, batch=batch)
    assert res.report.exact


@pytest.mark.parametrize("towers,batch", [(2, 4), (3, 5)])
def test_slim_resnet_trains_exactly(towers, batch):
    res, _ = check(bm.slim_resnet(size=16), towers=towers, batch=batch, steps=2)
    assert res.report.exact


def test_slim_resnet_v1_50_transforms():
    model = bm.slim_resnet(size=32, full=True)
    res = replicate.transform(model.graph, CPUS, verify_each=True)
    assert res.report.exact and res.report.nodes_per_tower > 1000
    assert res.report.variables == len([n for n in model.graph.as_graph_def().node
                                         if n.op in ("VarHandleOp", "VariableV2")])
    assert {r["name"] for r in res.report.passes} >= {"analyze", "clone", "aggregate", "validate"}


@pytest.mark.parametrize("reduction", ["SUM", "MEAN", "SUM_BY_NONZERO_WEIGHTS", "SUM_OVER_BATCH_SIZE"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_v1_loss_reductions(reduction, weighted):
    res, _ = check(bm.loss_reduction(reduction, weighted), towers=3, batch=10)
    assert res.report.exact, str(res.report)


@pytest.mark.parametrize("towers,batch", [(2, 8), (3, 10)])
def test_regularized_normalized_loss(towers, batch):
    res, _ = check(bm.loss_reduction("SUM_BY_NONZERO_WEIGHTS", True, regularized=True), towers=towers,
                   batch=batch)
    assert res.report.exact


def test_sum_loss_adds_gradients():
    res, _ = check(bm.sum_loss(), towers=3, batch=10)
    assert set(res.report.loss_reductions.values()) == {"sum"}


@pytest.mark.parametrize("towers,batch", [(2, 8), (3, 7)])
def test_sum_loss_with_regularizer_is_exact(towers, batch):
    """A batch-independent term added to a sum-reduced loss is weighed 1/N per tower inside
    the towers (the sum itself by 1), so the regularizer counts once."""
    res, _ = check(bm.loss_reduction("SUM", False, regularized=True), towers=towers, batch=batch)
    assert res.report.exact, str(res.report)
    assert any(s.corrections for s in res.analysis.scopes)
