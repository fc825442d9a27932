"""Issue 24: `replicate inspect` estimates a step's memory per device from static shapes, and
the estimate is close to what one traced step allocates."""

import json

import pytest
import tensorflow as tf

import models
from replicate import api, memory
from replicate.cli import main
from test_accumulate import _breakdown

v1 = tf.compat.v1


@pytest.fixture(scope="module")
def cnn():
    return models.cnn(filters=(8, 16), dense=64)


@pytest.fixture(scope="module")
def cnn_meta(cnn, tmp_path_factory):
    path = tmp_path_factory.mktemp("memory") / "cnn.meta"
    v1.train.export_meta_graph(str(path), graph=cnn.graph)
    return path


def test_estimate_is_close_to_a_traced_step(cnn):
    """Activations within 0.6-1.25x of the measured peak (the estimate leaves out kernels'
    scratch buffers and TensorFlow frees some saved tensors early), gradients within 15%:
    for one device on the whole batch and for 4 micro-batches on one device."""
    ir = api.analyze_only(cnn.graph)
    analysis = ir.facts["analysis"]
    feed = cnn.feeds(64, 1)[0]
    for micro in (1, 4):
        graph = cnn.graph if micro == 1 else api.transform(cnn.graph, ["/cpu:0"], accumulate=micro).graph
        measured = _breakdown(graph, "train", feed)[0]
        est = memory.estimate(ir, analysis, 1, micro, 64).to_dict()["per_device"]
        assert 0.6 <= est["activations"] / measured.activation_peak <= 1.25, (micro, est, measured)
        assert 0.85 <= est["gradients"] / measured.gradient_peak <= 1.15, (micro, est, measured)


def test_per_device_figures_scale_with_towers_and_micro_batches(cnn):
    ir = api.analyze_only(cnn.graph)
    analysis = ir.facts["analysis"]
    one = memory.estimate(ir, analysis, 1, 1, 100).to_dict()
    estimate = memory.estimate(ir, analysis, 3, 4, 100)
    split = estimate.to_dict()
    per_example = one["saved_activation_bytes_per_example"]
    assert per_example > 0 and one["per_device"]["activations"] == 100 * per_example
    assert split["examples_per_micro_batch"] == 9                       # ceil(100 / 12)
    # 36 rows of 7x7x16 inputs and 64 output gradients kept: less than the 784 x 64 gradient
    assert estimate.deferred() == ["cnn/fc/weights"], estimate.deferred()
    kept = 4 * 9 * (784 + 64) * 4
    assert split["per_device"]["activations"] == 9 * per_example + kept
    sizes = {v.name: v.bytes for v in analysis.variables.values() if v.trainable}
    trained = sum(sizes.values())
    in_flight = max(b for v, b in sizes.items() if v != "cnn/fc/weights")
    assert one["per_device"]["gradients"] == trained
    assert split["per_device"]["gradients"] == trained + in_flight    # running sums + one in flight
    assert split["one_device"] == one["one_device"]


def test_inspect_prints_the_estimate(cnn_meta, capsys):
    assert main(["inspect", str(cnn_meta), "--devices", "/cpu:0,/cpu:1", "--accumulate", "4",
                 "--batch", "256"]) == 0
    out = capsys.readouterr().out
    assert "Memory per step (estimate from static shapes, global batch 256" in out
    assert "each tower device (32 examples at a time)" in out and "one device, for comparison" in out
    assert "kept slices" not in out                     # 4 x 32 rows: more than the gradient
    assert main(["inspect", str(cnn_meta), "--devices", "/cpu:0,/cpu:1", "--accumulate", "4",
                 "--batch", "64"]) == 0
    assert ("computed once from the micro-batches' kept slices (smaller than a running sum at "
            "this batch): cnn/fc/weights") in capsys.readouterr().out
    assert main(["inspect", str(cnn_meta), "--devices", "/cpu:0", "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["memory"]
    assert mem["batch"] is None and mem["per_device"]["activations"] is None
    assert mem["saved_activation_bytes_per_example"] > 0 and mem["state_bytes"] > 0


def test_inspect_refuses_a_bad_batch(cnn_meta, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(cnn_meta), "--batch", "0"])
    assert exit_.value.code == 2
    assert "--batch: '0': give a whole number of examples, 1 or more" in capsys.readouterr().err
