"""Output safety (replicate/graph/outputs.py): what every command may write, and how.

Each case runs the real command line in-process (``cli.main``) against a real file-system
object — a device node, a symbolic link, a directory, a FIFO, a missing parent — and checks
the exit status, the one error line and that the object is exactly as it was. Ctrl-C is
sent for real (SIGINT to this process, or to a ``replicate`` subprocess).
"""

import os
import signal
import stat
import subprocess
import sys
import time

import models
import pytest
import tensorflow as tf

from replicate import cli
from replicate.errors import OutputError
from replicate.graph import io, outputs

v1 = tf.compat.v1
DEVICES = ["--devices", "/cpu:0,/cpu:1"]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("in") / "good.meta")
    with models.mlp("adam").graph.as_default():
        v1.train.Saver().export_meta_graph(path)
    return path


def convert(good, output, *extra):
    return cli.main(["convert", good, "-o", str(output), "--no-check", *DEVICES, *map(str, extra)])


def error_line(capfd):
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("replicate")]
    assert len(err) == 1, err
    return err[0]


def temporaries(directory):
    return [n for n in os.listdir(directory) if n.startswith(outputs.TEMP_PREFIX)]


@pytest.fixture
def device_node(tmp_path):
    """A character device like /dev/null: a copy of its node in tmp_path when we may make
    one (root), else /dev/null itself (which the code under test must then leave alone)."""
    if os.geteuid() == 0:
        path = str(tmp_path / "null")
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        return path
    return os.devnull


def test_dev_null_is_refused_by_the_check_even_with_force():
    with pytest.raises(OutputError, match="character device"):
        outputs.check_file(os.devnull, force=True)
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_convert_to_a_device_node_with_force_leaves_it_a_device(good, device_node, capfd):
    before = os.lstat(device_node)
    assert convert(good, device_node, "--force") == 2
    line = error_line(capfd)
    assert "character device" in line and "not a regular file" in line
    after = os.lstat(device_node)
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev
    assert after.st_ino == before.st_ino


def test_symlink_to_a_regular_file_is_refused_even_with_force(good, tmp_path, capfd):
    target = tmp_path / "elsewhere" / "target.meta"
    target.parent.mkdir()
    target.write_bytes(b"precious")
    link = tmp_path / "out.meta"
    link.symlink_to(target)
    assert convert(good, link, "--force") == 2
    assert "symbolic link" in error_line(capfd)
    assert link.is_symlink() and target.read_bytes() == b"precious"
    assert temporaries(tmp_path) == [] and temporaries(target.parent) == []


def test_dangling_symlink_is_refused_and_nothing_appears_at_its_target(good, tmp_path, capfd):
    link = tmp_path / "out.meta"
    link.symlink_to(tmp_path / "nowhere.meta")
    assert convert(good, link) == 2
    assert "symbolic link" in error_line(capfd)
    assert not (tmp_path / "nowhere.meta").exists() and link.is_symlink()


def test_directory_where_a_file_is_expected_is_refused_even_with_force(good, tmp_path, capfd):
    out = tmp_path / "out.meta"
    out.mkdir()
    (out / "keep").write_text("x")
    assert convert(good, out, "--force") == 2
    assert "is a directory, not a regular file" in error_line(capfd)
    assert os.listdir(out) == ["keep"]


def test_fifo_is_refused_even_with_force(good, tmp_path, capfd):
    fifo = tmp_path / "out.meta"
    os.mkfifo(fifo)
    assert convert(good, fifo, "--force") == 2
    assert "FIFO" in error_line(capfd)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_missing_parent_directory_is_refused(good, tmp_path, capfd):
    assert convert(good, tmp_path / "no" / "out.meta") == 2
    assert "does not exist" in error_line(capfd)
    assert os.listdir(tmp_path) == []


def test_happy_path_and_force(good, tmp_path, capfd):
    out = tmp_path / "out.meta"
    assert convert(good, out, "-q") == 0
    written = out.read_bytes()
    assert any(n.name.startswith("tower_1/") for n in v1.MetaGraphDef.FromString(written).graph_def.node)
    out.write_bytes(b"old")
    assert convert(good, out, "-q") == 2                       # exists, no --force
    assert "already exists (use --force" in error_line(capfd)
    assert out.read_bytes() == b"old"
    assert convert(good, out, "-q", "--force") == 0            # regular file, --force
    assert out.read_bytes() == written
    assert temporaries(tmp_path) == []


