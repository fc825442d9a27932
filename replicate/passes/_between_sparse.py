"""Helpers of the between pass: sparse gradient rows gathered over the workers, and sparsely
trained variables placed on the ps tasks."""

from __future__ import annotations

from tensorflow.python.framework import dtypes

from replicate.graph import ops
from replicate.graph.ir import IR, node_of, parse_tensor
from replicate.graph.kernels import runnable_on

__all__ = ["gather_rows", "place_sparse", "WRITES"]

WRITES = frozenset(ops.MUTATING_OPS) | frozenset(ops.APPLY_OPS)


def gather_rows(owner, ir: IR, ref: str, scope: str) -> str:
    """``ref``'s rows from every worker, in task order (``owner``: the Between pass, whose
    ``collective`` makes ops among the workers' controllers).

    Row counts differ between workers, and ``CollectiveGatherV2`` needs one shape: each worker
    pads to the largest count (an all-reduce of the counts), gathers the counts and the padded
    rows, and keeps row ``j`` of worker ``w`` only when ``j`` is below ``w``'s count.
    """
    dev = owner.controller
    i32, i64 = dtypes.int32, dtypes.int64
    dtype = dtypes.as_dtype(ir.output_dtype(ref))

    def add(name, op, inputs, **attrs):
        return ir.add(f"{scope}/{name}", op, inputs, device=dev, attrs=attrs).name

    def const(name, value, dt):
        return ir.const(f"{scope}/{name}", value, dt, dev)

    src = ref if parse_tensor(ref)[1] else node_of(ref)
    shp = add("shape", "Shape", [src], T=dtype, out_type=i64)
    zero = const("zero", 0, i32)
    rows = add("rows", "GatherV2", [shp, zero, zero], Tparams=i64, Tindices=i32, Taxis=i32)
    rows_vec = add("rows_vec", "Reshape", [rows, const("one_vec", [1], i32)], T=i64, Tshape=i32)
    most = owner.collective(ir, f"{scope}/max_rows", "CollectiveReduceV2", rows_vec, i64, dev,
                            merge="Max")
    sizes = owner.collective(ir, f"{scope}/sizes", "CollectiveGatherV2", rows_vec, i64, dev)
    pad = add("pad", "Sub", [most, rows_vec], T=i64)
    first = add("first_pad", "Pack", [const("zero64", [0], i64), pad], T=i64, N=2, axis=1)
    rank = add("rank", "Rank", [src], T=dtype)
    inner = add("inner_dims", "Sub", [rank, const("one", 1, i32)], T=i32)
    dims = add("rest_dims", "Pack", [inner, const("two", 2, i32)], T=i32, N=2, axis=0)
    rest = add("rest_pad", "Fill", [dims, const("zero_pad", 0, i64)], T=i64, index_type=i32)
    paddings = add("paddings", "ConcatV2", [first, rest, zero], T=i64, N=2, Tidx=i32)
    padded = add("padded", "Pad", [src, paddings], T=dtype, Tpaddings=i64)
    every = owner.collective(ir, f"{scope}/all", "CollectiveGatherV2", padded, dtype, dev)
    most_s = add("most", "Reshape", [most, const("scalar", [], i32)], T=i64, Tshape=i32)
    total = add("total", "Mul", [most_s, const("workers", owner.workers, i64)], T=i64)
    pos = add("pos", "Range", [const("zero_l", 0, i64), total, const("one_l", 1, i64)], Tidx=i64)
    worker = add("worker", "FloorDiv", [pos, most_s], T=i64)
    within = add("within", "FloorMod", [pos, most_s], T=i64)
    limit = add("limit", "GatherV2", [sizes, worker, zero], Tparams=i64, Tindices=i64, Taxis=i32)
    keep = add("keep", "Less", [within, limit], T=i64)
    where = add("where", "Where", [keep], T=dtypes.bool)
    flat = add("rows_kept", "Reshape", [where, const("flat", [-1], i32)], T=i64, Tshape=i32)
    return add("gathered", "GatherV2", [every, flat, zero], Tparams=dtype, Tindices=i64, Taxis=i32)


def place_sparse(owner, ir: IR, analysis) -> list[str]:
    """Variables trained only through sparse writes (scatter, sparse apply), with their slots,
    go to the ps tasks, spread by size. A variable any of whose group is written densely in
    the update section (TF1 Adam decays its slots densely) stays on every worker, updated
    from the all-gathered gradient; ``ir.facts["between_local_sparse"]`` names them."""
    graph = ir.to_networkx(control=True)
    section = ir.ancestors(analysis.train_ops or [analysis.train_op], graph)
    prefixes = set(ir.facts["towers"].prefixes)
    writers: dict[str, set[str]] = {}
    for name in section:
        node = ir.nodes[name]
        if node.op in WRITES and name.split("/", 1)[0] not in prefixes:
            for ref in node.inputs:
                if ir.nodes.get(node_of(ref)) is not None and ir.nodes[node_of(ref)].op in ops.VARIABLE_OPS:
                    writers.setdefault(node_of(ref), set()).add(node.op)
    primaries = set()
    for f in analysis.frontier:
        if f.gradient and f.variable and f.role.startswith("sparse") and f.variable in ir.nodes:
            locs = [c for c in ir.nodes[f.variable].colocation() if c in ir.nodes]
            primaries.add(locs[0] if locs else f.variable)
    dense = {f.variable for f in analysis.frontier if f.gradient and f.role == "dense"}
    placed: list[str] = []
    local: list[str] = []
    load = {d: 0 for d in owner.ps_devices}
    for var in sorted(primaries):
        group = {var} | {n.name for n in ir if n.op in ops.VARIABLE_OPS and var in n.colocation()}
        if group & dense or not all(_sparse_write(op) for g in group for op in writers.get(g, ())):
            local.append(var)
            continue
        size = sum(analysis.variables[g].bytes for g in group if g in analysis.variables)
        device = min(owner.ps_devices, key=lambda d: (load[d], owner.ps_devices.index(d)))
        load[device] += size
        for node in list(ir):
            if node.name in group or any(c in group for c in node.colocation()):
                ir.set_device(node.name, runnable_on(node.op, node.attrs, device))
        placed.extend(sorted(group))
    ir.facts["between_local_sparse"] = local
    return placed


def _sparse_write(op: str) -> bool:
    """True for ops that write only the rows they are given."""
    return "Scatter" in op or op.startswith(("SparseApply", "ResourceSparseApply"))
