"""What replicate prints reads right (#25.4): plurals, reductions in words, a verify verdict
that cannot be read as a pass, a demo line that claims exactness only where it was checked,
and inspect never listing a tensor both as merged and as not mergeable."""

import re

import models
import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare
from replicate.cli.commands import inspect as inspect_cmd
from replicate.cli.commands.verify import verdict_line
from replicate.demo.report import drift_line, verdict
from replicate.demo.runner import Drift, SideBySide
from replicate.wording import count, reductions

v1 = tf.compat.v1


def test_counts_take_the_right_plural():
    assert [count(n, "tower") for n in (0, 1, 2)] == ["0 towers", "1 tower", "2 towers"]
    assert count(1, "reason") == "1 reason"


def test_reductions_in_words():
    assert reductions({"gradients": "mean"}) == "a mean over the batch"
    assert "divided by a count of examples" in reductions({"gradients": "ratio"})
    assert reductions({"gradients": "mean", "gradients_1": "sum"}) == (
        "'gradients': a mean over the batch; 'gradients_1': a sum over the batch")


def _unseeded_dropout():
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        w = v1.get_variable("w", [4, 2])
        hidden = tf.nn.dropout(x, rate=0.5)
        loss = tf.reduce_mean(tf.square(tf.matmul(hidden, w)), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return graph


def test_report_of_one_tower_and_one_reason_is_grammatical():
    report = str(replicate.transform(_unseeded_dropout(), ["/cpu:0"]).report)
    assert report.startswith("replicate: 1 tower on /device:CPU:0;")
    assert "1 towers" not in report
    reasons = re.search(r"exact +NO \((\d+) reasons?\)", report)
    assert reasons, report
    n = int(reasons.group(1))
    assert f"NO ({count(n, 'reason')})" in report
    assert "loss          loss:0  (a mean over the batch)" in report
    assert "reduction over the batch: gradients" not in report


def test_report_of_two_towers_uses_the_plural():
    report = str(replicate.transform(models.mlp().graph, ["/cpu:0", "/cpu:1"]).report)
    assert report.startswith("replicate: 2 towers on ")


def test_verify_verdict_cannot_be_read_as_a_pass():
    passed = verdict_line(True, 3e-7, "w", 1e-5)
    failed = verdict_line(False, 0.25, "dense/kernel", 1e-5)
    assert passed.startswith("verdict: agrees: every parameter is within --rtol 1e-05")
    assert failed.startswith("verdict: DIFFERS: the largest relative parameter difference, 0.25 "
                             "in dense/kernel, is above --rtol 1e-05")
    assert "within" not in failed


def _run(drift, losses=0.0):
    return SideBySide(losses=[(1.0, 1.0 + losses)], accuracies=[(0.5, 0.5)], seconds=[(1.0, 1.0)],
                      per_variable={"w": drift[-1].max_rel}, drift=drift, batch=8, warmup=0)


def test_demo_claims_exactness_only_where_checked_and_sets_drift_beside_the_reference():
    result = _run([Drift(1, 2e-7, 1e-7, 0.0, 0.0), Drift(10, 8e-7, 3e-7, 5e-7, 2e-7),
                   Drift(300, 0.99, 4e-3, 0.87, 3.9e-3)])
    ok, line = verdict(result, 1e-4)
    assert ok
    assert line == ("agreement: exact where checked: max relative parameter difference "
                    "step 1 2.0e-07, step 10 8.0e-07 (each within --rtol 0.0001)")
    drift = drift_line(result)
    assert drift.startswith("drift after 300 steps: towers vs 1 device 9.9e-01 max relative "
                            "(4.0e-03 of the parameters' norm)")
    assert "1 device vs itself with each batch permuted: 8.7e-01 (3.9e-03)" in drift
    assert not re.search(r"\bOK\b|agree|exact", drift)          # no verdict on the drift


def test_demo_says_differs_when_a_checked_step_is_off():
    ok, line = verdict(_run([Drift(1, 2e-7, 1e-7), Drift(10, 3e-2, 1e-2)]), 1e-4)
    assert not ok
    assert line.startswith("agreement: DIFFERS:") and "step 10 is above --rtol 0.0001" in line
    assert "exact" not in line


def test_demo_without_reference_says_so():
    line = drift_line(_run([Drift(1, 0.0, 0.0), Drift(50, 0.1, 0.01)]))
    assert "no one-device reference was run (--no-reference)" in line


def test_inspect_never_lists_a_tensor_as_merged_and_not_mergeable(tmp_path):
    path = str(tmp_path / "m.meta")
    with models.mlp().graph.as_default():
        v1.train.export_meta_graph(path)
    info = inspect_cmd.collect(path, ["/cpu:0", "/cpu:1"], "/cpu:0")
    assert "tower0_outputs" in info
    assert not set(info["merged_outputs"]) & set(info["tower0_outputs"])
    # the table row for tower-0-only tensors is separate from the merged row
    info["tower0_outputs"] = [info["merged_outputs"][0]]
    info["merged_outputs"] = info["merged_outputs"][1:]
    text = inspect_cmd.render(info)
    merged_row = next(line for line in text.splitlines() if line.strip().startswith("merged"))
    assert info["tower0_outputs"][0] not in merged_row
    assert re.search(r"tower 0 +1 +forward tensors under their original names holding tower 0's "
                     r"value only", text)


def _generator_of_fed_size(shaped: bool) -> tf.Graph:
    """A GAN whose noise has a fed size (``bs``), or the batch's (``tf.shape(x)[0]``)."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        size = tf.shape(x)[0] if shaped else v1.placeholder(tf.int32, [], name="bs")
        init = v1.glorot_uniform_initializer(seed=1)
        fake = v1.layers.dense(v1.random_normal([size, 2], seed=3), 3, name="G", kernel_initializer=init)
        real = v1.layers.dense(x, 1, name="D", kernel_initializer=init)
        judged = v1.layers.dense(fake, 1, name="D", reuse=True)
        loss = tf.add(tf.reduce_mean(tf.nn.softplus(-real)), tf.reduce_mean(tf.nn.softplus(judged)), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return graph


def test_a_gradient_the_batch_does_not_reach_is_aggregated():
    """A generator trained only through noise of a fed size has a gradient every tower
    computes whole. It was told to 'apply the gradients outside control flow', with none in
    the graph, then named as a gradient the batch does not reach; each tower's copy is its
    weighted share, so it is aggregated like the others now (review 30: a variable trained
    only through its L2 term): exact, with an empty tower too."""
    for shaped in (False, True):
        res = replicate.transform(_generator_of_fed_size(shaped), ["/cpu:1", "/cpu:2", "/cpu:3"])
        assert res.report.exact, res.report.reasons
    res = replicate.transform(_generator_of_fed_size(False), ["/cpu:1", "/cpu:2", "/cpu:3"])
    rng = np.random.RandomState(0)
    for batch in (7, 2):
        feeds = [{"x:0": rng.randn(batch, 3).astype(np.float32), "bs:0": 5} for _ in range(3)]
        assert compare(_generator_of_fed_size(False), res.graph, "train", feeds, cpus=4).max_rel <= 1e-5


def test_no_batch_input_found_says_which_inputs_were_set_aside():
    """A batch concatenated with a static-size replay buffer was refused with no hint of which
    inputs were weighed (review 12); naming all four with batch_inputs= makes it exact."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        u = v1.placeholder(tf.float32, [16, 3], name="u")
        uy = v1.placeholder(tf.int64, [16], name="uy")
        w = v1.get_variable("w", [3, 2], initializer=v1.glorot_uniform_initializer(seed=1))
        logits = tf.matmul(tf.concat([x, u], 0), w)
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.concat([y, uy], 0), logits=logits)
        v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(xent, name="loss"), name="train")
    with pytest.raises(replicate.ReplicateError, match="set aside: 'x:0'"):
        replicate.transform(graph, ["/cpu:1", "/cpu:2"])
    named = {"x:0": 0, "y:0": 0, "u:0": 0, "uy:0": 0}
    assert replicate.transform(graph, ["/cpu:1", "/cpu:2"], batch_inputs=named).report.exact