def test_show_refuses_a_device_node(good, device_node, capfd):
    code = cli.main(["show", good, *DEVICES, "-o", device_node,
                     "--format", "dot", "--force"])
    assert code == 2
    assert "character device" in error_line(capfd)
    assert stat.S_ISCHR(os.lstat(device_node).st_mode)


def test_saved_model_output_over_a_file_is_refused(tmp_path):
    path = tmp_path / "sm"
    path.write_bytes(b"a file")
    with pytest.raises(OutputError, match="is a file, not a directory"):
        io.check_writable(str(path), force=True, directory=True)
    assert path.read_bytes() == b"a file"


def test_tensorboard_dir_follows_the_same_rules_as_o(good, tmp_path, capfd):
    out = tmp_path / "out.meta"
    # a missing parent is refused, like -o (it used to be created silently)
    assert convert(good, out, "--tensorboard", tmp_path / "a" / "b" / "tb") == 2
    assert "--tensorboard" in (line := error_line(capfd)) and "does not exist" in line
    assert os.listdir(tmp_path) == []
    # a link is refused
    real = tmp_path / "real_tb"
    real.mkdir()
    (tmp_path / "tb_link").symlink_to(real)
    assert convert(good, out, "--tensorboard", tmp_path / "tb_link") == 2
    assert "symbolic link" in error_line(capfd)
    assert os.listdir(real) == [] and not out.exists()
    # a device node is refused
    assert convert(good, out, "--tensorboard", os.devnull) == 2
    assert "not a directory" in error_line(capfd)
    # the last component is created when its parent exists; an existing one gets a new file
    assert convert(good, out, "-q", "--tensorboard", tmp_path / "tb") == 0
    assert len(os.listdir(tmp_path / "tb")) == 1
    assert temporaries(tmp_path) == [] and temporaries(tmp_path / "tb") == []
    assert convert(good, out, "-q", "--force", "--tensorboard", real) == 0
    events = os.listdir(real)
    assert len(events) == 1 and "tfevents" in events[0]


def test_dump_dir_missing_parent_is_refused(good, tmp_path, capfd):
    assert convert(good, tmp_path / "out.meta", "--dump-dir", tmp_path / "x" / "dumps") == 2
    assert "--dump-dir" in (line := error_line(capfd)) and "does not exist" in line
    assert os.listdir(tmp_path) == []


def test_cluster_json_refuses_a_device_node_and_an_existing_file(tmp_path, capfd):
    assert cli.main(["cluster", "--json", os.devnull]) == 2
    assert "--json" in (line := error_line(capfd)) and "character device" in line
    existing = tmp_path / "c.json"
    existing.write_text("mine")
    assert cli.main(["cluster", "--json", str(existing)]) == 2
    assert "already exists" in error_line(capfd)
    assert existing.read_text() == "mine"


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    out = tmp_path / "out.bin"
    out.write_bytes(b"old")

    def broken(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OutputError, match="No space left"):
        outputs.write_file(str(out), b"new", force=True)
    assert out.read_bytes() == b"old" and temporaries(tmp_path) == []


def test_ctrl_c_while_writing_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(_fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        outputs.write_file(str(tmp_path / "out.bin"), b"new")
    assert os.listdir(tmp_path) == []


def test_ctrl_c_just_after_the_output_is_in_place_exits_0(good, tmp_path, monkeypatch, capfd):
    """A real SIGINT, delivered right after the rename that puts the output in place."""
    real_replace = os.replace

    def replace_then_interrupt(src, dst):
        real_replace(src, dst)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(os, "replace", replace_then_interrupt)
    # as in a fresh process: an earlier test in this worker may have left another handler
    # (it failed once in a full run), and the hold only replaces Python's default one
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        out = tmp_path / "out.meta"
        assert convert(good, out, "-q") == 0
        err = capfd.readouterr().err
        assert "interrupted after the outputs were in place; they are complete" in err
        v1.MetaGraphDef.FromString(out.read_bytes())             # whole
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_ctrl_c_before_the_outputs_exits_130_and_writes_nothing(tmp_path):
    """SIGINT to a real ``replicate convert`` while it starts: 130, no output, one line."""
    out = tmp_path / "out.meta"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(cli.__file__)))]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.Popen([sys.executable, "-m", "replicate", "convert", "/nonexistent.meta",
                             "-o", str(out), *DEVICES], stderr=subprocess.PIPE, text=True,
                            env=env)
    time.sleep(1.0)                                            # inside TensorFlow's import
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted; no output was written" in err
    assert "Traceback" not in err
    assert os.listdir(tmp_path) == []
