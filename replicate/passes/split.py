"""Split every batch input along its batch axis into one slice per tower.

Requires: ``ir.facts["analysis"]`` (batch inputs, static batch size if any) and the
tower devices.

Produces: for each batch input a ``SplitV`` on the controller under ``replicate/split/``,
per-tower example counts of each batch class (balanced: the first ``B mod N`` towers get one
more example; a second class, such as a GAN's noise, under ``replicate/split/class_<i>/``),
and ``ir.facts["towers"]``, a :class:`~replicate.batchflow.facts.Towers` holding the tower
prefixes, each tower's input tensors and the count tensors. With a static batch size the
counts are constants; otherwise they are computed from the class's first input's shape,
so uneven and tiny batches (even fewer examples than towers) split correctly, and each other
input of the class is split by the same counts computed from its own shape (a run may feed
it without the first; where the two meet, a check that they hold as many examples runs first:
``passes/_meets.py``), unless the class was joined by evidence only (row numbers of one input
picking rows of another), where one split by the first's counts fails on a feed of other sizes. A batch input
fed as a ``SparseTensor`` gives each tower the entries of its examples (``passes/_sparse.py``).
With gradient accumulation (``micro`` = k) every device gets k consecutive virtual towers,
one per micro-batch, and the batch is split into (devices x k) slices the same way.
"""

from __future__ import annotations

import logging

from tensorflow.python.framework import dtypes

from replicate.batchflow.analysis import moved
from replicate.batchflow.facts import Towers
from replicate.batchflow.inputs import columns_advice, one_per_column
from replicate.errors import AnalysisError
from replicate.graph.ir import IR, parse_tensor, tensor_name
from replicate.passes import _sparse
from replicate.passes._meets import check_meetings
from replicate.passes.pipeline import PassResult

__all__ = ["Split", "tower_prefixes", "tower_offsets", "SCOPE"]

log = logging.getLogger(__name__)

SCOPE = "replicate/split"


def tower_prefixes(ir: IR, count: int) -> list[str]:
    """``tower_<k>``, or ``replicate_tower_<k>`` if the graph already uses those names."""
    for base in ("tower", "replicate_tower", "replicate_tower_x"):
        prefixes = [f"{base}_{k}" for k in range(count)]
        if not any(n.split("/", 1)[0] in prefixes for n in ir.nodes):
            return prefixes
    raise ValueError("no free tower name scope")