def test_a_static_batch_too_small_for_the_towers_names_its_inputs():
    """Fixed-length pair indices taken for a batch were refused without naming them (review 12)."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [2, 3], name="x")
        w = v1.get_variable("w", [3, 1], initializer=v1.glorot_uniform_initializer(seed=1))
        v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.matmul(x, w), name="loss"),
                                                        name="train")
    with pytest.raises(replicate.ReplicateError, match=r"fewer than the 3 towers.*'x:0'.*shared_inputs="):
        replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])


def test_shared_values_after_the_batch_are_not_called_tower_0_values():
    """A loss built with a logits rank known only at run time computes ``Rank`` and its
    arithmetic after the batch: the same in every tower, they were listed as tower 0's values."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        scale = v1.placeholder(tf.float32, name="scale")        # no shape: logits of unknown rank
        w = v1.get_variable("w", [3, 2], initializer=v1.glorot_uniform_initializer(seed=1))
        logits = tf.matmul(x * scale, w)
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(xent, name="loss"), name="train")
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2"])
    assert res.report.exact
    assert not any("Rank" in w for w in res.report.warnings if "cannot be merged" in w)


def _loss_chosen_by_a_cond():
    """A multi-task loss chosen by a v2 tf.cond: a class-weighted ratio in one branch."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 5], name="x")
        a = v1.placeholder(tf.int32, [None], name="a")
        t = v1.placeholder(tf.float32, [None], name="t")
        flag = v1.placeholder_with_default(True, [], name="flag")
        q = tf.matmul(x, v1.get_variable("w", [5, 4]))
        weights = tf.gather(tf.constant([1.0, 2.0, 0.5, 3.0]), a)
        loss = tf.cond(flag, lambda: tf.reduce_sum(tf.square(t - q[:, 0]) * weights) / tf.reduce_sum(weights),
                       lambda: tf.reduce_mean(tf.abs(t - q[:, 1])))
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return graph


def test_a_loss_chosen_by_a_v2_cond_names_tf1_control_flow_as_the_fix():
    """Review 26: the reason suggested rewriting the loss or batch_norm='sync'; the fix that
    works, building the cond as a TF1 cond, was not named."""
    res = replicate.transform(_loss_chosen_by_a_cond(), ["/cpu:0", "/cpu:1"])
    assert not res.report.exact
    assert any("disable_control_flow_v2()" in r.fix for r in res.report.reasons), res.report.reasons
    from breadth_models import control_flow_v1
    from replicate.check.equivalence import compare
    import numpy as np
    with control_flow_v1():
        graph = _loss_chosen_by_a_cond()
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(7, 5), "a:0": rng.randint(0, 4, 7), "t:0": rng.randn(7)}
             for _ in range(3)]
    assert compare(graph, res.graph, "train", feeds).max_rel <= 1e-5


def test_a_scatter_update_of_state_in_the_towers_says_what_to_do():
    """Review 26: a center loss's ``scatter_sub`` of its centers was reported with batch-norm
    wording ("statistics come from 1/N of the batch") in place of a fix."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        feats = tf.matmul(x, v1.get_variable("w", [3, 2]))
        centers = v1.get_variable("centers", [4, 2], trainable=False, use_resource=False,
                                  initializer=v1.zeros_initializer())
        picked = tf.gather(centers, y)
        # facenet's center loss: each center moves by its mean difference over the batch
        _, idx, counts = tf.unique_with_counts(y)
        times = tf.cast(tf.gather(counts, idx), tf.float32)[:, None]
        update = v1.scatter_sub(centers, y, 0.5 * (picked - feats) / (1.0 + times))
        loss = tf.reduce_mean(tf.reduce_sum(tf.square(feats - picked), 1))
        with tf.control_dependencies([update]):
            v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1"])
    reason = next(r for r in res.report.reasons if "state update" in r.what)
    assert "1/N of the examples" in reason.fix and "outside the model" in reason.fix, reason


