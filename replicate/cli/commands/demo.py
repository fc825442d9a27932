"""Train the seeds' MNIST CNN on one device and on N towers side by side.

Builds the CNN of the multi-GPU tutorial (conv 32, conv 64, dense 1024, Adam) as an ordinary
single-device TF1 graph, rewrites it with replicate.transform into N towers (GPUs when there
are any, else logical CPU devices), trains both from the same initial values on the same
batches, and prints how closely they agree and the throughput of each.

Data: MNIST IDX files in --data-dir, else Keras' cached mnist.npz, else scikit-learn's 8x8
digits upscaled to 28x28, else deterministic synthetic digits. The first line says which.
A third, untimed session trains the single-device graph on the same batches with their
examples permuted: the same computation in another float summation order. Exactness is
checked where rounding has not compounded yet: after steps 1 and 10 every parameter must be
within --rtol of one device's. Over hundreds of Adam steps any two trainings drift apart by
rounding; the drift after the last step is printed beside that reference's, without a
verdict. Exit code 0 when exact where checked, 1 when not.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

__all__ = ["HELP", "add_arguments", "run"]

log = logging.getLogger(__name__)

HELP = "train the MNIST CNN on 1 and N devices side by side; print exactness, drift and throughput"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--towers", type=int, default=4, metavar="N",
                       help="number of towers: /gpu:0..N-1 if there are GPUs, else logical "
                            "CPUs /cpu:0..N-1 (default 4)")
    where.add_argument("--devices", metavar="N|DEV[,DEV...]",
                       help="a tower count like --towers, or explicit devices, e.g. /cpu:0,/cpu:1")
    parser.add_argument("--controller", default="/cpu:0", metavar="DEV",
                        help="device holding the variables and the optimizer (default /cpu:0)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--batch", type=int, default=128,
                        help="global batch, split over the towers (default 128)")
    parser.add_argument("--data-dir", metavar="DIR",
                        help="directory with MNIST IDX files (train-images-idx3-ubyte[.gz], ...)")
    parser.add_argument("--data", choices=("auto", "mnist", "digits", "synthetic"), default="auto",
                        help="force a data source (default: the best available)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--full-size", dest="size", action="store_const", const="full",
                      help="the seeds' sizes: 32/64 filters, 1024 dense (the default)")
    size.add_argument("--small", dest="size", action="store_const", const="small",
                      help="16/32 filters, 256 dense: about a quarter of the work")
    parser.set_defaults(size="full")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="initial values and batch order")
    parser.add_argument("--warmup", type=int, default=5,
                        help="leading steps left out of the throughput (default 5)")
    parser.add_argument("--rtol", type=float, default=1e-4,
                        help="largest relative parameter difference after steps 1 and 10 "
                             "(default 1e-4)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the untimed permuted-batch reference training whose "
                             "float-rounding drift is shown beside the towers'")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _devices(args: argparse.Namespace) -> tuple[list[str], int, str]:
    """Tower devices, logical CPUs the session needs, and a description."""
    from replicate.cli.commands._common import device_list

    if args.devices and args.devices.strip().isdigit():
        args.towers, args.devices = int(args.devices), None
    if args.devices:
        devices = device_list(args.devices)
        what = ", ".join(devices)
    else:
        if args.towers < 1:
            raise _bad(f"--towers {args.towers}: give at least 1")
        import tensorflow as tf

        gpus = len(tf.config.list_physical_devices("GPU"))
        kind = "gpu" if gpus >= args.towers else "cpu"
        devices = [f"/{kind}:{k}" for k in range(args.towers)]
        what = (f"{args.towers} GPUs" if kind == "gpu"
                else f"{args.towers} logical CPU devices on {os.cpu_count()} cores")
    cpus = 1
    for dev in devices + [args.controller]:
        low = dev.lower()
        if "cpu:" in low:
            tail = low.rsplit("cpu:", 1)[1]
            if tail.isdigit():
                cpus = max(cpus, int(tail) + 1)
    return devices, cpus, what


def _bad(message: str):
    from replicate.errors import InputError

    return InputError(message)


def _progress(steps: int, enabled: bool):
    """A tqdm bar, or None without tqdm or when disabled."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        log.warning("tqdm is not installed: no progress bar (pip install tqdm)")
        return None
    return tqdm(total=steps, unit="step", desc="training", file=sys.stderr, dynamic_ncols=True)


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when the trainings agree within ``--rtol``, else 1."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for name, value in (("--steps", args.steps), ("--batch", args.batch)):
        if value < 1:
            raise _bad(f"{name} {value}: must be at least 1")
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    tf.compat.v1.disable_eager_execution()
    import replicate
    from replicate.demo import FULL_SIZE, SMALL_SIZE, batches, build_cnn, load
    from replicate.demo.report import print_header, print_results, print_transform
    from replicate.demo.runner import train_side_by_side

    try:
        data = load(args.data_dir, args.data)
    except (FileNotFoundError, ImportError, ValueError) as exc:
        raise _bad(str(exc)) from None
    devices, cpus, what = _devices(args)
    model = build_cnn(FULL_SIZE if args.size == "full" else SMALL_SIZE, args.lr, args.seed)
    print_header(model, data, args)
    res = replicate.transform(model.graph, devices, controller=args.controller)
    print_transform(res, what)

    bar = _progress(args.steps, not args.no_progress)
    feeds = (({model.images: x, model.labels: y}, len(y))
             for x, y in batches(data, args.batch, args.steps, args.seed))

    def on_step(i: int, result) -> None:
        if bar is None:
            return
        bar.update(1)
        if i % 10 == 0 or i == args.steps - 1:
            single, multi = result.throughput()
            loss = result.losses[-1]
            bar.set_postfix_str(f"loss {loss[0]:.4f}/{loss[1]:.4f}  "
                                f"1 dev {single:,.0f} ex/s  {len(devices)} towers {multi:,.0f} ex/s")

    try:
        result = train_side_by_side(model.graph, res.meta_graph_def, model.train_op, feeds, cpus,
                                    (model.loss, model.accuracy), min(args.warmup, args.steps - 1),
                                    not args.no_reference, args.steps, on_step)
    finally:
        if bar is not None:
            bar.close()
    return print_results(result, len(devices), args.rtol)
