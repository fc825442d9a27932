"""Run one corpus program on 1, 2 and 3 towers through the API and the CLI; print JSON records.

    python tests/corpus/harness.py PROGRAM [--mode quick|full] [--variant NAME] [--json OUT]

What happens, per variant and global batch size:

1. The program's ``build`` makes the single-device graph; its Saver's ``export_meta_graph``
   writes ``model.meta`` (what the legacy script's ``saver.save`` writes).
2. Baseline: ``import_meta_graph(model.meta)`` in a fresh graph, the program's ``init`` ops,
   ``saver.save`` of the initial values (the checkpoint every run restores), then the
   program's driver for its K steps; the fetched values and every global and local
   variable are kept.
3. Per tower count and path:
   - ``api``: ``replicate.transform(model.meta's MetaGraphDef, devices)``; the driver runs on
     ``res.graph`` after ``init`` and a restore through the rewritten ``saver_def``;
   - ``cli``: ``python -m replicate convert model.meta -o out.meta --devices ...`` in a
     subprocess (its printed report gives the exactness claim); the unchanged driver runs on
     ``import_meta_graph(out.meta)`` after ``init`` and ``saver.restore``.
   - ``self`` (the judge's own check): the single-device graph again, restored and driven the
     same way, must reproduce the baseline.
   The same driver and the same data run; every variable and every fetched value is
   compared with the baseline (relative to scale: ``|a-b| / max(max|a|, 1e-3)``); values a
   program declares ``NONDETERMINISTIC`` on one device are recorded apart, not judged.

``--mode quick`` (the test suite's) runs the uneven batch only: for the primary variant the
API on 3 towers (and the CLI on 2 towers for the programs in ``QUICK_CLI``, none: the suite's
CLI tests convert through the command line, and the full report runs every program through
it); one API run on 2 towers of every other variant but those in ``QUICK_SKIP``. For the
programs in ``QUICK_LEAD`` the SGD sibling takes the primary's runs instead of the Adam primary. The judge's replay of one device
against itself (``self``) runs in the full report only. ``--mode full`` (docs/corpus.md) runs both batches on 1, 2 and 3 towers, API and CLI.

Each record says: program, variant, family, towers, batch, even/uneven split, path, the
report's exactness claim and reasons, the largest variable and fetch differences, and the
error (stage and first line) when something failed. Nothing here knows about replicate's
internals: it uses ``replicate.transform``, ``res.report`` and the command line only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CPUS = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]
#: A claimed-exact run must agree within this relative difference after the driver's steps.
RTOL = 1e-5
SEED = 1234

#: (towers, index into BATCHES) per path and mode. The primary variant gets the whole plan,
#: the others (in quick mode) only ``QUICK_OTHERS``. Quick mode is the test suite's: one
#: global batch (the uneven one), the API on 3 towers (the judge's replay and the CLI runs
#: are the full report's, for the suite's time budget).
PLANS = {
    "quick": {"api": [(3, 1)], "cli": [(2, 1)]},
    "full": {"self": [(1, 0)], "api": [(1, 0), (2, 0), (3, 0), (2, 1), (3, 1)],
             "cli": [(1, 0), (2, 0), (3, 0), (2, 1), (3, 1)]},
}


#: Quick mode converts through the CLI only for these programs: each CLI run costs a
#: TensorFlow import (~5 s of CPU) and the test suite's budget is tight. The suite's own CLI
#: tests convert through the command line (several train ops included); the full report
#: converts every program through it.
QUICK_CLI: set[str] = set()

#: Quick mode's one run of a variant other than the primary: the API on 2 towers (the uneven
#: batch split 4 + 3), the suite's budget (a third smaller graph than 3 towers; the full
#: report runs every variant on 1, 2 and 3 towers).
QUICK_OTHERS = ("api", 2, 1)

#: Variants quick mode leaves to the full report, for the suite's budget: each repeats another
#: variant of its program that quick mode runs, with one difference the unit tests cover
#: (serial loop iterations, the same graph without dropout or with another optimizer, a scan
#: without the dropout its sibling has).
QUICK_SKIP = {("nmt_attention", "dropout_serial"), ("text_cnn", "no_dropout"), ("pix2pix", "sync_sgd"),
              ("rnn_from_scratch", "scan"), ("gcn", "minibatch_sgd")}

#: Programs whose primary trains with Adam next to a sibling that differs only in plain SGD:
#: quick mode gives the SGD sibling the primary's runs and leaves the Adam one to the full
#: report. SGD shows a weighting error in every parameter; Adam's normalization can hide one
#: scaled alike (and its rounding needs a looser tolerance), so the stronger check is kept.
QUICK_LEAD = {"bilstm_crf": "sgd", "transformer": "sgd", "sequence_tagger": "sgd"}


def _environment() -> None:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if HERE not in sys.path:
        sys.path.insert(0, HERE)


def _tf():
    import tensorflow as tf

    return tf


def session_config():
    """Four logical CPU devices, one thread per op (deterministic reductions); Grappler off
    when ``CORPUS_NO_GRAPPLER`` is set (the test suite's quick runs)."""
    tf = _tf()
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 4}, intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=1)
    if os.environ.get("CORPUS_NO_GRAPPLER"):
        config.graph_options.rewrite_options.disable_meta_optimizer = True
    return config