def _noise_shaped_by(kind):
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        y = v1.placeholder(tf.float32, [None], name="y")
        w = v1.get_variable("w", [3], initializer=v1.ones_initializer())
        count = tf.cast(tf.reduce_sum(tf.ones_like(y)), tf.int32) if kind == "count" else tf.shape(y)[0]
        noise = tf.random.normal([count], seed=3)
        loss = tf.reduce_mean(tf.square(tf.reduce_sum(x * w, 1) - y) * noise, name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return graph


def test_a_draw_shaped_by_a_count_of_the_batch_says_so_and_the_fix_is_exact():
    """Reviews 21 and 24: noise shaped by ``reduce_sum(ones_like(y))`` was said to draw "per
    example from per-example values or permutes examples"; only a count shapes it."""
    import numpy as np
    from replicate.check.equivalence import compare
    res = replicate.transform(_noise_shaped_by("count"), ["/cpu:0", "/cpu:1", "/cpu:2"])
    reason = next(r for r in res.report.reasons if "random op" in r.what)
    assert "shaped by a value reduced over the batch" in reason.what and "tf.shape(x)[0]" in reason.fix
    graph = _noise_shaped_by("shape")
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(7, 3), "y:0": rng.randn(7)} for _ in range(3)]
    assert compare(graph, res.graph, "train", feeds).max_rel <= 1e-5