class Split:
    """Configuration of the input split.

    Args:
        devices: one device per tower.
        controller: device of the split ops.
        micro: micro-batches per device (gradient accumulation); ``devices`` then lists each
            device ``micro`` times, once per virtual tower.
    """

    name = "split"

    def __init__(self, devices: list[str], controller: str, micro: int = 1):
        self.devices = list(devices)
        self.controller = controller
        self.micro = micro

    def run(self, ir: IR) -> PassResult:
        analysis = ir.facts["analysis"]
        n = len(self.devices)
        blocked = analysis.plan.unsplittable if analysis.plan is not None else []
        if blocked and n > 1:
            first = blocked[0]
            more = f" (and {len(blocked) - 1} more)" if len(blocked) > 1 else ""
            raise AnalysisError(f"cannot split the batch over {n} towers: "
                                f"{first.node}: {first.what}{more}; {first.fix}")
        towers = Towers(self.devices, tower_prefixes(ir, n), [dict() for _ in range(n)], [], None,
                        micro=self.micro)
        readers = _train_ops_reading(ir, analysis)
        # the first class (whose counts weigh the towers by default) is the one read by the
        # most train ops, and so is each class's first input
        order = list(dict.fromkeys(b.cls for b in sorted(analysis.batch_inputs,
                                                         key=lambda b: -readers.get(b.tensor, 0))))
        for i, cls in enumerate(order):
            members = sorted((b for b in analysis.batch_inputs if b.cls == cls),
                             key=lambda b: -readers.get(b.tensor, 0))
            scope = SCOPE if i == 0 else f"{SCOPE}/class_{i}"
            sizes = self._counts(ir, towers, cls, members, scope, analysis.classes.get(cls),
                                 analysis.granule)
            guessed = getattr(analysis.flow, "guessed", None) or {}
            dense = [b for b in members if b.sparse is None]
            evidence = analysis.flow.classes.evidence_of(cls) if analysis.flow is not None else None
            for batch_input in members:
                if batch_input.sparse is None:
                    common = batch_input is dense[0] or analysis.classes.get(cls) is not None \
                        or evidence is not None
                    self._split(ir, towers, batch_input, sizes if common else
                                self._own_sizes(ir, batch_input, analysis.granule))
                    if not common:
                        name, idx = parse_tensor(batch_input.tensor)
                        scope = f"{SCOPE}/{name}_{idx}/own"
                        check_meetings(ir, dense[0].tensor, batch_input.tensor, towers.class_batch[cls],
                                       f"{scope}/batch_size", scope, self.controller,
                                       analysis.flow.depths if analysis.flow is not None else {},
                                       analysis.region_set)
                    if batch_input is not dense[0] and any(b.tensor in guessed for b in dense):
                        self._check_agree(ir, batch_input, dense[0], towers.class_batch[cls],
                                          "; ".join(moved(t, why) for t, why in guessed.items())
                                          + "; if an input is fed batch-major, say so with "
                                          "batch_inputs={'<name>': 0}")
                    elif batch_input is not dense[0] and evidence is not None:
                        # one batch on evidence only (row numbers of one input picking rows of
                        # another): one device also runs a feed of other sizes, picking the
                        # first rows; the towers cannot (review 27: a split error said nothing)
                        self._check_agree(ir, batch_input, dense[0], towers.class_batch[cls],
                                          f"they were taken to be one batch because "
                                          f"'{evidence}' picks rows of one input by another's row "
                                          "numbers; feed them the same number of examples, or "
                                          "train this graph on one device")
                        analysis.warnings.append(
                            f"'{batch_input.tensor}' and '{dense[0].tensor}' are taken to be one "
                            f"batch because '{evidence}' picks rows of one input by another's row "
                            "numbers: feed them the same number of examples")
                elif batch_input.tensor == batch_input.sparse[0]:
                    _sparse.split(ir, towers, batch_input.sparse, towers.class_counts[cls],
                                  self.controller)
        first = order[0]
        towers.counts = towers.class_counts[first]
        towers.static_counts = towers.class_static[first]
        towers.batch_size = towers.class_batch[first]
        ir.facts["towers"] = towers
        log.info("split %d batch inputs (%d classes) over %d towers%s", len(analysis.batch_inputs),
                 len(order), n, f" (static counts {towers.static_counts})" if towers.static_counts else "")
        return PassResult(ir, True)

    def _counts(self, ir: IR, towers: Towers, cls: int, members, scope: str, static: int | None,
                granule: int = 1) -> str:
        """Per-tower example counts of one batch class (balanced: the first ``B mod N`` towers get
        one more); returns the sizes vector for ``SplitV``. With a dynamic batch and a
        ``granule`` g (an op groups the examples by g) the towers share the ``B // g`` groups
        that way, each count a multiple of g, and tower 0 takes any rest (where one device's op
        fails too). A static batch is split evenly: the sizes such an op bakes in (the number of
        groups) are not rewritten per tower, and the analysis refuses it."""
        n, dev = len(self.devices), self.controller
        if static is not None:
            # name them: a fixed-length vector taken for a batch of its own (pair indices of a
            # ranking loss) was refused without saying which input, or how to say it is none
            which = (f" ({', '.join(repr(b.tensor) for b in members)}; if they hold no examples, "
                     "name them with shared_inputs=)")
            which += columns_advice([b.tensor for b in members if one_per_column(ir.static_shape(b.tensor))])
            if any(b.source_op.startswith("QueueDequeue") for b in members):
                # review 36: the advice read as if for placeholders only
                which += ("; a queue's batch (tf.compat.v1.train.batch) gets one with "
                          "allow_smaller_final_batch=True")
            if static < n and self.micro > 1:
                raise AnalysisError(
                    f"accumulate={self.micro}: the batch inputs have a static batch size of "
                    f"{static}, fewer than the {n} micro-batches ({n // self.micro} devices x "
                    f"{self.micro}); use a smaller accumulate or a dynamic batch dimension (None)"
                    + which)
            if static < n:
                raise AnalysisError(f"the batch inputs have a static batch size of {static}, fewer "
                                    f"than the {n} towers; give them a dynamic batch dimension (None)"
                                    + which)
            counts = [(static + n - 1 - k) // n for k in range(n)]
            towers.class_static[cls] = counts
            towers.class_batch[cls] = ir.const(f"{scope}/batch_size", static, dtypes.int32, dev)
            towers.class_counts[cls] = [ir.const(f"{scope}/count_{k}", c, dtypes.int32, dev)
                                        for k, c in enumerate(counts)]
            return ir.const(f"{scope}/sizes", counts, dtypes.int32, dev)
        dense = [b for b in members if b.sparse is None]
        if dense:
            batch = _size(ir, dense[0].tensor, dense[0].axis, scope, "batch_size", dev)
        else:
            batch = _sparse.batch_size(ir, members[0].sparse, scope, dev)
        counts = self._shares(ir, batch, scope, granule)
        towers.class_static[cls] = None
        towers.class_batch[cls] = batch
        towers.class_counts[cls] = counts
        return ir.add(f"{scope}/sizes", "Pack", counts, device=dev,
                      attrs={"T": dtypes.int32, "N": n, "axis": 0}).name

    def _own_sizes(self, ir: IR, batch_input, granule: int) -> str:
        """The ``SplitV`` sizes of an input of a dynamic batch computed from its own shape
        (they equal its class's when the driver feeds the class together): a run that feeds
        it without the class's first input (a prediction fed ``x`` where the labels ``y`` come
        first in the graph) asked for that input (review 19)."""
        name, idx = parse_tensor(batch_input.tensor)
        scope, dev = f"{SCOPE}/{name}_{idx}/own", self.controller
        counts = self._shares(ir, _size(ir, batch_input.tensor, batch_input.axis, scope, "batch_size", dev),
                              scope, granule)
        return ir.add(f"{scope}/sizes", "Pack", counts, device=dev,
                      attrs={"T": dtypes.int32, "N": len(counts), "axis": 0}).name

    def _shares(self, ir: IR, batch: str, scope: str, granule: int) -> list[str]:
        """Each tower's count of a dynamic batch of ``batch`` examples (see :meth:`_counts`)."""
        n, dev = len(self.devices), self.controller
        towers_const = ir.const(f"{scope}/towers", n, dtypes.int32, dev)
        i32 = {"T": dtypes.int32}
        units = batch
        if granule > 1:
            size = ir.const(f"{scope}/granule", granule, dtypes.int32, dev)
            units = ir.add(f"{scope}/groups", "FloorDiv", [batch, size], device=dev, attrs=i32).name
        counts = []
        for k in range(n):
            extra = ir.const(f"{scope}/round_{k}", n - 1 - k, dtypes.int32, dev)
            total = ir.add(f"{scope}/padded_{k}", "AddV2", [units, extra], device=dev, attrs=i32).name
            name = f"{scope}/count_{k}" if granule == 1 else f"{scope}/groups_{k}"
            counts.append(ir.add(name, "FloorDiv", [total, towers_const], device=dev, attrs=i32).name)
        if granule > 1:
            counts = [ir.add(f"{scope}/count_{k}" if k else f"{scope}/share_0", "Mul", [c, size],
                             device=dev, attrs=i32).name for k, c in enumerate(counts)]
            rest = ir.add(f"{scope}/rest", "FloorMod", [batch, size], device=dev, attrs=i32).name
            counts[0] = ir.add(f"{scope}/count_0", "AddV2", [counts[0], rest], device=dev,
                               attrs=i32).name
        return counts

    def _split(self, ir: IR, towers: Towers, batch_input, sizes: str) -> None:
        n, dev = len(self.devices), self.controller
        name, idx = parse_tensor(batch_input.tensor)
        axis = ir.const(f"{SCOPE}/{name}_{idx}/axis", batch_input.axis, dtypes.int32, dev)
        node = ir.add(f"{SCOPE}/{name}_{idx}", "SplitV", [_ref(batch_input.tensor), sizes, axis],
                      device=dev, attrs={"T": dtypes.as_dtype(ir.output_dtype(batch_input.tensor)),
                                         "Tlen": dtypes.int32, "num_split": n})
        for k in range(n):
            towers.inputs[k][batch_input.tensor] = tensor_name(node.name, k)


    def _check_agree(self, ir: IR, member, first, batch: str, said: str) -> None:
        """Before ``member`` is split, check it holds as many examples along its axis as
        ``first`` does, ``said`` telling why they were taken to be one batch: the layout of a
        guessed time-major input (``[T, B]`` and ``[B, T]`` look alike when both are dynamic),
        or row numbers of one picking rows of the other, is decided by the feed, and a wrong
        guess failed in ``SplitV`` with a message that did not say why."""
        dev, i32 = self.controller, {"T": dtypes.int32}
        name, idx = parse_tensor(member.tensor)
        scope = f"{SCOPE}/{name}_{idx}/check"
        size = _size(ir, member.tensor, member.axis, scope, "size", dev)
        same = ir.add(f"{scope}/same", "Equal", [size, batch], device=dev, attrs=i32).name
        text = (f"replicate: batch input '{member.tensor}' holds another number of examples along "
                f"axis {member.axis} than '{first.tensor}' along axis {first.axis} (the two sizes "
                f"follow): {said}")
        message = ir.const(f"{scope}/message", text, dtypes.string, dev)
        check = ir.add(f"{scope}/assert", "Assert", [same, message, size, batch], device=dev,
                       attrs={"T": [dtypes.string, dtypes.int32, dtypes.int32], "summarize": 3})
        ir.set_control(f"{SCOPE}/{name}_{idx}", [check.name])


def tower_offsets(ir: IR, towers: Towers, cls: int) -> list[str]:
    """Where each tower's examples of batch class ``cls`` start in the global batch (int32
    scalars on the controller), made once per class."""
    if cls in towers.class_offsets:
        return towers.class_offsets[cls]
    scope = f"{SCOPE}/offsets/class_{cls}"
    counts = towers.class_counts[cls]
    device = ir.nodes[counts[0].split(":")[0]].device
    static = towers.class_static.get(cls)
    if static is not None:
        out = [ir.const(f"{scope}/offset_{k}", int(sum(static[:k])), dtypes.int32, device)
               for k in range(len(counts))]
    else:
        out = [ir.const(f"{scope}/offset_0", 0, dtypes.int32, device)]
        for k in range(1, len(counts)):
            out.append(ir.add(f"{scope}/offset_{k}", "AddV2", [out[-1], counts[k - 1]],
                              device=device, attrs={"T": dtypes.int32}).name)
    towers.class_offsets[cls] = out
    return out


def _train_ops_reading(ir: IR, analysis) -> dict[str, int]:
    """Batch input -> how many gradient scopes (train ops) depend on it. A class's counts are
    computed from the input the most train ops read, so that each train op's weights need
    only its own feeds (a GAN's generator step fed the noise alone, its discriminator scoring
    ``concat([x, G(z)], 0)``: the counts came from ``x``, and the step asked for it)."""
    scopes = sorted((s.prefix for s in analysis.scopes), key=len, reverse=True)
    owner = {parse_tensor(f.tensor)[0]: next((p for p in scopes if f.tensor.startswith(p + "/")), "")
             for f in analysis.frontier if f.gradient}
    counts = {}
    for b in analysis.batch_inputs:
        work = [c.name for c, _ in ir.data_consumers(b.tensor)]
        seen, found = set(work), set()
        while work:
            name = work.pop()
            if name in owner:
                found.add(owner[name])
            for after in ir.consumers(name):
                if after.name not in seen:
                    seen.add(after.name)
                    work.append(after.name)
        counts[b.tensor] = len(found)
    return counts


def _size(ir: IR, tensor: str, axis: int, scope: str, name: str, dev: str) -> str:
    """A node ``<scope>/<name>`` computing ``tensor``'s size along ``axis`` at run time."""
    shape = ir.add(f"{scope}/shape", "Shape", [_ref(tensor)], device=dev,
                   attrs={"T": dtypes.as_dtype(ir.output_dtype(tensor)), "out_type": dtypes.int32}).name
    position = ir.const(f"{scope}/axis", axis, dtypes.int32, dev)
    zero = ir.const(f"{scope}/zero", 0, dtypes.int32, dev)      # gather along the shape vector
    return ir.add(f"{scope}/{name}", "GatherV2", [shape, position, zero], device=dev,
                  attrs={"Tparams": dtypes.int32, "Tindices": dtypes.int32, "Taxis": dtypes.int32}).name


def _ref(tensor: str) -> str:
    name, idx = parse_tensor(tensor)
    return name if idx == 0 else f"{name}:{idx}"

