"""End to end: N towers train exactly as one device on the same global batch."""

import models
import numpy as np
import pytest

import replicate
from replicate.check.equivalence import compare

RTOL = 1e-5
CPUS = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]


def check(model, towers, batch, steps=3, devices=None, **options):
    res = replicate.transform(model.graph, devices or CPUS[:towers], **options)
    feeds = model.feeds(batch, steps) if batch else steps
    result = compare(model.graph, res.meta_graph_def, model.train_op, feeds, fetch=model.fetch)
    assert result.max_rel <= RTOL, f"{result.worst} differs by {result.max_rel:.3g}"
    changed = [n for n in result.per_variable if n not in result.unchanged]
    assert changed, "training changed no variable"
    for single, multi in result.fetched:
        for a, b in zip(single, multi):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    return res, result


#: Every optimizer with resource variables; with ref variables every kernel once (Nesterov's
#: is Momentum's, RMSProp with momentum is RMSProp's; suite time).
_OPTIMIZERS = [(o, True) for o in sorted(models.OPTIMIZERS)] + \
    [(o, False) for o in sorted(models.OPTIMIZERS) if o not in ("nesterov", "rmsprop_momentum")]


@pytest.mark.parametrize("optimizer,resource", _OPTIMIZERS,
                         ids=[f"{'resource' if r else 'ref'}-{o}" for o, r in _OPTIMIZERS])
def test_every_optimizer_uneven(optimizer, resource):
    res, _ = check(models.mlp(optimizer, resource), towers=3, batch=10)
    assert res.report.exact, str(res.report)


@pytest.mark.parametrize("towers", [2, 3, 4])
@pytest.mark.parametrize("batch", [12, 13])
def test_device_counts_even_and_uneven(towers, batch):
    check(models.mlp("momentum"), towers=towers, batch=batch)


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_batch_smaller_than_towers_gives_no_nan(batch):
    _, result = check(models.mlp("adam"), towers=4, batch=batch)
    for single, multi in result.fetched:
        assert np.isfinite(multi[0]).all()


def test_cnn_dynamic_batch():
    check(models.cnn(), towers=3, batch=10, steps=2)


@pytest.mark.parametrize("towers,batch", [(2, 16), (3, 16), (4, 6)])
def test_cnn_static_batch_is_rewritten(towers, batch):
    model = models.cnn(batch=batch, optimizer="sgd")
    res, _ = check(model, towers=towers, batch=batch, steps=2)
    assert res.report.rebatched, "static batch constants were not rewritten"
    assert res.report.exact, str(res.report)


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
def test_clip_by_global_norm_sees_the_aggregate(resource):
    check(models.clipped(resource, norm=0.05), towers=3, batch=11)


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
def test_two_optimizers_grouped(resource):
    res, _ = check(models.two_optimizers(resource), towers=2, batch=9)
    assert set(res.report.optimizers) == {"Adam", "GradientDescent"}


def test_dataset_iterator_with_short_last_batch():
    model = models.dataset_mlp(examples=40, batch=12)
    res, _ = check(model, towers=3, batch=None, steps=4)
    assert [b["tensor"] for b in res.report.inputs] == ["IteratorGetNext:0", "IteratorGetNext:1"]


def test_global_step_increments_once():
    model = models.mlp("sgd")
    res = replicate.transform(model.graph, CPUS[:3])
    from replicate.check.equivalence import Trainer
    trainer = Trainer(res.meta_graph_def, "train")
    for feed in model.feeds(7, steps=4):
        trainer.step(feed)
    assert trainer.values()["global_step"] == 4
    trainer.close()


@pytest.mark.parametrize("towers,batch", [(2, 12), (3, 10), (4, 3)])
@pytest.mark.parametrize("aggregation", ["packed", "allreduce", "packed_allreduce"])
def test_aggregation_strategies_are_exact(aggregation, towers, batch):
    res, _ = check(models.mlp("adam"), towers=towers, batch=batch, aggregation=aggregation)
    ops = {n.op for n in res.graph_def.node if n.name.startswith("replicate/aggregate/")}
    assert ("SplitV" in ops) == aggregation.startswith("packed")
    assert ("CollectiveReduceV2" in ops) == aggregation.endswith("allreduce")


def test_parameter_devices_spread_is_exact():
    res, _ = check(models.cnn(), towers=2, batch=8, steps=2, devices=["/cpu:2", "/cpu:3"],
                   param_devices=["/cpu:0", "/cpu:1"])
    placed = {n.name: n.device for n in res.graph_def.node if n.op == "VarHandleOp"}
    assert {"/device:CPU:0", "/device:CPU:1"} <= set(placed.values())