def _sampled_action_in_a_cond():
    """REINFORCE with an action sampled by tf.random.categorical in a tf.cond branch."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        flag = v1.placeholder_with_default(True, [], name="flag")
        logits = tf.matmul(x, v1.get_variable(
            "w", [4, 5], initializer=v1.random_normal_initializer(seed=11)))
        action = tf.cond(flag, lambda: tf.random.categorical(logits, 1, seed=7),
                         lambda: tf.argmax(logits, 1)[:, None])
        picked = tf.gather(tf.nn.log_softmax(logits), action, batch_dims=1)
        loss = tf.identity(-tf.reduce_mean(picked * x[:, :1]), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return graph


def test_categorical_sampling_in_a_v2_cond_names_the_tf1_cond_as_the_fix():
    """Review 24: the reason said only that "the analysis could not follow the function's
    draws". It now says what is not reproduced and where it is; following it is exact."""
    import numpy as np
    from breadth_models import control_flow_v1
    from replicate.check.equivalence import compare
    res = replicate.transform(_sampled_action_in_a_cond(), ["/cpu:0", "/cpu:1", "/cpu:2"])
    reason = next(r for r in res.report.reasons if "Multinomial" in r.what)
    assert "samples by per-example parameters" in reason.what
    assert "disable_control_flow_v2()" in reason.fix
    with control_flow_v1():
        graph = _sampled_action_in_a_cond()
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(7, 4)} for _ in range(3)]
    assert compare(graph, res.graph, "train", feeds).max_rel <= 1e-5


def test_inputs_joined_by_row_numbers_are_checked_with_a_message():
    """Review 27: ``gather_nd(q, stack([range(tf.shape(a)[0]), a], 1))`` makes ``a`` and ``x``
    one batch. A feed of other sizes (one device picks q's first rows) failed in the split
    with a message that said nothing; now the report states the assumption, and the step
    stops with a message naming the op."""
    import numpy as np
    from replicate.check.equivalence import compare
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        a = v1.placeholder(tf.int32, [None], name="a")
        y = v1.placeholder(tf.float32, [None], name="y")
        q = tf.matmul(x, v1.get_variable("w", [4, 3], initializer=v1.ones_initializer()))
        picked = tf.gather_nd(q, tf.stack([tf.range(tf.shape(a)[0]), a], 1))
        loss = tf.reduce_mean(tf.square(picked - y), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert res.report.exact
    assert any("are taken to be one batch because 'GatherNd'" in w for w in res.report.warnings)
    rng = np.random.RandomState(0)
    same = [{"x:0": rng.randn(7, 4), "a:0": rng.randint(0, 3, 7), "y:0": rng.randn(7)}]
    assert compare(graph, res.graph, "train", same).max_rel <= 1e-5
    other = [{"x:0": rng.randn(9, 4), "a:0": rng.randint(0, 3, 3), "y:0": rng.randn(3)}]
    with pytest.raises(Exception, match=r"taken to be one batch because .*GatherNd.* picks rows"):
        compare(graph, res.graph, "train", other)


def test_graphs_batched_by_concatenating_their_nodes_are_refused_with_the_op():
    """Review 28: nodes ``[N, F]`` of several graphs, ``graph_ids [N]``, labels ``[G]``, edges
    into the nodes. The ids and labels were split as batches of their own and the nodes kept
    whole: inexact, and every step failed with TensorFlow's "data.shape does not start with
    segment_ids.shape". No split pairs them; the transform says which op and what to name."""
    graph = tf.Graph()
    with graph.as_default():
        items = v1.placeholder(tf.float32, [None, 5], name="items")
        graph_ids = v1.placeholder(tf.int32, [None], name="graph_ids")
        labels = v1.placeholder(tf.int32, [None], name="labels")
        src = v1.placeholder(tf.int32, [None], name="edge_src")
        dst = v1.placeholder(tf.int32, [None], name="edge_dst")
        h = tf.nn.relu(tf.matmul(items, v1.get_variable("w", [5, 8])))
        h = h + tf.math.unsorted_segment_sum(tf.gather(h, src), dst, tf.shape(items)[0])
        pooled = tf.math.unsorted_segment_sum(h, graph_ids, tf.shape(labels)[0])
        logits = tf.matmul(pooled, v1.get_variable("out", [8, 2]))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    with pytest.raises(replicate.ReplicateError, match=r"UnsortedSegmentSum.*pairs the rows of .*whole.*"
                                                      r"graph_ids.*batch_inputs="):
        replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])