def first_line(exc: BaseException) -> str:
    """'Type: the message's first meaningful line' (TensorFlow's op errors: the root error and
    the node it names, without the header and stack lines)."""
    import re

    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines()]
    skip = re.compile(r"^(Graph execution error:|Detected at node|Node:|\d+ root error|\[\[|$)")
    kept = [ln for ln in lines if not skip.match(ln)]
    line = re.sub(r"^\(\d+\) ", "", kept[0] if kept else (lines[0] if lines else ""))
    node = re.search(r"\{\{node ([^}]+)\}\}", text)
    if node and node.group(1) not in line:
        line = f"{line} [node {node.group(1)}]"
    return f"{type(exc).__name__}: {line[:400]}"


class Failure(Exception):
    """A stage of a run failed; ``str`` is 'stage: Type: first line'."""


def _stage(name: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Failure:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is a finding to record
        if os.environ.get("CORPUS_DEBUG"):
            traceback.print_exc()
        raise Failure(f"{name}: {first_line(exc)}") from exc


# ------------------------------------------------------------------ building and running
def build_meta(module, batch: int, kwargs: dict, directory: str) -> tuple[str, dict]:
    """The legacy script: build the graph, write model.meta with its saver; return names."""
    tf = _tf()
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(SEED)
        names = module.build(batch, **kwargs)
        saver = names.pop("saver")
        path = os.path.join(directory, "model.meta")
        saver.export_meta_graph(path)
    return path, names


def _variables(graph) -> list:
    tf = _tf()
    seen, out = set(), []
    for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, tf.compat.v1.GraphKeys.LOCAL_VARIABLES):
        for v in graph.get_collection(key):
            if v.op.name not in seen:
                seen.add(v.op.name)
                out.append(v)
    return out


def read_variables(sess, graph) -> dict:
    variables = _variables(graph)
    values = sess.run([v.value() if hasattr(v, "value") else v for v in variables])
    return {v.op.name: value for v, value in zip(variables, values)}


def _init(sess, graph, names: dict) -> None:
    ops = [graph.get_operation_by_name(n) for n in names.get("init", [])]
    sess.run(ops)


