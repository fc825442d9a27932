"""Turn one worker's in-graph rewrite into its part of a between-graph replicated job.

Requires: the finished in-graph rewrite of *one worker's* towers (analyze, split, clone,
aggregate with an all-reduce strategy, rewire), with tower and controller devices naming job
``worker`` but no task, and ``ir.facts["analysis"]``, ``["towers"]``, ``["aggregates"]``.

Produces, for a cluster of ``W`` workers with ``T`` towers each:

- every gradient all-reduce spans the ``W * T`` towers of all workers (group key and instance
  keys derived from the graph, so two different transforms in one process never collide);
- every weight total (the local batch size, or a sum of per-tower numerators) becomes the
  all-reduced total over the workers, so each tower's gradient is weighed by its share of the
  *global* batch and uneven local batches stay exact; forward outputs fetched under their
  original names (the loss) keep local weights: they are the worker's local-batch values, and
  fetching them needs no collective;
- sparse gradients (``IndexedSlices`` aggregates) are all-gathered over the workers (padded to
  the largest worker's row count, then unpadded), so each worker sees the global sparse gradient;
- with ``ps`` devices and ``sparse_on_ps``: variables trained only through sparse gradients (and
  their slots) move to the ps tasks, spread by size; the ops that write them in the update
  section (and their data descendants) are marked chief-only (``_replicate_role``), and a
  barrier all-reduce that waits for them ends every train op, so no worker reads a ps variable
  before the chief's update of the previous step is done;
- ``replicate/between/broadcast``: every per-worker variable takes the chief's value (an
  all-reduce where the other workers contribute zeros), registered as the graph's
  ``local_init_op`` (with the local-variable and table initializers) so that
  ``MonitoredTrainingSession`` on every worker starts from the chief's initial or restored values.

The result is a *template*: :func:`replicate.runtime.between.for_task` pins it to one task (adds the
task to worker devices, keeps chief-only ops on task 0 only, makes other tasks contribute zeros
to the broadcast). ``ir.facts["between"]`` describes what was done.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
from tensorflow.python.framework import dtypes

from replicate.batchflow.facts import Reason
from replicate.errors import AnalysisError
from replicate.graph import ops
from replicate.graph.ir import IR, node_of
from replicate.passes._between_sparse import WRITES as _WRITES
from replicate.passes._between_sparse import gather_rows, place_sparse
from replicate.passes._combine import WEIGHTS
from replicate.passes.pipeline import PassResult

__all__ = ["Between", "ROLE_ATTR", "CHIEF_ONLY", "BROADCAST_VALUE", "SCOPE", "BROADCAST_OP",
           "BARRIER", "LOCAL_INIT", "READY_FOR_LOCAL_INIT"]

log = logging.getLogger(__name__)

SCOPE = "replicate/between"
#: Node attribute marking what :func:`replicate.runtime.between.for_task` changes per task.
ROLE_ATTR = "_replicate_role"
CHIEF_ONLY = "chief_only"
BROADCAST_VALUE = "broadcast_value"
BROADCAST_OP = f"{SCOPE}/broadcast"
BARRIER = f"{SCOPE}/barrier"
LOCAL_INIT = f"{SCOPE}/local_init"
READY_FOR_LOCAL_INIT = f"{SCOPE}/ready_for_local_init"

_COLLECTIVES = frozenset({"CollectiveReduceV2", "CollectiveGatherV2"})


class Between:
    """Between-graph replication of one worker's rewrite.

    Args:
        workers: number of worker tasks ``W``.
        controller: the worker's controller device (task-less, e.g. ``/job:worker/device:CPU:0``).
        ps_devices: devices of the ps tasks (empty when the cluster has none).
        sparse_on_ps: keep sparsely trained variables on the ps tasks.
        seed: bytes the collective keys are derived from (the input graph and the options).
    """

    name = "between"

    def __init__(self, workers: int, controller: str, ps_devices: list[str],
                 sparse_on_ps: bool, seed: bytes):
        self.workers = workers
        self.controller = controller
        self.ps_devices = list(ps_devices)
        self.sparse_on_ps = sparse_on_ps and bool(ps_devices)
        digest = int.from_bytes(hashlib.sha256(seed).digest()[:8], "little")
        # Group keys 2..2^30 (the in-graph rewrite uses 1); instance keys in a block of 2^16.
        self.group_key = 2 + (digest % ((1 << 30) - 4)) & ~1
        self.instance_base = ((digest >> 32) % ((1 << 15) - 1) + 1) << 16
        self._next_instance = self.instance_base + (1 << 15)

    # ------------------------------------------------------------------ driver
    def run(self, ir: IR) -> PassResult:
        analysis = ir.facts["analysis"]
        towers = ir.facts["towers"]
        local = len(towers.devices)
        size = self.workers * local
        tails = [f.tensor for f in analysis.frontier if f.tail]
        if tails:
            raise AnalysisError(f"between-graph training of '{tails[0]}' (a sampled loss's gradient: "
                                "rows that are part batch, part shared) is not supported: the "
                                "workers would gather each other's shares of the shared rows "
                                "instead of summing them; train it in-graph")
        local_syncs = [n for n in ir.facts.get("synced", []) if n in analysis.flow.loss_syncs()]
        if local_syncs:
            analysis.reasons.append(Reason(local_syncs[0], "the loss is a nonlinear function of this "
                                           "batch reduction, which each worker synchronizes over its "
                                           "own towers only: workers see their local batch's value",
                                           "train in-graph (one worker, several towers), or make the "
                                           "loss a sum of batch means or sums"))
        drawn = [d.name for d in analysis.draws.values() if d.kind in ("rows", "body", "param_rows")]
        if drawn:       # the draw pass reproduced the worker's own batch, not the global one
            analysis.reasons.append(Reason(drawn[0], "each worker draws its own local batch's random "
                                           "numbers with the op's seeds, so the workers' rows do not "
                                           "get one device's draw over the global batch (their first "
                                           "rows get the same numbers)", "train in-graph (one worker, "
                                           "several towers) for exact dropout; between workers the "
                                           "draws are those of a smaller batch, correlated across "
                                           "workers"))
        if local == 1:
            self._single_tower_allreduce(ir, analysis, ir.facts["aggregates"], towers.devices[0])
        else:
            self._regroup(ir, size)
        globals_ = self._global_totals(ir) + self._global_denominators(ir, analysis)
        for node in [n for n in ir if n.name.startswith(WEIGHTS + "/") and n.name.endswith("/uniform")]:
            ir.set_const(node.name, 1.0 / size)    # a batch-independent term: 1/N of every tower
        gathered = self._gather_sparse(ir, analysis, ir.facts["aggregates"])
        on_ps: list[str] = []
        chief_only: set[str] = set()
        if self.sparse_on_ps:
            on_ps = place_sparse(self, ir, analysis)
            chief_only = self._chief_only(ir, analysis, on_ps)
        self._barrier(ir, analysis, chief_only)
        per_worker = self._broadcast(ir, set(on_ps))
        self._init_ops(ir)
        ir.facts["between"] = {
            "workers": self.workers, "towers_per_worker": local, "group_size": size,
            "group_key": self.group_key, "global_totals": globals_, "gathered": gathered,
            "on_ps": on_ps, "chief_only": sorted(chief_only), "per_worker": per_worker,
            "broadcast": BROADCAST_OP}
        log.info("between-graph: %d workers x %d towers; %d totals global, %d sparse gathers, "
                 "%d variables on ps, %d chief-only ops, %d variables broadcast", self.workers,
                 local, len(globals_), len(gathered), len(on_ps), len(chief_only), len(per_worker))
        return PassResult(ir, True)

    # ------------------------------------------------------------------ collectives
    def _instance(self) -> int:
        self._next_instance += 1
        return self._next_instance

    def _keys(self, ir: IR, scope: str, device: str, group_size: int, group_key: int) -> list[str]:
        return [ir.const(f"{scope}/{what}", value, dtypes.int32, device)
                for what, value in (("group_size", group_size), ("group_key", group_key),
                                    ("instance_key", self._instance()))]

    def collective(self, ir: IR, name: str, op: str, ref: str, tf_dtype, device: str,
                    merge: str = "Add", group_key: int | None = None,
                    control: list[str] = ()) -> str:
        """A collective among the workers' controllers (one member per worker)."""
        keys = self._keys(ir, f"{name}_keys", device, self.workers,
                          self.group_key + 1 if group_key is None else group_key)
        attrs = {"T": tf_dtype, "Nordering_token": 0}
        if op == "CollectiveReduceV2":
            attrs.update({"merge_op": merge, "final_op": "Id"})
        return ir.add(name, op, [ref] + keys, control=control, device=device, attrs=attrs).name

    def _single_tower_allreduce(self, ir: IR, analysis, aggregates: dict[str, str],
                                device: str) -> None:
        """With one tower per worker the aggregate pass made no collective: add one per dense
        (summed) aggregate, among the workers' towers."""
        for n, f in enumerate(analysis.frontier, start=1):
            if f.role.startswith("sparse") or f.tensor not in aggregates or not f.gradient:
                continue
            node = ir.nodes[node_of(aggregates[f.tensor])]
            if node.op != "Identity" or ir.nodes[node_of(node.inputs[0])].op == "CollectiveReduceV2":
                continue
            scope = f"{node.name}_parts/between"
            consts = [ir.const(f"{scope}/{what}", value, dtypes.int32, device)
                      for what, value in (("group_size", self.workers), ("group_key", self.group_key),
                                          ("instance_key", self.instance_base + n))]
            tf_dtype = dtypes.as_dtype(node.attrs["T"].type)
            reduced = ir.add(f"{scope}/allreduce", "CollectiveReduceV2", [node.inputs[0]] + consts,
                             device=device, attrs={"T": tf_dtype, "merge_op": "Add",
                                                   "final_op": "Id", "Nordering_token": 0}).name
            ir.set_input(node.name, 0, reduced)

    def _regroup(self, ir: IR, size: int) -> None:
        """The towers' all-reduces span every worker's towers, under this transform's keys."""
        for node in list(ir):
            if node.op != "CollectiveReduceV2" or node.name.startswith(SCOPE + "/"):
                continue
            old_instance = int(ir.const_value(node_of(node.inputs[3])))
            scope = f"{node.name}_between"
            consts = [ir.const(f"{scope}/{what}", value, dtypes.int32, node.device)
                      for what, value in (("group_size", size), ("group_key", self.group_key),
                                          ("instance_key", self.instance_base + old_instance))]
            old = [node_of(r) for r in node.inputs[1:4]]
            for i, ref in enumerate(consts, start=1):
                ir.set_input(node.name, i, ref)
            for name in old:
                if not ir.consumers(name):
                    ir.remove(name)

    # ------------------------------------------------------------------ weights
    def _global_totals(self, ir: IR) -> list[str]:
        """Weights read by gradient code use totals all-reduced over the workers; merged forward
        outputs keep the local weights."""
        done = []
        for total in [n.name for n in ir if n.name.startswith(WEIGHTS + "/") and n.name.endswith("/total")]:
            tf_dtype = dtypes.as_dtype(ir.nodes[total].attrs["T"].type if "T" in ir.nodes[total].attrs
                                       else ir.nodes[total].attrs["DstT"].type)
            device = ir.nodes[total].device
            reduced = self.collective(ir, f"{total}_global/allreduce", "CollectiveReduceV2", total,
                                       tf_dtype, device)
            scope = total[: -len("/total")]
            for weight in [c for c in ir.consumers(total)
                           if c.op == "DivNoNan" and c.name.startswith(f"{scope}/weight_")]:
                global_weight = ir.add(f"{weight.name}_global", "DivNoNan",
                                       [weight.inputs[0], reduced], device=weight.device,
                                       attrs={"T": tf_dtype}).name
                readers = [c.name for c in ir.consumers(weight.name) if _gradient_side(c.name)]
                ir.replace_uses(weight.name, global_weight, only=readers)
            done.append(total)
        return done

    def _global_denominators(self, ir: IR, analysis) -> list[str]:
        """A loss denominator the gradient code reads as the batch's (passes/_denominator.py)
        is combined over the workers too: its batch sums are all-reduced; a batch mean in it
        stays each worker's, a reason."""
        done = []
        for tensor, merge in ir.facts.get("global_denominators", []):
            name = node_of(tensor)
            if merge not in ("sum", "count", "size"):
                analysis.reasons.append(Reason(name, "the loss's denominator reads a batch mean, "
                                               "which each worker takes over its own examples",
                                               "divide by a batch sum (a count), or train in-graph"))
                continue
            readers = [c.name for c in ir.consumers(name)]
            tf_dtype = dtypes.as_dtype(ir.output_dtype(tensor))
            reduced = self.collective(ir, f"{name}_global/allreduce", "CollectiveReduceV2", tensor,
                                      tf_dtype, ir.nodes[name].device)
            ir.replace_uses(tensor, reduced, only=readers)
            done.append(name)
        return done

    # ------------------------------------------------------------------ sparse gradients
    def _gather_sparse(self, ir: IR, analysis, aggregates: dict[str, str]) -> list[str]:
        """Each sparse aggregate (values or indices) becomes the rows of every worker, in task
        order: row counts differ, so each worker pads to the largest count, all-gathers, and
        drops the padding."""
        out = []
        for f in analysis.frontier:
            if not f.role.startswith("sparse") or f.tensor not in aggregates:
                continue
            agg = aggregates[f.tensor]
            readers = [c.name for c, _ in ir.data_consumers(agg)]
            gathered = gather_rows(self, ir, agg, f"{SCOPE}/gather/{node_of(agg).replace('/', '_')}")
            ir.replace_uses(agg, gathered, only=readers)
            out.append(agg)
        return out

    # ------------------------------------------------------------------ parameter servers
    def _chief_only(self, ir: IR, analysis, on_ps: list[str]) -> set[str]:
        """Update-section ops writing a ps variable, and their data descendants: run by the chief
        only (the others would apply the same update a second time)."""
        ps = set(on_ps)
        prefixes = set(ir.facts["towers"].prefixes)
        graph = ir.to_networkx(control=True)
        section = ir.ancestors(analysis.train_ops or [analysis.train_op], graph)
        writers = [n for n in section if ir.nodes[n].op in _WRITES and ir.nodes[n].name.split("/", 1)[0]
                   not in prefixes and any(node_of(r) in ps for r in ir.nodes[n].inputs)]
        chosen: set[str] = set()
        work = list(writers)
        while work:
            name = work.pop()
            if name in chosen:
                continue
            chosen.add(name)
            for consumer, _ in ir.data_consumers(name):
                if consumer.name in section:
                    work.append(consumer.name)
            for i in range(1, 8):
                for consumer, _ in ir.data_consumers(f"{name}:{i}"):
                    if consumer.name in section:
                        work.append(consumer.name)
        for name in chosen:
            node = ir.nodes[name]
            if node.op in _COLLECTIVES or name in (analysis.train_ops or [analysis.train_op]):
                raise AnalysisError(f"between-graph: '{name}' depends on the update of a variable on "
                                    "the ps tasks, so only the chief may run it, but every worker "
                                    "must; use --no-sparse-on-ps for this graph")
            if node.op in _WRITES and not any(node_of(r) in ps for r in node.inputs):
                raise AnalysisError(f"between-graph: '{name}' writes a per-worker variable from the "
                                    "update of a ps variable; use --no-sparse-on-ps for this graph")
            ir.set_attr(name, ROLE_ATTR, CHIEF_ONLY, kind="string")
        return chosen

    def _barrier(self, ir: IR, analysis, chief_only: set[str]) -> None:
        """Every train op ends with an all-reduce that, on the chief, waits for the ps updates."""
        if not chief_only:
            return
        value = ir.const(f"{BARRIER}/value", 0.0, dtypes.float32, self.controller)
        waits = sorted(n for n in chief_only if ir.nodes[n].op in _WRITES)
        reduced = self.collective(ir, f"{BARRIER}/allreduce", "CollectiveReduceV2", value,
                                   dtypes.float32, self.controller, control=waits)
        ir.add(BARRIER, "NoOp", control=[reduced], device=self.controller)
        for train in analysis.train_ops or [analysis.train_op]:
            ir.set_control(train, ir.nodes[train].control + [BARRIER])

    # ------------------------------------------------------------------ initial values
    def _broadcast(self, ir: IR, on_ps: set[str]) -> list[str]:
        """``replicate/between/broadcast``: each per-worker variable := the chief's value."""
        group = []
        names = []
        for var in [n for n in ir if n.op in ops.REF_VARIABLE_OPS | ops.RESOURCE_VARIABLE_OPS]:
            if var.name in on_ps or var.name.startswith("replicate/"):
                continue
            dtype = dtypes.as_dtype(var.attrs["dtype"].type).base_dtype
            shape = _var_shape(var)
            if shape is None or dtype not in _REDUCIBLE:
                raise AnalysisError(
                    f"between-graph: variable '{var.name}' ({dtype.name}, shape "
                    f"{shape if shape is not None else 'unknown'}) cannot take the chief's value by "
                    "all-reduce (a known shape and a float or integer type are needed); give it a "
                    "static shape")
            scope = f"{BROADCAST_OP}/{var.name}"
            resource = var.op in ops.RESOURCE_VARIABLE_OPS
            if resource:
                value = ir.add(f"{scope}/value", "ReadVariableOp", [var.name], device=var.device,
                               attrs={"dtype": dtype}).name
            else:
                value = ir.add(f"{scope}/value", "Identity", [var.name], device=var.device,
                               attrs={"T": dtype}).name
            ir.set_attr(value, ROLE_ATTR, BROADCAST_VALUE, kind="string")
            ir.const(f"{scope}/zeros_shape", shape, dtypes.int64, var.device)
            ir.const(f"{scope}/zero", np.zeros((), dtype.as_numpy_dtype), dtype, var.device)
            send = value
            if dtype in (dtypes.int32,):          # int32 collectives live in host memory: go int64
                send = ir.add(f"{scope}/to64", "Cast", [value], device=var.device,
                              attrs={"SrcT": dtype, "DstT": dtypes.int64}).name
            reduced = self.collective(ir, f"{scope}/allreduce", "CollectiveReduceV2", send,
                                       dtypes.int64 if send != value else dtype, var.device)
            if send != value:
                reduced = ir.add(f"{scope}/from64", "Cast", [reduced], device=var.device,
                                 attrs={"SrcT": dtypes.int64, "DstT": dtype}).name
            if resource:
                assign = ir.add(f"{scope}/assign", "AssignVariableOp", [var.name, reduced],
                                device=var.device, attrs={"dtype": dtype}).name
            else:
                assign = ir.add(f"{scope}/assign", "Assign", [var.name, reduced], device=var.device,
                                attrs={"T": dtype, "use_locking": True, "validate_shape": True}).name
            group.append(assign)
            names.append(var.name)
        ir.add(BROADCAST_OP, "NoOp", control=group, device=self.controller)
        return names


    def _init_ops(self, ir: IR) -> None:
        """``replicate/between/local_init`` (broadcast, local variables, tables) and an always-
        ready ``ready_for_local_init`` for ``MonitoredTrainingSession``'s Scaffold: a worker does
        not wait for its own variables, which only its local init (the broadcast) sets."""
        from tensorflow.core.framework import variable_pb2

        control = [BROADCAST_OP]
        if ir.meta is not None and "local_variables" in ir.meta.collection_def:
            for raw in ir.meta.collection_def["local_variables"].bytes_list.value:
                init = variable_pb2.VariableDef.FromString(raw).initializer_name
                if node_of(init) in ir.nodes:
                    control.append(node_of(init))
        if "init_all_tables" in ir.nodes:
            control.append("init_all_tables")
        ir.add(LOCAL_INIT, "NoOp", control=control, device=self.controller)
        ir.const(READY_FOR_LOCAL_INIT, np.array([], dtype=object), dtypes.string, self.controller)


_REDUCIBLE = frozenset({dtypes.float32, dtypes.float64, dtypes.float16, dtypes.bfloat16,
                        dtypes.int32, dtypes.int64})


def _gradient_side(name: str) -> bool:
    """Readers of a weight that belong to gradient code (aggregation, per-term weighing)."""
    head, _, rest = name.partition("/")
    return name.startswith("replicate/") or (head.startswith(("tower_", "replicate_tower"))
                                            and rest.startswith("replicate/weigh"))


def _var_shape(node) -> list[int] | None:
    shape = node.attr("shape")
    if shape is None:
        return None
    dims = list(shape) if isinstance(shape, (list, tuple)) else None
    if dims is None or any(d is None or d < 0 for d in dims):
        return None
    return dims