def test_a_train_op_named_that_applies_hand_accumulated_gradients_names_the_accumulating_op():
    """Review 28: hand-written accumulation (``accum_ops`` adds each micro-batch's gradients to
    variables, ``train_step`` applies the sums). Naming ``train_step`` was refused with "updates
    no variable from a gradient" and no hint; the message now names the op that does."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        w = v1.get_variable("w", [3, 1])
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
        opt = v1.train.GradientDescentOptimizer(0.1)
        (grad, var), = opt.compute_gradients(loss, [w])
        acc = v1.get_variable("acc", [3, 1], initializer=tf.zeros_initializer(), trainable=False)
        tf.group(acc.assign_add(grad), name="accum_ops")
        opt.apply_gradients([(acc.read_value(), var)], name="train_step")
    with pytest.raises(replicate.ReplicateError, match="'accum_ops' runs the updates from a gradient"):
        replicate.transform(graph, ["/cpu:0", "/cpu:1"], train_op="train_step")


def test_an_inner_gradient_over_the_batch_does_not_suggest_sync():
    """Review 28: MAML's adaptation step, a gradient of the support loss with respect to the
    weights used in the model, was told to use batch_norm='sync' (which made it further off)."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        y = v1.placeholder(tf.float32, [None, 1], name="y")
        w = v1.get_variable("w", [3, 1])
        inner = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        fast = w - 0.1 * tf.gradients(inner, w)[0]
        outer = tf.reduce_mean(tf.square(tf.matmul(x, fast) - y))
        v1.train.GradientDescentOptimizer(0.1).minimize(outer, name="train")
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1"])
    assert not res.report.exact
    text = " ".join(f"{r.what} {r.fix}" for r in res.report.reasons)
    assert "a gradient computed in the model" in text and "use batch_norm='sync'" not in text


def test_a_sorted_segment_sum_by_fed_ids_is_refused_with_the_op():
    """Review 29: the same graphs pooled with the sorted ``tf.math.segment_sum(h, graph_ids)``
    were split, and every step failed in its gradient ("indices[3] = 2 is not in [0, 2)")."""
    graph = tf.Graph()
    with graph.as_default():
        nodes = v1.placeholder(tf.float32, [None, 4], name="nodes")
        gid = v1.placeholder(tf.int32, [None], name="gid")
        lab = v1.placeholder(tf.float32, [None], name="lab")
        pooled = tf.math.segment_sum(tf.squeeze(tf.matmul(nodes, v1.get_variable("w", [4, 1])), 1), gid)
        v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(pooled - lab)), name="train")
    with pytest.raises(replicate.ReplicateError, match="SegmentSum sums by segment ids fed in 'gid:0'"):
        replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])


def test_tokens_fed_flat_with_their_row_splits_are_refused_as_such():
    """Review 31: ``RaggedTensor.from_row_splits(tokens, splits)`` with the splits fed (one
    entry more than the batch's examples) was refused with advice to slice a tensor inside
    RaggedTensor's code; the refusal now says what the fed splits are."""
    graph = tf.Graph()
    with graph.as_default():
        splits = v1.placeholder(tf.int64, [None], name="splits")
        ids = v1.placeholder(tf.int32, [None], name="tokens")
        rows = tf.nn.embedding_lookup(v1.get_variable("e", [10, 4]), ids)
        pooled = tf.reduce_mean(tf.RaggedTensor.from_row_splits(rows, splits), 1)
        scores = tf.reduce_sum(pooled * v1.get_variable("w", [4]), 1)
        v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(scores)), name="train")
    with pytest.raises(replicate.ReplicateError, match="entries of 'splits:0' minus a constant.*row "
                       "boundaries.*Feed the rows padded"):
        replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])