class Run:
    """One session on one graph: init, restore or save the initial values, drive."""

    def __init__(self, graph, names: dict, saver_def):
        tf = _tf()
        self.graph, self.names, self.saver_def = graph, names, saver_def
        self.sess = tf.compat.v1.Session(graph=graph, config=session_config())

    def save(self, path: str) -> str:
        d = self.saver_def
        return self.sess.run(self.graph.get_tensor_by_name(d.save_tensor_name),
                             {self.graph.get_tensor_by_name(d.filename_tensor_name): path})

    def restore(self, path: str, initial: dict) -> list[str]:
        """Restore through the saver_def's names; variables the saver does not hold are loaded
        from the baseline's initial values (returned, for the record)."""
        d = self.saver_def
        self.sess.run(self.graph.get_operation_by_name(d.restore_op_name),
                      {self.graph.get_tensor_by_name(d.filename_tensor_name): path})
        import numpy as np

        loaded = []
        current = read_variables(self.sess, self.graph)
        for v in _variables(self.graph):
            name = v.op.name
            if name in initial and name in current and not np.array_equal(initial[name], current[name]):
                v.load(initial[name], self.sess)
                loaded.append(name)
        return loaded

    def close(self):
        self.sess.close()


def drive(module, run: Run, data, workdir: str, kwargs: dict):
    with run.graph.as_default(), run.sess.as_default():
        fetched = module.drive(run.sess, run.graph, run.names, data, workdir, **kwargs)
        variables = read_variables(run.sess, run.graph)
    return fetched, variables


def baseline(module, meta_path: str, names: dict, data, workdir: str, drive_kwargs: dict) -> dict:
    tf = _tf()
    graph = tf.Graph()
    with graph.as_default():
        saver = tf.compat.v1.train.import_meta_graph(meta_path)
    run = Run(graph, names, saver.saver_def)
    try:
        _init(run.sess, graph, names)
        ckpt = run.save(os.path.join(workdir, "ckpt", "model.ckpt"))
        initial = read_variables(run.sess, graph)
        single = os.path.join(workdir, "single")
        os.makedirs(single, exist_ok=True)
        fetched, variables = drive(module, run, data, single, drive_kwargs)
    finally:
        run.close()
    return {"ckpt": ckpt, "initial": initial, "fetched": fetched, "variables": variables}


# ------------------------------------------------------------------ comparing
def relative_difference(a, b) -> float:
    import numpy as np

    a = np.asarray(a)
    b = np.asarray(b)
    if a.dtype.kind in "OSUV" or b.dtype.kind in "OSUV":
        return 0.0 if a.shape == b.shape else float("inf")
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    if not (np.all(np.isfinite(b)) or np.array_equal(np.isfinite(a), np.isfinite(b))):
        return float("inf")
    scale = max(float(np.max(np.abs(a))), 1e-3)
    return float(np.max(np.abs(a - b))) / scale


def compare(base: dict, fetched, variables: dict, racy: dict | None = None) -> dict:
    """Largest differences from the baseline. ``racy`` (the program's ``NONDETERMINISTIC``)
    names variables (substrings) and fetch labels whose single-device values are not
    reproducible; their differences are recorded apart (``racy_diff``), not judged."""
    import numpy as np

    racy = racy or {}
    racy_vars, racy_fetches = racy.get("variables", []), set(racy.get("fetches", []))
    out = {"var_diff": 0.0, "var_worst": "", "fetch_diff": 0.0, "fetch_worst": "",
           "missing": [], "summaries": 0, "racy_diff": 0.0}
    for name, value in base["variables"].items():
        if name not in variables:
            out["missing"].append(name)
            continue
        d = relative_difference(value, variables[name])
        if any(p in name for p in racy_vars):
            out["racy_diff"] = max(out["racy_diff"], d)
            continue
        if d > out["var_diff"] or not out["var_worst"]:
            out["var_diff"], out["var_worst"] = d, name
    if len(fetched) != len(base["fetched"]):
        out["fetch_diff"], out["fetch_worst"] = float("inf"), "number of fetches"
    for i, ((label, a), (_, b)) in enumerate(zip(base["fetched"], fetched)):
        if isinstance(a, (bytes, str)) or np.asarray(a).dtype.kind in "OSU":
            out["summaries"] += 1      # summaries: fetched, not compared (histograms of slices)
            continue
        d = relative_difference(a, b)
        if label in racy_fetches:
            out["racy_diff"] = max(out["racy_diff"], d)
            continue
        if d > out["fetch_diff"] or not out["fetch_worst"]:
            out["fetch_diff"], out["fetch_worst"] = d, f"{label}@{i}"
    out["changed"] = sum(1 for n, v in base["variables"].items()
                         if n in base["initial"] and not np.array_equal(v, base["initial"][n]))
    if out["missing"]:
        out["var_diff"], out["var_worst"] = float("inf"), out["missing"][0] + " (missing)"
    out["max_diff"] = max(out["var_diff"], out["fetch_diff"])
    return out


