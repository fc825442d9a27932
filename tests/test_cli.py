"""The `replicate` command line, run for real in subprocesses.

Every bad input the issue lists exits 2 with one line on stderr naming the problem, no
traceback, no output and an untouched input (one `python -m replicate` subprocess each;
more option mistakes run in-process through ``cli.main``). `convert` writes the graph,
the per-pass IR dumps and a TensorBoard event file (through the `replicate` console
script); `inspect` prints tables (in-process), or JSON with --json (console script).
"""

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf

import models
from replicate import cli

v1 = tf.compat.v1
DEVICES = "/cpu:0,/cpu:1"

#: Lines TensorFlow's C++ runtime prints while it is imported, before logging is set up.
NATIVE_NOISE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\)|"
                          r"[IWEF]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] |"
                          r"To enable the following instructions:)")


def replicate_cli(*args, cwd=None, entry=None):
    """Run the CLI (``python -m replicate`` unless ``entry`` names another executable)."""
    command = [entry] if entry else [sys.executable, "-m", "replicate"]
    return subprocess.run(command + [str(a) for a in args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


#: Subprocess results by bad-input case, reused by the stricter stderr test.
RUNS = {}


def user_lines(stderr):
    """stderr without TensorFlow's start-up noise."""
    return [line for line in stderr.splitlines() if line.strip() and not NATIVE_NOISE.match(line)]


def digest(path):
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def inputs_digests(files):
    """A digest of every input file: inputs are never modified."""
    names = (os.path.join(files["dir"], n) for n in os.listdir(files["dir"]))
    return {p: digest(p) for p in names if os.path.isfile(p)}


def listing(*dirs):
    return {d: sorted(os.listdir(d)) for d in dirs}


def _export(graph, path):
    v1.train.export_meta_graph(path, graph=graph)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Input files, good and bad, in one directory."""
    root = tmp_path_factory.mktemp("inputs")
    model = models.mlp("adam")
    with model.graph.as_default():
        good = str(root / "good.meta")
        v1.train.Saver().export_meta_graph(good)
    forward = tf.Graph()
    with forward.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        tf.matmul(x, v1.get_variable("w", [4, 2]), name="logits")
    two = tf.Graph()
    with two.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        for name in ("pretrain", "finetune"):
            loss = tf.reduce_mean(tf.matmul(x, v1.get_variable(f"w_{name}", [4, 2])))
            v1.train.GradientDescentOptimizer(0.1).minimize(loss, name=name)
    data = open(good, "rb").read()
    corrupt = bytearray(data)
    for i in range(100, len(corrupt), 97):
        corrupt[i] ^= 0x5A
    for name, content in (("truncated.meta", data[: len(data) // 2]), ("corrupt.meta", bytes(corrupt)),
                          ("notes.meta", b"these are my notes, not a graph\n"),
                          ("existing.meta", b"precious"), ("afile", b"x")):
        (root / name).write_bytes(content)
    return {"dir": str(root), "good": good, "forward": _export(forward, str(root / "forward.meta")),
            "ambiguous": _export(two, str(root / "ambiguous.meta")),
            **{n: str(root / f"{n}.meta") for n in ("truncated", "corrupt", "notes", "existing")},
            "afile": str(root / "afile")}


BAD = {
    # case: (input, output, extra args, words the one stderr line must contain)
    "missing file": ("{dir}/missing.meta", "{out}/o.meta", [], ["missing.meta", "no such file"]),
    "corrupt": ("{corrupt}", "{out}/o.meta", [], ["corrupt.meta", "corrupt"]),
    "no optimizer": ("{forward}", "{out}/o.meta", [], ["forward.meta", "no train op"]),
}

#: More refusals, checked in-process like MORE_BAD (each subprocess costs a TensorFlow
#: import, ~10 s here): the three above show the whole process's exit code and one line.
BAD_IN_PROCESS = {
    "not a graph": ("{notes}", "{out}/o.meta", [], ["notes.meta", "not a TensorFlow graph"]),
    "truncated": ("{truncated}", "{out}/o.meta", [], ["truncated.meta", "not a TensorFlow graph"]),
    "unknown train op": ("{ambiguous}", "{out}/o.meta", ["--train-op", "nope"],
                         ["ambiguous.meta", "train op 'nope' is not a node of the graph"]),
    "malformed device": ("{good}", "{out}/o.meta", ["--devices", "/cpu:0,gpu1"],
                         ["--devices", "'gpu1'", "not a TensorFlow device"]),
    "duplicated device": ("{good}", "{out}/o.meta", ["--devices", "/cpu:0,/device:CPU:0"],
                          ["--devices", "listed twice"]),
    "output exists": ("{good}", "{existing}", [], ["existing.meta", "already exists", "--force"]),
    "unwritable output": ("{good}", "{afile}/o.meta", [], ["afile/o.meta", "not a directory"]),
}


MORE_BAD = {
    "output is the input": ("{good}", "{good}", ["--force"], ["good.meta", "is the input"]),
    "missing output directory": ("{good}", "{out}/no/o.meta", [], ["no/o.meta", "does not exist"]),
    "two controllers": ("{good}", "{out}/o.meta", ["--controller", "/cpu:0,/cpu:1"],
                        ["--controller", "exactly one device"]),
    "empty device": ("{good}", "{out}/o.meta", ["--devices", "/cpu:0,,/cpu:1"], ["empty device"]),
    "unknown train op": ("{good}", "{out}/o.meta", ["--train-op", "nope"], ["good.meta", "'nope'"]),
    "unknown loss": ("{good}", "{out}/o.meta", ["--loss", "nope:0"], ["good.meta", "'nope:0'"]),
    "SavedModel from a .meta": ("{good}", "{out}/sm", ["--format", "savedmodel"],
                                ["--format savedmodel needs a SavedModel input"]),
    "unwritable tensorboard dir": ("{good}", "{out}/o.meta", ["--tensorboard", "{afile}/tb"],
                                   ["--tensorboard", "afile is not a directory"]),
    "dump dir is a file": ("{good}", "{out}/o.meta", ["--dump-dir", "{afile}"],
                           ["--dump-dir", "exists and is a file, not a directory"]),
    "unknown output name": ("{good}", "{out}/o.meta", ["--outputs", "logits:0,nope:0"],
                            ["good.meta", "nope"]),
}


MORE_BAD.update(BAD_IN_PROCESS)


def _bad_case(cases, case, tmp_path, files):
    source, output, extra, words = cases[case]
    fill = dict(out=tmp_path, **files)
    extra = [e.format(**fill) for e in extra]
    if "--devices" not in extra:
        extra = extra + ["--devices", DEVICES]
    return source.format(**fill), output.format(**fill), extra, words


#: A progress line: printed once a conversion has run a second (on a busy machine, a refusal
#: after the analysis can be that late).
PROGRESS = re.compile(r"^replicate convert: \[\d+/\d+\] ")


def _check_refusal(returncode, stdout, stderr, words, files, tmp_path, before, digests):
    assert returncode == 2, stderr
    lines = [line for line in user_lines(stderr) if not PROGRESS.match(line)]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("replicate convert: error: ")
    for word in words:
        assert word in lines[0]
    assert "Traceback" not in stderr
    assert stdout == ""
    assert listing(files["dir"], str(tmp_path)) == before
    assert {p: digest(p) for p in digests} == digests


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, files, case):
    source, output, extra, words = _bad_case(BAD, case, tmp_path, files)
    before = listing(files["dir"], str(tmp_path))
    digests = inputs_digests(files)
    proc = RUNS[case] = replicate_cli("convert", source, "-o", output, *extra)
    _check_refusal(proc.returncode, proc.stdout, proc.stderr, words, files, tmp_path, before, digests)


@pytest.mark.parametrize("case", sorted(MORE_BAD))
def test_more_bad_options_in_process(tmp_path, files, capfd, case):
    source, output, extra, words = _bad_case(MORE_BAD, case, tmp_path, files)
    before = listing(files["dir"], str(tmp_path))
    digests = inputs_digests(files)
    code = cli.main(["convert", source, "-o", output, *extra])
    captured = capfd.readouterr()
    _check_refusal(code, captured.out, captured.err, words, files, tmp_path, before, digests)


def test_debug_shows_the_traceback(files, tmp_path, capfd):
    code = cli.main(["--debug", "convert", files["forward"], "-o", str(tmp_path / "o.meta"),
                     "--devices", DEVICES])
    err = capfd.readouterr().err
    assert code == 2
    assert "Traceback" in err and "AnalysisError" in err
    assert err.strip().splitlines()[-1].startswith("replicate convert: error: ")
    assert os.listdir(tmp_path) == []


def test_stderr_is_exactly_one_line(files, tmp_path):
    proc = RUNS.get("missing file")
    if proc is None:
        source, output, extra, _ = _bad_case(BAD, "missing file", tmp_path, files)
        proc = replicate_cli("convert", source, "-o", output, *extra)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_convert_writes_graph_dumps_and_tensorboard_events(tmp_path, files):
    out, dumps, logdir = tmp_path / "out.meta", tmp_path / "dumps", tmp_path / "tb"
    out.write_bytes(b"old result")
    proc = replicate_cli("convert", files["good"], "-o", out, "--devices", DEVICES, "--force",
                         "--verify-each", "--dump-dir", dumps, "--tensorboard", logdir,
                         entry=SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out} (meta, 2 towers)" in proc.stdout
    assert "exact         yes" in proc.stdout
    assert "  check         ran on logical CPUs" in proc.stdout      # convert checks by default
    meta = v1.MetaGraphDef.FromString(out.read_bytes())
    assert any(n.name.startswith("tower_1/") for n in meta.graph_def.node)
    assert meta.collection_def["train_op"].node_list.value == ["train"]
    passes = [name.split("_", 1)[1] for name in sorted(os.listdir(dumps))]
    assert passes[0] == "analyze.pbtxt" and passes[-1] == "validate.pbtxt" and len(passes) >= 7
    events = [os.path.join(logdir, f) for f in os.listdir(logdir)]
    assert len(events) == 1 and "tfevents" in events[0]
    graphs = [e.graph_def for e in v1.train.summary_iterator(events[0]) if e.graph_def]
    assert len(graphs) == 1
    graph = tf.compat.v1.GraphDef.FromString(graphs[0])
    assert {n.name for n in graph.node} == {n.name for n in meta.graph_def.node}
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".replicate-")]


#: The console script installed next to this interpreter.
SCRIPT = os.path.join(os.path.dirname(sys.executable), "replicate")


@pytest.fixture(scope="module")
def warned(tmp_path_factory):
    return _warned_model(str(tmp_path_factory.mktemp("warned") / "warned.meta"))


def _warned_model(path):
    """Static batch baked into a reshape, a trainable variable left out, a zero learning rate."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [8, 4], name="x")
        y = v1.placeholder(tf.int64, [8], name="y")
        w = v1.get_variable("w", [4, 3])
        frozen = v1.get_variable("frozen", [3])
        logits = tf.reshape(tf.matmul(x, w) + frozen, [8, 3], name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        v1.train.GradientDescentOptimizer(0.0).minimize(loss, var_list=[w], name="train")
    return _export(graph, path)


def test_inspect_prints_tables_and_warnings(warned, capsys):
    assert cli.main(["inspect", warned, "--devices", "/gpu:0,/gpu:1,/gpu:2"]) == 0
    text = capsys.readouterr().out
    for heading in ("Training", "Inputs", "Optimizers", "Variables: 2", "Replication over 3 towers",
                    "Exact: ", "Warnings: "):
        assert heading in text
    assert re.search(r"^  x:0 +0 +8 +float32 +\[8, 4\] +split across towers$", text, re.M)
    assert re.search(r"^  GradientDescent +1$", text, re.M)
    assert re.search(r"^  frozen +resource +float32 +\[3\] +12 B +no$", text, re.M)
    warnings = text.split("Warnings: ", 1)[1]
    assert "static batch size 8" in warnings
    assert "bake in the batch size 8" in warnings
    assert "'frozen' gets no gradient" in warnings
    assert "learning rate of" in warnings and "is 0" in warnings
    assert os.listdir(os.path.dirname(warned)) == ["warned.meta"]


def test_inspect_json_from_the_console_script(warned):
    proc = replicate_cli("inspect", warned, "--json", entry=SCRIPT)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["devices_assumed"] is True and len(info["devices"]) == 2
    assert [(i["tensor"], i["axis"], i["static_size"]) for i in info["inputs"]] == [
        ("x:0", 0, 8), ("y:0", 0, 8)]
    assert info["loss"] == "loss:0" and info["train_op"] == "train"
    assert info["optimizers"] == {"GradientDescent": 1}
    assert info["variables"]["count"] == 2 and info["variables"]["bytes"] == (12 + 3) * 4
    assert {v["name"]: v["trained"] for v in info["variables"]["list"]} == {"w": True, "frozen": False}
    assert info["replicated"]["nodes_per_tower"] > 0 and info["shared"]["variables"] == 2
    assert info["exact"] is True and info["reasons"] == []
    assert len(info["warnings"]) == 4 and "'frozen' gets no gradient" in info["warnings"][2]
    assert "logits:0" in info["merged_outputs"]


def test_convert_check_contradicting_a_claim_exits_1(files, tmp_path, capfd, monkeypatch):
    """The numeric check runs by default; when it contradicts a claim of exactness (planted
    here: the analysis is told no random draw needs care, in a model with dropout) OUT is
    written, the report says inexact with the variable, and the exit status is 1."""
    from replicate.passes import _draws

    path = str(tmp_path / "dropout.meta")
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(3)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        w = tf.compat.v1.get_variable("w", [4, 2], use_resource=True)
        h = tf.nn.dropout(tf.matmul(x, w), rate=0.5, seed=1)
        loss = tf.reduce_mean(tf.square(h), name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
        tf.compat.v1.train.Saver().export_meta_graph(path)
    out = tmp_path / "out.meta"
    assert cli.main(["convert", path, "-o", str(out), "--devices", DEVICES, "--no-check"]) == 0
    assert "  check " not in capfd.readouterr().out
    monkeypatch.setattr(_draws, "reproducible", lambda ir, flow, names: ({}, []))
    code = cli.main(["convert", path, "-o", str(out), "--devices", DEVICES, "--force"])
    printed = capfd.readouterr().out
    assert code == 1 and out.exists()
    assert "the numeric check found 'w'" in printed and "exact         NO" in printed