@pytest.mark.parametrize("embedded", [False, True])
def test_tokens_fed_flat_with_their_lengths_are_refused_with_the_op(embedded):
    """Review 29: ``tf.RaggedTensor.from_row_lengths(tokens, lengths).to_tensor()`` with the
    tokens fed flat was split (the tokens evenly by rows), and every step failed on
    RaggedTensor's own check; the offsets the lengths sum to are now refused by name. Token
    ids embedded first and mean-pooled (review 31) were refused with advice to slice a tensor
    inside RaggedTensor's code."""
    graph = tf.Graph()
    with graph.as_default():
        lengths = v1.placeholder(tf.int64, [None], name="lengths")
        if embedded:
            ids = v1.placeholder(tf.int32, [None], name="tokens")
            rows = tf.nn.embedding_lookup(v1.get_variable("e", [10, 4]), ids)
            pooled = tf.reduce_mean(tf.RaggedTensor.from_row_lengths(rows, lengths), 1)
            scores = tf.reduce_sum(pooled * v1.get_variable("w", [4]), 1)
        else:
            tokens = v1.placeholder(tf.float32, [None, 4], name="tokens")
            dense = tf.RaggedTensor.from_row_lengths(tokens, lengths).to_tensor()
            scores = tf.reduce_sum(dense * v1.get_variable("w", [4]), 2)
        v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(scores)), name="train")
    with pytest.raises(replicate.ReplicateError, match="Cumsum of the counts fed per example in "
                       "'lengths:0' makes offsets into the rows of 'tokens:0'.*feed the rows padded"):
        replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])


def test_ragged_rows_built_from_the_examples_run():
    """Review 30: a per-example mean over ``RaggedTensor.from_tensor(h, lengths=lens)`` was
    refused as "counts up to the batch size minus a constant" (its rows number its
    ``row_splits``, ``concat([[0], cumsum(lens)])``, less one) with advice no user can take;
    each tower's ragged rows are its own examples', and the rewrite runs and trains alike."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 5, 3], name="x")
        lens = v1.placeholder(tf.int64, [None], name="lens")
        h = tf.tensordot(x, v1.get_variable("w", [3, 4], initializer=v1.glorot_uniform_initializer(seed=1)), 1)
        m = tf.reduce_mean(tf.RaggedTensor.from_tensor(h, lengths=lens), axis=1)
        v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(m)), name="train")
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(b, 5, 3).astype(np.float32), "lens:0": rng.randint(1, 6, b)} for b in (7, 2)]
    assert compare(graph, res.graph, "train", feeds, cpus=4).max_rel <= 1e-5


def _fixes(graph, **options) -> str:
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1"], **options)
    assert not res.report.exact
    return " ".join(r.fix for r in res.report.reasons)


def test_fixes_fit_the_mode_and_the_control_flow():
    """Review 30: with ``batch_norm='sync'`` on, a fix still advised passing it (and the same
    reason came back); a batch reduction in a ``tf.while_loop``'s condition was told to use
    TF1 control flow, which helps a cond's branches, not a loop."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 6], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        w = v1.get_variable("w", [6, 3], initializer=v1.glorot_uniform_initializer(seed=2))
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=tf.matmul(x, w))
        loss = tf.reduce_logsumexp(ce) - tf.math.log(tf.reduce_prod(tf.sigmoid(ce)))   # no sync for a product
        v1.train.GradientDescentOptimizer(0.2).minimize(loss, name="train")
    assert "pass batch_norm='sync'" in _fixes(graph)
    synced = _fixes(graph, batch_norm="sync")
    assert "pass batch_norm='sync'" not in synced and "cannot combine this value" in synced
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 6], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        h = tf.matmul(x, v1.get_variable("w", [6, 3], initializer=v1.glorot_uniform_initializer(seed=1)))
        _, h = tf.while_loop(lambda i, h: tf.logical_and(tf.reduce_max(tf.norm(h, axis=1)) > 1.0, i < 20),
                             lambda i, h: (i + 1, h * 0.7), [tf.constant(0), h])
        v1.train.GradientDescentOptimizer(0.5).minimize(tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h)), name="train")
    fixes = _fixes(graph)
    assert "before the loop" in fixes and "disable_control_flow_v2" not in fixes, fixes
    graph = tf.Graph()      # activations scaled by their batch-wide maximum (review 33)
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        h = tf.tanh(tf.matmul(x, v1.get_variable("w", [4, 3])))
        v1.train.GradientDescentOptimizer(0.5).minimize(tf.reduce_mean(
            tf.square(h / (tf.reduce_max(tf.abs(h)) + 1e-3))), name="train")
    fixes = _fixes(graph)
    assert "tf.stop_gradient" in fixes and "batch_norm='sync'" not in fixes, fixes


