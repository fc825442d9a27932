"""Device strings: parsed by tf.DeviceSpec, then range-checked (#25.2), in the API and the CLI,
and checked before the output so one error does not hide another."""

import models
import pytest
import tensorflow as tf

import replicate
from replicate import DeviceError, cli
from replicate.rewrite import MAX_DEVICE_INDEX, normalize_device
from replicate.viz import show

v1 = tf.compat.v1


@pytest.mark.parametrize("device,match", [
    ("/gpu:-1", "device index -1 is out of range"),
    ("/gpu:99999999999999999999", "device index 99999999999999999999 is out of range"),
    (f"/gpu:{MAX_DEVICE_INDEX + 1}", f"device index {MAX_DEVICE_INDEX + 1} is out of range"),
    ("/job:worker/task:-1/cpu:0", "task -1 is out of range"),
    ("/job:worker/replica:-2/task:0/cpu:0", "replica -2 is out of range"),
    ("/job:worker/task:99999999999/cpu:0", "task 99999999999 is out of range"),
])
def test_out_of_range_indices_are_refused(device, match):
    with pytest.raises(DeviceError, match=match):
        normalize_device(device)


@pytest.mark.parametrize("device,canonical", [
    ("/gpu:0", "/device:GPU:0"),
    (f"/gpu:{MAX_DEVICE_INDEX}", f"/device:GPU:{MAX_DEVICE_INDEX}"),
    ("/job:worker/task:3/device:CPU:1", "/job:worker/task:3/device:CPU:1"),
])
def test_sane_devices_still_pass(device, canonical):
    assert normalize_device(device) == canonical


def test_transform_refuses_bad_towers_controller_and_parameter_devices():
    graph = models.mlp().graph
    with pytest.raises(DeviceError, match="'/cpu:-1'"):
        replicate.transform(graph, ["/cpu:0", "/cpu:-1"])
    with pytest.raises(DeviceError, match="controller '/cpu:-3'"):
        replicate.transform(graph, ["/cpu:0"], controller="/cpu:-3")
    with pytest.raises(DeviceError, match="parameter device '/cpu:123456'"):
        replicate.transform(graph, ["/cpu:0"], param_devices=["/cpu:123456"])


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("in") / "good.meta")
    with models.mlp("adam").graph.as_default():
        v1.train.Saver().export_meta_graph(path)
    return path


@pytest.mark.parametrize("command", ["convert", "show"])
@pytest.mark.parametrize("option,value", [("--devices", "/gpu:-1"),
                                          ("--devices", "/cpu:0,/gpu:99999999999999999999"),
                                          ("--controller", "/cpu:-1")])
def test_cli_names_the_bad_device_before_the_existing_output(good, tmp_path, capfd, command,
                                                             option, value):
    existing = tmp_path / "existing.dot"
    existing.write_bytes(b"precious")
    args = {"--devices": "/cpu:0", "--controller": "/cpu:0", option: value}
    code = cli.main([command, good, "-o", str(existing), "--devices", args["--devices"],
                     "--controller", args["--controller"]])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and option in err[0] and "out of range" in err[0], err
    assert "already exists" not in err[0]
    assert existing.read_bytes() == b"precious"


def test_show_api_names_the_bad_device_before_the_existing_output(tmp_path):
    existing = tmp_path / "existing.dot"
    existing.write_bytes(b"precious")
    with pytest.raises(DeviceError, match="out of range"):
        show.show(models.mlp().graph, ["/cpu:0", "/cpu:-1"], str(existing), fmt="dot")
    assert existing.read_bytes() == b"precious"
