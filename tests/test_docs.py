"""Docs are code: every ```python and ```sh/```bash/```console block of README.md and docs/*.md
runs as written, and where a block is followed by ``<!-- output -->`` and a fenced block, its
output is that block.

How the blocks run:

- Each file's blocks run in order in one fresh temporary directory that holds ``model.meta``
  and the checkpoint ``ckpt/model-20``: the README's Usage graph (``x:0``, ``y:0``,
  ``logits``, ``loss:0``, ``train``), exported and trained one step on one device. The docs
  call a user's model ``model.meta``; this is that model.
- All blocks of a file run in document order in one subprocess (one TensorFlow import per
  file): python blocks one after the other in one namespace (a later block may use an
  earlier block's names, as a reader would), with ``TF_USE_LEGACY_KERAS=1`` only when the
  file tells the reader to set it; shell blocks line by line, ``$ `` prompts stripped and
  ``\\`` continuations joined — a plain ``replicate ...`` line through ``replicate.cli.main``
  (what the console script runs), any other line in bash — with this checkout first on
  PYTHONPATH. Any line that fails fails the test.
- A block right after ``<!-- no-test: REASON -->`` is not run; REASON must say why (a
  cluster, a GPU, installing packages, a run of many minutes) and the test lists them.

docs/distributed.md is excluded: another engineer is rewriting it (#25.3); add it back here
when that lands. Whatever doc is added to docs/ later is picked up automatically.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Docs not run, with why.
EXCLUDED = {
    "docs/distributed.md": "being rewritten by another engineer (#25.3); add back when it lands",
}

DOCS = [p for p in ["README.md"] + sorted(os.path.relpath(p, ROOT)
                                          for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
        if p not in EXCLUDED]

PYTHON = ("python",)
SHELL = ("sh", "bash", "console", "shell")
FENCE = re.compile(r"^```([\w-]*)\s*$")
NO_TEST = re.compile(r"<!--\s*no-test:\s*(.+?)\s*-->")
OUTPUT = re.compile(r"<!--\s*output\s*-->")
SEPARATOR = "----- replicate docs block {} -----"


def blocks(path: str) -> list[dict]:
    """The fenced blocks of ``path``: language, code, line, skip reason, expected output."""
    lines = open(os.path.join(ROOT, path), encoding="utf-8").read().splitlines()
    found, i, previous = [], 0, ""
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        start, lang = i, match.group(1).lower()
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        skip = NO_TEST.search(previous)
        block = {"lang": lang, "code": "\n".join(body) + "\n", "line": start + 1,
                 "skip": skip.group(1) if skip else None, "output": None}
        if OUTPUT.search(previous) and found:
            found[-1]["output"] = block["code"]
        else:
            found.append(block)
        previous = ""
    return found


def runnable(path: str) -> list[dict]:
    return [b for b in blocks(path) if b["lang"] in PYTHON + SHELL]


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """model.meta and ckpt/model-20: the README's Usage graph on one device."""
    import numpy as np
    import tensorflow as tf

    v1 = tf.compat.v1
    root = tmp_path_factory.mktemp("model")
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(0)
        x = v1.placeholder(tf.float32, [None, 784], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        w = v1.get_variable("w", [784, 10])
        b = v1.get_variable("b", [10], initializer=v1.zeros_initializer())
        logits = tf.add(tf.matmul(x, w), b, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        train = v1.train.AdamOptimizer(1e-3).minimize(loss, name="train")
        saver = v1.train.Saver()
        with v1.Session(graph=graph) as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train, {x: np.zeros([4, 784], np.float32), y: np.zeros([4], np.int64)})
            saver.save(sess, str(root / "ckpt" / "model"), global_step=20)
        saver.export_meta_graph(str(root / "model.meta"))
    return root


def _workdir(model_files, tmp_path):
    import shutil

    shutil.copytree(model_files, tmp_path, dirs_exist_ok=True)
    return str(tmp_path)


def _env(path: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("TF_USE_LEGACY_KERAS", None)           # set only where the doc tells the reader to
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    if re.search(r"TF_USE_LEGACY_KERAS=1", text) and "tf.compat.v1.layers" in "".join(
            b["code"] for b in runnable(path)):
        env["TF_USE_LEGACY_KERAS"] = "1"
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def _compare(expected: str, actual: str, where: str) -> None:
    """``actual`` output equals ``expected``; a line ``...`` in ``expected`` matches any lines."""
    want = [line.rstrip() for line in expected.strip("\n").splitlines()]
    got = [line.rstrip() for line in actual.strip("\n").splitlines()]
    pattern = "\n".join(".*?" if line == "..." else re.escape(line) for line in want)
    assert re.fullmatch(pattern, "\n".join(got), re.S), (
        f"{where}: documented output\n{expected}\ndiffers from the actual\n{actual}")


#: Defined first in each file's script: runs one shell block, line by line. A line that is a
#: plain ``replicate ...`` command (no shell operators) runs in this process through
#: ``replicate.cli.main`` — the console script's own entry point — so TensorFlow is imported
#: once per file; any other line runs in bash.
SHELL_RUNNER = r"""
def _docs_shell(_docs_code):
    import shlex, subprocess, sys
    from replicate import cli as _docs_cli
    _docs_lines, _docs_joined = [], ""
    for _docs_line in _docs_code.splitlines():
        _docs_line = _docs_line[2:] if _docs_line.startswith("$ ") else _docs_line
        if _docs_line.rstrip().endswith("\\"):
            _docs_joined += _docs_line.rstrip()[:-1] + " "
            continue
        _docs_lines.append(_docs_joined + _docs_line)
        _docs_joined = ""
    for _docs_line in _docs_lines:
        _docs_bare = _docs_line.split(" #")[0].strip()
        if not _docs_bare or _docs_bare.startswith("#"):
            continue
        _docs_words = shlex.split(_docs_bare)
        sys.stdout.flush()
        if _docs_words[0] == "replicate" and not set("&|;<>$`") & set(_docs_bare):
            _docs_status = _docs_cli.main(_docs_words[1:])
        else:
            _docs_status = subprocess.run(["bash", "-e", "-c", _docs_line]).returncode
        sys.stdout.flush()
        if _docs_status != 0:
            raise SystemExit(f"shell line failed with status {_docs_status}: {_docs_line}")
"""


def _script(blocks_: list[dict]) -> str:
    """One python script running ``blocks_`` in order, a separator line before each."""
    parts = [SHELL_RUNNER]
    for k, block in enumerate(blocks_):
        parts.append(f"print({SEPARATOR.format(k)!r}, flush=True)\n")
        if block["lang"] in PYTHON:
            parts.append(block["code"])
        else:
            parts.append(f"_docs_shell({block['code']!r})\n")
    return "".join(parts)


def _split(stdout: str) -> dict[int, list[str]]:
    """The output of each block, by index, from the separators."""
    parts, current = {}, None
    for line in stdout.split("\n"):
        match = re.fullmatch(SEPARATOR.format(r"(\d+)"), line)
        if match:
            current = int(match.group(1))
            parts[current] = []
        elif current is not None:
            parts[current].append(line)
    return parts


@pytest.mark.parametrize("path", DOCS)
def test_doc_blocks_run_as_written(path, model_files, tmp_path):
    """Every runnable block of ``path`` in document order, in one subprocess."""
    cwd = _workdir(model_files, tmp_path)
    todo = [b for b in runnable(path) if not b["skip"]]
    if not todo:
        return
    proc = subprocess.run([sys.executable, "-c", _script(todo)], cwd=cwd, env=_env(path),
                          capture_output=True, text=True, timeout=600)
    parts = _split(proc.stdout)
    failed = todo[max(parts) if parts else 0]
    assert proc.returncode == 0, (f"{path}:{failed['line']}: the {failed['lang']} block fails:\n"
                                  f"{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
    for k, block in enumerate(todo):
        if block["output"] is not None:
            _compare(block["output"], "\n".join(parts.get(k, [])), f"{path}:{block['line']}")


REASONS = re.compile(r"cluster|GPU|install|minutes", re.I)


@pytest.mark.parametrize("path", DOCS)
def test_blocks_not_run_say_why(path):
    for block in runnable(path):
        if block["skip"]:
            assert REASONS.search(block["skip"]), f"{path}:{block['line']}: {block['skip']}"


def test_every_doc_has_its_runnable_blocks_found():
    """The extractor sees the blocks this test relies on (guards against a silent no-op)."""
    readme = runnable("README.md")
    assert any("replicate.transform" in b["code"] and b["output"] for b in readme)
    assert any(b["lang"] == "sh" for b in runnable("docs/show.md"))


def test_cli_md_lists_every_inspect_json_key(model_files, capsys):
    from replicate import cli

    assert cli.main(["inspect", str(model_files / "model.meta"), "--json",
                     "--devices", "/cpu:0,/cpu:1"]) == 0
    keys = set(json.loads(capsys.readouterr().out))
    text = open(os.path.join(ROOT, "docs", "cli.md"), encoding="utf-8").read()
    listed = text[text.index("`--json` prints the same data"):].split("\n\n")[0]
    missing = sorted(k for k in keys if f"`{k}`" not in listed)
    assert not missing, f"docs/cli.md does not list inspect --json keys {missing}"
    assert {"accumulate", "mirrored"} <= keys


def test_show_docs_do_not_claim_system_graphviz():
    from replicate.cli.commands import show

    claims = re.compile(r"apt-get install -y graphviz|brew install graphviz|"
                        r"need[s]? Graphviz's `?dot`? program|comes from the system", re.I)
    assert not claims.search(open(os.path.join(ROOT, "docs", "show.md"), encoding="utf-8").read())
    assert not claims.search(show.__doc__)
    assert "pygraphviz" in show.__doc__