def _discriminated() -> tf.Graph:
    """A GAN discriminator applied to ``tf.concat([real, fake], 0)``, labelled ones then zeros."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        y = v1.placeholder(tf.float32, [None, 1], name="y")
        z = v1.placeholder(tf.float32, [None, 3], name="z")
        g = v1.get_variable("g", [3, 3], initializer=v1.glorot_uniform_initializer(seed=1))
        d = v1.get_variable("d", [3, 1], initializer=v1.glorot_uniform_initializer(seed=2))
        logits = tf.matmul(tf.concat([x, tf.matmul(z, g)], 0), d)
        labels = tf.concat([tf.ones_like(y), tf.zeros_like(y)], 0)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return graph


def test_a_concatenation_of_batches_is_refused_with_a_fix_that_can_be_followed():
    """Review 31: the refusal advised giving the batch input a dynamic batch dimension, which
    every input had; it now says what the tensor holds and names the inputs set aside. Named
    with ``batch_inputs=``, the discriminator's step is exact."""
    with pytest.raises(replicate.ReplicateError, match=r"holds 2 batches one after another.*'x:0' and "
                       r"'z:0' were not taken for batch inputs.*batch_inputs="):
        replicate.transform(_discriminated(), ["/cpu:0", "/cpu:1", "/cpu:2"])
    res = replicate.transform(_discriminated(), ["/cpu:0", "/cpu:1", "/cpu:2"],
                              batch_inputs=["x:0", "y:0", "z:0"])
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(3)
    feeds = [{"x:0": rng.randn(5, 3), "y:0": rng.randn(5, 1), "z:0": rng.randn(5, 3)} for _ in range(2)]
    assert compare(_discriminated(), res.graph, "train", feeds, cpus=4).max_rel <= 1e-5


def test_a_static_batch_the_analysis_cannot_follow_is_refused_without_the_reason_s_fix():
    """Review 30: BERT's ``gather_indexes`` built from a static batch (``range(0, 7) * S``)
    was refused with the reason's fix for an inexact rewrite ("compute the loss per example
    and reduce it"), which the program already did; the fix is a dynamic batch dimension."""
    B, S, H = 7, 6, 4
    graph = tf.Graph()
    with graph.as_default():
        seq = v1.placeholder(tf.float32, [B, S, H], name="seq")
        pos = v1.placeholder(tf.int32, [B, 2], name="positions")
        flat = tf.reshape(tf.tanh(seq * v1.get_variable("w", [H])), [B * S, H])
        picked = tf.gather(flat, tf.reshape(pos + tf.reshape(tf.range(0, B) * S, [-1, 1]), [-1]))
        v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(picked)), name="train")
    # refused while its recomputed values read the towers' resized sizes and did not import;
    # now an inexact rewrite that runs, whose reason names the same fix
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert not res.report.exact
    text = str(res.report.reasons[0])
    assert "dynamic batch dimension" in text, text
    assert "reduce it with a mean or sum" not in text, text
    rng = np.random.RandomState(0)
    compare(graph, res.graph, "train", [{"seq:0": rng.randn(B, S, H).astype(np.float32),
                                         "positions:0": rng.randint(0, S, (B, 2)).astype(np.int32)}])