# ------------------------------------------------------------------ the two paths
def api_run(module, meta_path, names, devices, options, base, data, workdir, drive_kwargs) -> dict:
    import replicate
    from tensorflow.core.protobuf import meta_graph_pb2

    meta = meta_graph_pb2.MetaGraphDef()
    with open(meta_path, "rb") as f:
        meta.ParseFromString(f.read())
    start = time.perf_counter()
    res = _stage("transform", replicate.transform, meta, devices, **options)
    record = {"exact": bool(res.report.exact), "reasons": [str(r) for r in res.report.reasons],
              "warnings": list(res.report.warnings),
              "transform_seconds": round(time.perf_counter() - start, 3)}
    graph = _stage("import", lambda: res.graph)
    run = Run(graph, names, res.meta_graph_def.saver_def)
    try:
        _stage("init", _init, run.sess, graph, names)
        record["loaded"] = _stage("restore", run.restore, base["ckpt"], base["initial"])
        fetched, variables = _stage("driver", drive, module, run, data, workdir, drive_kwargs)
    finally:
        run.close()
    record.update(compare(base, fetched, variables, getattr(module, "NONDETERMINISTIC", None)))
    return record


def cli_run(module, meta_path, names, devices, options, base, data, workdir, drive_kwargs) -> dict:
    tf = _tf()
    out = os.path.join(workdir, "out.meta")
    cmd = [sys.executable, "-m", "replicate", "convert", meta_path, "-o", out,
           "--devices", ",".join(devices), "--no-check"]    # the harness compares under the driver
    for key, value in options.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = round(time.perf_counter() - start, 3)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower()] or lines or ["(no output)"]
        message = errors[-1].replace(out, "out.meta").replace(meta_path, "model.meta")
        raise Failure(f"convert: exit {proc.returncode}: {message[:400]}")
    report = proc.stdout
    exact = "exact         yes" in report
    reasons = [ln.strip()[2:] for ln in report.splitlines() if ln.startswith("    - ")]
    warnings = [ln.split("warning", 1)[1].strip() for ln in report.splitlines()
                if ln.startswith("  warning ")]
    record = {"exact": exact, "reasons": reasons, "warnings": warnings, "transform_seconds": seconds}
    graph = tf.Graph()
    with graph.as_default():
        saver = _stage("import", tf.compat.v1.train.import_meta_graph, out)
    if saver is None:
        raise Failure("import: the converted .meta has no saver_def")
    run = Run(graph, names, saver.saver_def)
    try:
        _stage("init", _init, run.sess, graph, names)
        record["loaded"] = _stage("restore", run.restore, base["ckpt"], base["initial"])
        fetched, variables = _stage("driver", drive, module, run, data, workdir, drive_kwargs)
    finally:
        run.close()
    record.update(compare(base, fetched, variables, getattr(module, "NONDETERMINISTIC", None)))
    return record


