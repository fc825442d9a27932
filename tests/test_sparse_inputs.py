"""Batch inputs fed as a SparseTensor are split by the examples their indices name.

Wide linear models and CTR models feed their features as ``tf.compat.v1.sparse_placeholder``:
three placeholders (indices, values, dense shape) whose first axis counts entries, not
examples. Each tower gets the entries of its own examples, renumbered from 0. Batches are
uneven, some examples have no entries at all, and one case leaves a tower empty.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
FEATURES = 12


def _sparse_batch(rng, batch: int, kind=np.float32, empty_last: bool = False, full: bool = False):
    """Sorted indices with 0-3 entries per example (the first example always has one; with
    ``full`` every example has one)."""
    rows, cols = [], []
    for r in range(batch):
        n = 1 + rng.randint(0, 3) if r == 0 or not (empty_last and r == batch - 1) else 0
        n = n if r == 0 or full or rng.rand() > 0.25 or n == 0 else 0
        for c in sorted(rng.choice(FEATURES, n, replace=False)):
            rows.append(r)
            cols.append(c)
    indices = np.array([rows, cols], np.int64).T.reshape(-1, 2)
    if kind == np.int64:
        values = rng.randint(0, 20, len(rows)).astype(np.int64)
    else:
        values = rng.rand(len(rows)).astype(kind)
    return indices, values, np.array([batch, FEATURES], np.int64)


def _feeds(name: str, batch: int, steps: int = 3, kind=np.float32, empty_last=False, full=False):
    rng = np.random.RandomState(batch)
    out = []
    for _ in range(steps):
        i, v, s = _sparse_batch(rng, batch, kind, empty_last, full)
        out.append({f"{name}/indices:0": i, f"{name}/values:0": v, f"{name}/shape:0": s,
                    "y:0": rng.randn(batch, 1).astype(np.float32)})
    return out


def _linear(head: str) -> tf.Graph:
    graph = tf.Graph()
    with graph.as_default():
        x = v1.sparse_placeholder(tf.float32, shape=[None, FEATURES], name="x")
        y = v1.placeholder(tf.float32, [None, 1], name="y")
        w = v1.get_variable("w", [FEATURES, 1], initializer=v1.glorot_uniform_initializer(seed=1))
        b = v1.get_variable("b", [1], initializer=v1.zeros_initializer())
        if head == "matmul":
            p = tf.sparse.sparse_dense_matmul(x, w) + b
        elif head == "to_dense":
            p = tf.matmul(tf.sparse.to_dense(x, validate_indices=False), w) + b
        else:           # a per-example sum of the features beside the linear part
            p = tf.sparse.sparse_dense_matmul(x, w) + b \
                + 0.5 * tf.sparse.reduce_sum(x, axis=1, keepdims=True)
        loss = tf.reduce_mean(tf.square(p - y), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return graph


@pytest.mark.parametrize("head", ["matmul", "to_dense", "reduce"])
@pytest.mark.parametrize("towers,batch", [(3, 7), (3, 2)])
def test_sparse_linear_model_is_exact(head, towers, batch):
    graph = _linear(head)
    named = {"batch_inputs": ["x/indices:0", "x/values:0", "y:0"]} if head == "reduce" else \
        {"param_devices": "mirrored"} if head == "to_dense" else {}
    res = replicate.transform(graph, [f"/cpu:{k + 1}" for k in range(towers)], **named)
    assert res.report.exact, res.report.reasons
    sparse = {i["tensor"]: i["sparse"] for i in res.report.inputs if "sparse" in i}
    assert sparse == {"x/indices:0": "indices", "x/values:0": "values", "x/shape:0": "shape"}
    assert "split by the example in column 0" in str(res.report)
    cmp = compare(graph, res.graph, "train", _feeds("x", batch, empty_last=True), fetch=("loss:0",))
    assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)
    for single, multi in cmp.fetched:
        np.testing.assert_allclose(single[0], multi[0], rtol=1e-5)


def _embedding(safe: bool, weighted: bool = False) -> tf.Graph:
    """An embedding of sparse ids (optionally weighted by a second SparseTensor fed with the
    ids' indices, whose indices the lookup never reads) and a linear head."""
    graph = tf.Graph()
    with graph.as_default():
        ids = v1.sparse_placeholder(tf.int64, shape=[None, FEATURES], name="ids")
        weights = v1.sparse_placeholder(tf.float32, shape=[None, FEATURES], name="wts") if weighted else None
        y = v1.placeholder(tf.float32, [None, 1], name="y")
        table = v1.get_variable("table", [20, 4], initializer=v1.glorot_uniform_initializer(seed=3))
        w = v1.get_variable("w", [4, 1], initializer=v1.glorot_uniform_initializer(seed=4))
        lookup = tf.nn.safe_embedding_lookup_sparse if safe else tf.nn.embedding_lookup_sparse
        e = lookup(table, ids, weights, combiner="sqrtn" if weighted else "mean")
        loss = tf.reduce_mean(tf.square(tf.matmul(e, w) - y), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return graph


def _weighted(feeds):
    rng = np.random.RandomState(5)
    return [{**f, "wts/indices:0": f["ids/indices:0"], "wts/shape:0": f["ids/shape:0"],
             "wts/values:0": rng.rand(len(f["ids/values:0"])).astype(np.float32)} for f in feeds]


@pytest.mark.parametrize("weighted", [False, True])
def test_safe_embedding_lookup_sparse_is_exact(weighted):
    """Also with gradient accumulation: each micro-batch takes its examples' entries. Sparse
    weights (an independent review found them split as a dense input by their entry count:
    claimed exact, and the split failed) follow the examples their indices name."""
    graph = _embedding(safe=True, weighted=weighted)
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"], accumulate=1 if weighted else 2)
    assert res.report.exact, res.report.reasons
    feeds = _feeds("ids", 7, kind=np.int64, empty_last=True)
    cmp = compare(graph, res.graph, "train", _weighted(feeds) if weighted else feeds, fetch=("loss:0",))
    assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)


def test_weights_fed_beside_the_ids_follow_their_entries():
    """``tf.SparseTensor(ids.indices, weights, ids.dense_shape)`` with the weights a dense
    placeholder of one value per entry (an independent review found the weights taken for a
    dense batch and the towers' step failing): the weights are more values of the ids' entries,
    split with them, also with the numeric check's own feeds."""
    graph = tf.Graph()
    with graph.as_default():
        ids = v1.sparse_placeholder(tf.int64, shape=[None, FEATURES], name="ids")
        values = v1.placeholder(tf.float32, [None], name="weights")
        y = v1.placeholder(tf.float32, [None, 1], name="y")
        table = v1.get_variable("table", [20, 4], initializer=v1.glorot_uniform_initializer(seed=3))
        w = v1.get_variable("w", [4, 1], initializer=v1.glorot_uniform_initializer(seed=4))
        e = tf.nn.safe_embedding_lookup_sparse(
            table, ids, tf.SparseTensor(ids.indices, values, ids.dense_shape), combiner="sqrtn")
        loss = tf.reduce_mean(tf.square(tf.matmul(e, w) - y), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"], check=True)
    assert res.report.exact, res.report.reasons
    assert res.report.check["ok"], res.report.check
    sparse = {i["tensor"]: i["sparse"] for i in res.report.inputs if "sparse" in i}
    assert sparse["weights:0"] == "values", sparse
    rng = np.random.RandomState(5)
    feeds = [{**f, "weights:0": rng.rand(len(f["ids/values:0"])).astype(np.float32) + 0.1}
             for f in _feeds("ids", 7, kind=np.int64, empty_last=True)]
    cmp = compare(graph, res.graph, "train", feeds, fetch=("loss:0",))
    assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)


def test_embedding_lookup_sparse_is_refused_naming_the_fix():
    """Without filled rows the lookup has as many rows as the last example with an id: a tower
    whose last examples have none gets fewer rows than examples and its step fails (the
    numeric check found it: 'Incompatible shapes: [0,1] vs. [4,1]'). Refused, naming the fix."""
    for weighted in (False, True):      # with weights it sums segments: the same rows
        with pytest.raises(replicate.ReplicateError, match="safe_embedding_lookup_sparse"):
            replicate.transform(_embedding(safe=False, weighted=weighted), ["/cpu:1", "/cpu:2"])


def test_certificate_feeds_sparse_inputs():
    """The numeric check draws whole SparseTensors (a dense shape fed with the batch size, not
    the placeholder's default of -1, which aborts TensorFlow's process)."""
    graph = _linear("matmul")
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2"], check=True)
    check = res.report.check
    assert check["ran"] and check["ok"], check
    assert [r["batch"] for r in check["runs"]] == [7, 1], check


def _gcn(layers: int) -> tf.Graph:
    """Kipf-style graph convolutions: the normalized adjacency rows of a batch of nodes (a
    SparseTensor) times all the nodes' features (fed whole)."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 6], name="features")
        adj = v1.sparse_placeholder(tf.float32, name="support")
        y = v1.placeholder(tf.float32, [None, 3], name="labels")
        h = x
        for i in range(layers):
            w = v1.get_variable(f"w{i}", [h.shape[1], 3 if i == layers - 1 else 8],
                                initializer=v1.glorot_uniform_initializer(seed=i + 1))
            h = tf.sparse.sparse_dense_matmul(adj, tf.matmul(h, w))
            h = tf.nn.relu(h) if i < layers - 1 else h
        loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=h), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return graph


def test_one_graph_convolution_over_a_batch_of_nodes_is_exact():
    """The adjacency rows are the examples and their columns index the features of every node:
    the features are evidence of no batch (shared, with why), each tower computes its nodes'
    rows from them. 5 nodes of 9 per step over 3 towers."""
    graph = _gcn(1)
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert res.report.exact, res.report.reasons
    assert "features:0" in res.report.shared_inputs
    rng = np.random.RandomState(0)
    feeds = []
    for _ in range(3):
        a = (rng.rand(5, 9) < 0.3).astype(np.float32)
        a[np.arange(5), np.arange(5)] = 1
        idx = np.argwhere(a).astype(np.int64)
        feeds.append({"features:0": rng.randn(9, 6).astype(np.float32), "support/indices:0": idx,
                      "support/values:0": a[a > 0] / a.sum(1)[idx[:, 0]],
                      "support/shape:0": np.array([5, 9], np.int64),
                      "labels:0": np.eye(3, dtype=np.float32)[rng.randint(0, 3, 5)]})
    cmp = compare(graph, res.graph, "train", feeds, fetch=("loss:0",))
    assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)


def test_graph_convolution_over_the_batch_is_refused_naming_the_coupling():
    """A second convolution multiplies the first one's rows, which are the examples: every
    node's output adds its neighbours' rows, which other towers hold. No split can run it; the
    refusal says so instead of blaming the adjacency's dense shape ("static batch size of 2")."""
    with pytest.raises(replicate.ReplicateError, match="graph convolution") as err:
        replicate.transform(_gcn(2), ["/cpu:1", "/cpu:2"])
    assert "static batch size" not in str(err.value)


def test_a_loss_divided_by_the_number_of_entries_is_not_claimed_exact():
    """A tower whose examples have no entry counts zero entries: weighed by its share of the
    entries it lost its share of the loss (an independent review: claimed exact, 0.31 off on
    the bias). The number of entries is no share of the examples: a reason."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.sparse_placeholder(tf.float32, shape=[None, FEATURES], name="x")
        w = v1.get_variable("w", [FEATURES, 1], initializer=v1.glorot_uniform_initializer(seed=1))
        b = v1.get_variable("b", [1], initializer=v1.zeros_initializer())
        out = tf.sparse.sparse_dense_matmul(x, w) + b
        nnz = tf.cast(tf.size(x.values), tf.float32)
        loss = tf.math.divide(tf.reduce_sum(tf.square(out - 1.0)), nnz, name="loss")
        v1.train.GradientDescentOptimizer(0.05).minimize(loss, name="train")
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert not res.report.exact


def test_ids_turned_sparse_by_their_lengths_are_a_batch_input():
    """``SparseTensor(tf.where(sequence_mask(lengths)), boolean_mask(ids, mask), tf.shape(ids))``
    into ``safe_embedding_lookup_sparse``: ``ids`` is gathered by row numbers of the lengths'
    batch, which makes the two one batch. It was taken for a table looked up by the lengths'
    values and shared, and the rewrite failed at step 1 (tower 0's embedding had the global
    batch's rows). It runs now (inexact: the lookup's ``SparseReshape`` is not proved)."""
    graph = tf.Graph()
    with graph.as_default():
        ids = v1.placeholder(tf.int64, [None, 3], name="ids")
        lengths = v1.placeholder(tf.int32, [None], name="len")
        y = v1.placeholder(tf.float32, [None], name="y")
        emb = v1.get_variable("emb", [11, 4], initializer=v1.random_normal_initializer(seed=2))
        mask = tf.sequence_mask(lengths, 3)
        sp = tf.SparseTensor(tf.where(mask), tf.boolean_mask(ids, mask), tf.shape(ids, out_type=tf.int64))
        h = tf.nn.safe_embedding_lookup_sparse(emb, sp, combiner="mean")
        loss = tf.reduce_mean(tf.square(tf.reduce_sum(h, 1) - y), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert "ids:0" in {i["tensor"] for i in res.report.inputs}
    assert "ids:0" not in res.report.shared_inputs
    rng = np.random.RandomState(0)
    feeds = [{"ids:0": rng.randint(0, 11, (b, 3)), "len:0": rng.randint(1, 4, b).astype(np.int32),
              "y:0": rng.randn(b).astype(np.float32)} for b in (7, 5)]
    cmp = compare(graph, res.graph, "train", feeds)
    if res.report.exact:
        assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)


def test_tokens_fed_flat_with_their_example_ids_are_refused_with_the_fix():
    """Ragged tokens fed flat (``tok`` ``[N, D]``) with their examples' numbers (``seg``),
    pooled by ``unsorted_segment_sum(..., seg, batch)``: the ids name the batch's rows, so a
    tower's count is too small for them (inexact, and it failed at step 1 with
    "segment_ids out of range"). Refused, saying how to feed them."""
    graph = tf.Graph()
    with graph.as_default():
        tok = v1.placeholder(tf.float32, [None, 4], name="tok")
        seg = v1.placeholder(tf.int32, [None], name="seg")
        y = v1.placeholder(tf.float32, [None], name="y")
        w = v1.get_variable("w", [4, 1], initializer=v1.glorot_uniform_initializer(seed=1))
        pooled = tf.math.unsorted_segment_sum(tf.matmul(tok, w), seg, tf.shape(y)[0])
        loss = tf.reduce_mean(tf.square(tf.reshape(pooled, [-1]) - y), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    with pytest.raises(replicate.errors.AnalysisError, match="segment ids given whole.*padded"):
        replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_sparse_feature_from_an_iterator_is_split_by_its_examples(accumulate):
    """A ``SparseTensor`` that a ``tf.data`` iterator yields (a VarLenFeature's ids, batched):
    tf.data hands it over as a variant that ``DeserializeSparse`` decodes, which the analysis
    did not read as a batch input, so every tower took the whole batch's ids beside its own
    rows of ``x`` and ``y`` and failed at step 1 (review 9). Its (indices, values, dense shape)
    are now split by the examples the indices name, like a sparse placeholder's."""
    rng = np.random.RandomState(3)
    feature = tf.train.Feature
    records = [tf.train.Example(features=tf.train.Features(feature={
        "x": feature(float_list=tf.train.FloatList(value=rng.randn(4).tolist())),
        "ids": feature(int64_list=tf.train.Int64List(value=rng.randint(0, 10, rng.randint(0, 4)).tolist())),
        "y": feature(int64_list=tf.train.Int64List(value=[int(rng.randint(0, 3))]))})).SerializeToString()
        for _ in range(14)]
    spec = {"x": v1.FixedLenFeature([4], tf.float32), "ids": v1.VarLenFeature(tf.int64),
            "y": v1.FixedLenFeature([], tf.int64)}

    def build():
        graph = tf.Graph()
        with graph.as_default():
            data = tf.data.Dataset.from_tensor_slices(records).batch(5).map(
                lambda batch: v1.parse_example(batch, spec))
            f = v1.data.make_one_shot_iterator(data).get_next()     # batches of 5, 5 and 4
            init = v1.random_normal_initializer
            emb = v1.get_variable("emb", [10, 3], initializer=init(seed=9))
            e = tf.nn.safe_embedding_lookup_sparse(emb, f["ids"], None, combiner="mean")
            h = tf.concat([f["x"], tf.reshape(e, [-1, 3])], 1)
            w = v1.get_variable("w", [7, 3], initializer=init(seed=3))
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=f["y"], logits=tf.matmul(h, w)), name="loss")
            v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
        return graph

    res = replicate.transform(build(), ["/cpu:1", "/cpu:2", "/cpu:3"], accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    assert {b.tensor for b in res.analysis.batch_inputs} >= {"DeserializeSparse:0", "DeserializeSparse:1"}
    cmp = compare(build(), res.graph, "train", 3, fetch=("loss:0",))
    assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)
