"""Draw the benchmark results: step-time ratios and compile-time scaling, as PNG files.

    python benchmarks/plot.py          # reads benchmarks/results/*.json, writes *.png there

``step_time.png``: per model and device count, each variant's median step time relative to the
single-device graph (1.0 = the same; the dashed line is the 1.05 target).
``compile_time.png``: transform time and TensorFlow's import time of the output against
input nodes x towers (log-log, with a slope-1 guide: linear scaling), and peak memory.
``accumulate.png``: per model, the activation peak and the step time of each accumulation
variant relative to one device on the whole batch, against k (the dotted line is 1/k, the
dashed one the 1.10 step-time target).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

__all__ = ["plot_step_time", "plot_compile_time", "plot_accumulate", "main"]

log = logging.getLogger(__name__)


def plot_step_time(data: dict, path: str) -> None:
    """Bars of step time / single-device step time, one group per (model, devices)."""
    groups = [(r["model"], r["devices"], r["timed"]) for r in data["results"]]
    labels = ["single device", "hand-written towers", "MirroredStrategy"]
    for _, _, timed in groups:
        labels += [k for k in timed if k not in labels]
    fig, ax = plt.subplots(figsize=(max(7, 2.2 * len(groups)), 4.2))
    width = 0.8 / max(1, len(labels))
    labels = [k for k in labels if any(k in timed for _, _, timed in groups)]
    for j, label in enumerate(labels):
        xs, ys = [], []
        for i, (_, _, timed) in enumerate(groups):
            if label in timed:
                xs.append(i + (j - (len(labels) - 1) / 2) * width)
                ys.append(timed[label]["median"] / timed["single device"]["median"])
        ax.bar(xs, ys, width, label=label)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.05, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\n{n} devices" for m, n, _ in groups])
    ax.set_ylabel("median step time / single device")
    batch = data["results"][0]["batch"] if data["results"] else "?"
    ax.set_title(f"Step time at the same global batch ({batch}), logical CPU devices\n"
                 f"{data['machine']['cpu']}, {data['machine']['cores']} cores")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_compile_time(data: dict, path: str) -> None:
    """Transform and import time against nodes x towers; peak memory beside it."""
    rows = data["results"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    graphs = sorted({r["graph"] for r in rows}, key=lambda g: min(r["input_nodes"] for r in rows
                                                                 if r["graph"] == g))
    cmap = plt.get_cmap("viridis")
    for i, g in enumerate(graphs):
        mine = sorted((r for r in rows if r["graph"] == g), key=lambda r: r["towers"])
        work = [r["input_nodes"] * r["towers"] for r in mine]
        color = cmap(i / max(1, len(graphs) - 1))
        left.plot(work, [r["transform_s"] for r in mine], "o-", color=color,
                  label=f"{g} ({mine[0]['input_nodes']:,} nodes)")
        left.plot(work, [r["import_output_s"] for r in mine], "x:", color=color)
        right.plot(work, [r["peak_bytes"] / 2 ** 20 for r in mine], "o-", color=color, label=g)
    if rows:
        lo = min(r["input_nodes"] * r["towers"] for r in rows)
        hi = max(r["input_nodes"] * r["towers"] for r in rows)
        base = min(r["transform_s"] for r in rows if r["input_nodes"] * r["towers"] == lo)
        left.plot([lo, hi], [base, base * hi / lo], color="gray", lw=0.8, ls="--",
                  label="linear (slope 1)")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("input nodes x towers")
    left.set_ylabel("seconds (o- transform, x: TF import of the output)")
    left.set_title("replicate.transform vs tf.import_graph_def of its output")
    right.set_ylabel("peak memory added by transform (MiB)")
    right.set_title("peak resident memory")
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accumulate(data: dict, path: str) -> None:
    """Activation peak / single and step time / single against k, one column per model."""
    rows = [r for r in data["results"] if "error" not in r]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model]
        single = next(r for r in mine if r["variant"] == "single")
        ks = sorted({r["k"] for r in mine if r["variant"] != "single"})
        for row, (key, label) in enumerate((("activation_peak", "activation peak / single"),
                                             ("step_ms", "step time / single"))):
            ax = axes[row][col]
            for variant in ("replicate", "hand_unrolled", "hand_loop"):
                pts = sorted((r["k"], r[key] / single[key]) for r in mine if r["variant"] == variant)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=variant.replace("_", " "))
            if key == "activation_peak":
                ax.plot(ks, [1 / k for k in ks], ":", color="grey", label="1/k")
                ax.set_yscale("log", base=2)
            else:
                ax.axhline(1.10, ls="--", color="grey", label="1.10 target")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ks, [str(k) for k in ks])
            ax.set_xlabel("k (micro-batches)")
            ax.set_ylabel(label)
            ax.set_title(f"{model}, global batch {single['batch']}")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Plot whichever results exist."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    for name, fn in (("step_time", plot_step_time), ("compile_time", plot_compile_time),
                     ("accumulate", plot_accumulate)):
        src = os.path.join(args.results, f"{name}.json")
        if not os.path.exists(src):
            print(f"no {src}; run benchmarks/{name}.py first")
            continue
        with open(src) as f:
            data = json.load(f)
        out = os.path.join(args.results, f"{name}.png")
        fn(data, out)
        print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