def self_run(module, meta_path, names, devices, options, base, data, workdir, drive_kwargs) -> dict:
    """The judge's own check: the single-device graph again, restored from the checkpoint and
    driven the same way, must reproduce the baseline (the driver and data are deterministic)."""
    tf = _tf()
    graph = tf.Graph()
    with graph.as_default():
        saver = tf.compat.v1.train.import_meta_graph(meta_path)
    run = Run(graph, names, saver.saver_def)
    try:
        _stage("init", _init, run.sess, graph, names)
        record = {"exact": None, "reasons": [],
                  "loaded": _stage("restore", run.restore, base["ckpt"], base["initial"])}
        fetched, variables = _stage("driver", drive, module, run, data, workdir, drive_kwargs)
    finally:
        run.close()
    record.update(compare(base, fetched, variables, getattr(module, "NONDETERMINISTIC", None)))
    return record


# ------------------------------------------------------------------ the plan
def plan(module, mode: str, variant: str, primary: bool) -> list[tuple[str, int, int]]:
    """(path, towers, batch) runs of one variant."""
    batches = module.BATCHES
    steps = PLANS[mode]
    program = module.__name__.rsplit(".", 1)[-1]
    if mode == "quick" and program in QUICK_LEAD:
        if primary:
            return []
        primary = variant == QUICK_LEAD[program]
    if not primary and mode == "quick":
        if (program, variant) in QUICK_SKIP:
            return []
        path, towers, index = QUICK_OTHERS
        return [(path, towers, batches[min(index, len(batches) - 1)])]
    out = []
    for path in ("self", "api", "cli"):
        if path == "cli" and mode == "quick" and module.__name__ not in QUICK_CLI:
            continue
        for towers, index in steps.get(path, []):
            if index < len(batches):
                out.append((path, towers, batches[index]))
    return out


def run_program(name: str, mode: str = "quick", variants: list[str] | None = None,
                paths: tuple[str, ...] = ("self", "api", "cli")) -> dict:
    import numpy as np

    module = importlib.import_module(name)
    chosen = [v for v in module.VARIANTS if variants is None or v in variants]
    primary = next(iter(module.VARIANTS))
    records: list[dict] = []
    baselines: dict[str, tuple] = {}        # variants that differ only in transform options share one
    probes: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix=f"corpus-{name}-") as root:
        for variant in chosen:
            spec = module.VARIANTS[variant]
            runs = [r for r in plan(module, mode, variant, primary=(variant == primary)) if r[0] in paths]
            for batch in sorted({b for _, _, b in runs}, key=module.BATCHES.index):
                common = {"program": name, "variant": variant, "family": module.FAMILY,
                          "batch": batch, "options": spec.get("options", {}),
                          "rtol": spec.get("expect", {}).get("rtol")}
                key = json.dumps([batch, spec.get("build", {}), spec.get("data", {}),
                                  spec.get("drive", {})], sort_keys=True)
                if key not in baselines:
                    workdir = os.path.join(root, f"{variant}-{batch}")
                    os.makedirs(workdir)
                    data = module.make_data(np.random.RandomState(SEED), batch, **spec.get("data", {}))
                    try:
                        meta_path, names = build_meta(module, batch, spec.get("build", {}), workdir)
                        base = baseline(module, meta_path, names, data, workdir, spec.get("drive", {}))
                        baselines[key] = (workdir, data, meta_path, names, base, None)
                    except Exception as exc:  # noqa: BLE001 - the program itself is broken
                        traceback.print_exc()
                        baselines[key] = (workdir, data, None, None, None, f"baseline: {first_line(exc)}")
                workdir, data, meta_path, names, base, broken = baselines[key]
                for path, towers, b in runs:
                    if b != batch:
                        continue
                    record = dict(common, path=path, towers=towers, split=_split(batch, towers))
                    if broken:
                        records.append(dict(record, exact=None, reasons=[], error=broken))
                        continue
                    start = time.perf_counter()
                    run_dir = tempfile.mkdtemp(prefix=f"{variant}-{path}{towers}-", dir=workdir)
                    fn = {"api": api_run, "cli": cli_run, "self": self_run}[path]
                    try:
                        record.update(fn(module, meta_path, names, CPUS[:towers], spec.get("options", {}),
                                         base, data, run_dir, spec.get("drive", {})))
                        record["error"] = None
                    except Failure as exc:
                        record.setdefault("exact", None)
                        record.setdefault("reasons", [])
                        record["error"] = str(exc)
                        if "several candidate train ops" in str(exc) and path == "api":
                            if variant not in probes:
                                probes[variant] = _probe_train_ops(module, meta_path, CPUS[:towers], spec,
                                                                   names, base, data, run_dir)
                            record["note"] = probes[variant]
                    record["seconds"] = round(time.perf_counter() - start, 3)
                    records.append(record)
                    _progress(record)
    return {"program": name, "family": module.FAMILY, "description": module.DESCRIPTION,
            "driver": module.DRIVER,
            "variants": {v: module.VARIANTS[v].get("expect", {}) for v in chosen},
            "records": records}


