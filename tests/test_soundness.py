"""Soundness: "exact" is a guarantee. Generated graphs with the patterns that fool guesses
(tests/adversarial.py) must either be reported inexact, be refused, or train exactly as one
device does: parameters within 1e-5 (relative to their scale) after 3 steps and the merged loss
within 1e-4 at every step, on 2-4 towers with even and uneven splits."""

from __future__ import annotations

import collections
import os

import adversarial
import numpy as np
import pytest
import tensorflow as tf
from soak import Tally

import replicate
from replicate.check.equivalence import compare
from replicate.errors import InternalError

CPUS = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]
RTOL = 1e-5
#: Cases per shard; CI runs SHARDS shards (REPLICATE_FUZZ_SCALE multiplies, the soak raises it).
CASES = int(16 * float(os.environ.get("REPLICATE_FUZZ_SCALE", "1")))
SHARDS = 2
#: The first case's seed: 0 in CI; in a soak round, drawn from the round's seed.
BASE = int(os.environ.get("REPLICATE_SOUNDNESS_BASE")
           or int(os.environ.get("REPLICATE_FUZZ_SEED") or 0) % 4000 * 1_000_000)   # < 2**32


def run_case(seed: int) -> str:
    """Transform and check case ``seed``; returns its outcome. Raises AssertionError when a
    claim of exactness is false or the transform fails with anything but a clean refusal."""
    case = adversarial.draw(seed)
    model = adversarial.build(case)
    try:
        res = replicate.transform(model.graph, CPUS[:case.towers])
    except InternalError as exc:
        raise AssertionError(f"{case.describe()}: internal error: {exc}") from None
    except replicate.ReplicateError:
        return "refused"
    if not res.report.exact:
        return "inexact"
    result = compare(model.graph, res.meta_graph_def, "train", model.feeds(case.batch, steps=3, seed=seed),
                     cpus=case.towers, fetch=("loss:0",))
    single_losses = [float(single[0]) for single, _ in result.fetched]
    assert np.all(np.isfinite(single_losses)), (
        f"{case.describe()}: the generated case diverges on one device ({single_losses}): "
        "a generator bug in tests/adversarial.py, the comparison means nothing")
    assert result.max_rel <= RTOL, (f"{case.describe()}: claimed exact, but {result.worst} differs by "
                                    f"{result.max_rel:.3g} after 3 steps")
    for step, (single, multi) in enumerate(result.fetched):
        a, b = float(single[0]), float(multi[0])
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (
            f"{case.describe()}: claimed exact, but the merged loss at step {step} is {b} for {a}")
    return "exact"


@pytest.mark.parametrize("shard", range(SHARDS))
def test_claimed_exact_means_equal(shard):
    tally: collections.Counter = collections.Counter()
    stats = Tally(f"soundness[{shard}]")
    missed: collections.Counter = collections.Counter()
    for i in range(CASES):
        seed = BASE + shard * CASES + i
        outcome = run_case(seed)
        tally[outcome] += 1
        stats.add(outcome)
        case = adversarial.draw(seed)
        if adversarial.LOSSES[case.loss] and outcome != "exact":
            missed[case.loss] += 1
    stats.flush()
    print(f"shard {shard}: {dict(tally)}; exact-able families not claimed exact: {dict(missed)}")
    assert sum(tally.values()) == CASES
    exactable = sum(1 for i in range(CASES) if adversarial.LOSSES[adversarial.draw(BASE + shard * CASES + i).loss])
    assert sum(missed.values()) <= 0.1 * exactable, f"too conservative: {dict(missed)}"


@pytest.mark.parametrize("loss", ["sampled_softmax", "nce"])
def test_sampled_losses_with_mixed_static_and_dynamic_batch_inputs(loss):
    """Found by the fuzzer (x with a static batch of 8, y dynamic): shape inference left the
    row layout of the sampled loss's gradient unknown, so the analysis could not follow the
    batch through ``Reshape_2_grad`` — whose target ``[8, 1, 4]`` was folded from the static
    batch — and nothing rewrote that constant: the rewrite failed to import (an internal
    error) with no reason given. The gradient of a reshape now takes the layout of the forward
    reshape's input, so the constant is rewritten and the result is exact."""
    case = adversarial.Case(48, loss, 4, 8, True, True, 4, "relu", "sgd", False)
    model = adversarial.build(case)
    res = replicate.transform(model.graph, CPUS[:case.towers])
    assert res.report.exact, str(res.report)
    result = compare(model.graph, res.meta_graph_def, "train", model.feeds(case.batch, steps=3, seed=48),
                     cpus=case.towers, fetch=("loss:0",))
    assert result.max_rel <= RTOL, f"{result.worst} differs by {result.max_rel:.3g}"


def test_unfollowed_gradient_code_with_a_baked_batch_size_is_not_claimed_exact():
    """Gradient code the analysis cannot follow (here a custom gradient through ``Roll``, an op
    with no batch rule) that reads a constant holding a multiple of the static batch size: no
    rule located the constant, so nothing rewrites it per tower. That is a reason: a clean
    refusal (or an inexact report), never an internal error and never a claim of exact."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [8, 4], name="x")
        w = tf.compat.v1.get_variable("w", [4, 4])

        @tf.RegisterGradient("replicate_test_rolled")
        def _rolled(op, grad):
            return tf.reshape(tf.roll(grad, 1, axis=1), [8, 4])

        with graph.gradient_override_map({"Identity": "replicate_test_rolled"}):
            h = tf.identity(tf.matmul(x, w))
        loss = tf.reduce_mean(tf.square(h), name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    causes = ("gradient code reads constant", "its gradient is replaced by a custom one")
    except_text = None
    try:
        res = replicate.transform(graph, CPUS[:2])
    except InternalError as exc:
        raise AssertionError(f"internal error: {exc}") from None
    except replicate.ReplicateError as exc:
        except_text = str(exc)
    if except_text is not None:
        assert any(c in except_text for c in causes), except_text
        return
    assert not res.report.exact
    assert any(c in r.what for r in res.report.reasons for c in causes), str(res.report)