def test_batch_norm_over_two_batches_with_a_sliced_loss_runs():
    """Review 32: batch norm over ``tf.concat([real, fake])`` with the loss on the generated
    half stopped in an internal error (the merged batch norm output's weights read a node the
    rewire pass had removed). It is inexact, with its reason, and runs."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        z = v1.placeholder(tf.float32, [None, 3], name="z")
        g = v1.get_variable("g", [3, 3], initializer=v1.glorot_uniform_initializer(seed=1))
        d = v1.get_variable("d", [3, 4], initializer=v1.glorot_uniform_initializer(seed=2))
        h = v1.layers.batch_normalization(tf.nn.relu(tf.matmul(tf.concat([x, tf.matmul(z, g)], 0), d)),
                                          training=True, name="dbn")
        loss = tf.reduce_mean(tf.square(h[tf.shape(x)[0]:]), name="loss")
        with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
            v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"], batch_inputs=["x:0", "z:0"])
    assert not res.report.exact and "StridedSlice" in str(res.report.reasons[0])
    rng = np.random.RandomState(1)
    compare(graph, res.graph, "train", [{"x:0": rng.randn(7, 3), "z:0": rng.randn(7, 3)}], cpus=4)


def test_a_sparse_placeholder_without_its_rank_is_told_to_give_it():
    """Review 33: ``tf.compat.v1.sparse_placeholder`` without ``shape=`` (the usual TF1
    spelling) was told to "give the batch input a dynamic batch dimension"; its rank is what
    is missing (``shape=[None, None]`` makes the same program exact)."""
    graph = tf.Graph()
    with graph.as_default():
        ids = v1.sparse_placeholder(tf.int64, name="ids")
        dense = tf.sparse.to_dense(ids, default_value=0)
        emb = v1.get_variable("emb", [10, 4], initializer=v1.random_normal_initializer(seed=1))
        pooled = tf.reduce_sum(tf.nn.embedding_lookup(emb, dense), 1)
        v1.train.GradientDescentOptimizer(0.3).minimize(tf.reduce_mean(tf.square(pooled)), name="train")
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1"])
    reason = next(r for r in res.report.reasons if r.node == "ids/shape")
    assert "sparse placeholder" in reason.what and "shape=[None, None]" in reason.fix


def _ragged_pool(kind):
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 6, 4], name="x")
        lengths = v1.placeholder(tf.int64, [None], name="len")
        y = v1.placeholder(tf.float32, [None], name="y")
        w = v1.get_variable("w", [4, 1], use_resource=True)
        h = tf.squeeze(tf.tensordot(x, w, 1), -1)
        mask = tf.sequence_mask(lengths, 6)
        if kind == "row_lengths":
            pooled = tf.reduce_max(tf.RaggedTensor.from_row_lengths(tf.boolean_mask(h, mask), lengths), 1)
        elif kind == "from_tensor":
            pooled = tf.reduce_max(tf.RaggedTensor.from_tensor(h, lengths=lengths), 1)
        else:                                               # the advice, as written
            pooled = tf.reduce_max(tf.where(mask, h, tf.fill(tf.shape(h), -1e9)), axis=1)
        loss = tf.reduce_mean(tf.square(pooled - y), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return graph


def test_a_ragged_row_reduction_is_told_the_masked_form_and_that_form_is_exact():
    """Review 34: a max over RaggedTensor rows built from the batch was refused (or reported
    inexact) with advice about ops the user never wrote (``x[:-1]``, "compute the loss per
    example"): the range is RaggedTensor's own. The advice now names the padded tensor under
    its mask, and that form trains exactly, an empty tower included."""
    with pytest.raises(replicate.ReplicateError, match=r"RaggedTensor code .*tf\.sequence_mask"):
        replicate.transform(_ragged_pool("row_lengths"), ["/cpu:0", "/cpu:1", "/cpu:2"])
    res = replicate.transform(_ragged_pool("from_tensor"), ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert not res.report.exact and "tf.sequence_mask" in str(res.report)
    rng = np.random.RandomState(0)
    for batch in (7, 2):
        graph = _ragged_pool("masked")
        res = replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])
        assert res.report.exact, res.report.reasons
        feeds = [{"x:0": rng.randn(batch, 6, 4).astype("f"), "len:0": rng.randint(1, 7, batch).astype("int64"),
                  "y:0": rng.randn(batch).astype("f")} for _ in range(3)]
        result = compare(graph, res.meta_graph_def, "train", feeds, fetch=("loss:0",))
        assert result.max_rel <= 1e-5, (batch, result.worst, result.max_rel)