def _probe_train_ops(module, meta_path, devices, spec, names, base, data, workdir) -> str:
    """When transform refuses several train ops: what naming each one with ``train_op=`` does,
    and how the unchanged driver (which runs all of them) fares on that result."""
    import replicate

    notes = []
    for op in getattr(module, "TRAIN_OPS", []):
        try:
            res = replicate.transform(meta_path, devices, train_op=op, **spec.get("options", {}))
        except Exception as exc:  # noqa: BLE001
            notes.append(f"train_op='{op}': {first_line(exc)}")
            continue
        note = f"train_op='{op}': transforms (exact={res.report.exact}); driver: "
        run = Run(res.graph, names, res.meta_graph_def.saver_def)
        try:
            _init(run.sess, res.graph, names)
            run.restore(base["ckpt"], base["initial"])
            fetched, variables = drive(module, run, data, workdir, spec.get("drive", {}))
            diff = compare(base, fetched, variables, getattr(module, "NONDETERMINISTIC", None))
            note += f"runs, max diff {diff['max_diff']:.3g}"
        except Exception as exc:  # noqa: BLE001
            note += first_line(exc)
        finally:
            run.close()
        notes.append(note)
    return f"probed on {len(devices)} towers: " + "; ".join(notes)


def _split(batch: int, towers: int) -> str:
    if towers == 1:
        return "-"
    return "even" if batch % towers == 0 else "uneven"


def _progress(record: dict) -> None:
    status = record["error"] or (f"exact={record['exact']} max_diff={record.get('max_diff', float('nan')):.3g}")
    print(f"[corpus] {record['program']}/{record['variant']} {record['path']} towers={record['towers']} "
          f"batch={record['batch']}: {status} ({record.get('seconds', 0):.1f}s)", file=sys.stderr,
          flush=True)


def _json_safe(obj):
    import math

    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("program", nargs="+", help="one program (its record is written) or "
                        "several (a list of records, one TensorFlow import for them all)")
    parser.add_argument("--mode", choices=sorted(PLANS), default="quick")
    parser.add_argument("--variant", action="append", help="only these variants")
    parser.add_argument("--path", action="append", choices=("self", "api", "cli"),
                        help="only these paths (self: the judge's determinism check)")
    parser.add_argument("--json", help="write the records here (default: stdout)")
    args = parser.parse_args(argv)
    _environment()
    tf = _tf()
    tf.compat.v1.disable_v2_behavior()
    tf.get_logger().setLevel("ERROR")
    results = []
    for program in args.program:
        start = time.perf_counter()
        result = run_program(program, args.mode, args.variant, tuple(args.path or ("self", "api", "cli")))
        result["seconds"] = round(time.perf_counter() - start, 2)
        result["mode"] = args.mode
        results.append(result)
    text = json.dumps(_json_safe(results[0] if len(results) == 1 else results), indent=1, default=str)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
