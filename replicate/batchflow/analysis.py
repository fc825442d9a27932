"""Run the batch dataflow to a consistent answer: which inputs are the batch, what every
tensor is, and what the rewrite must change.

Batch inputs are not guessed from names or sizes. Every placeholder or iterator output of
rank >= 1 that the region reads starts as a hypothetical batch input with a class of its own;
the dataflow then looks for evidence:

- a *conflict*: the hypothesis puts two batch axes into one tensor (``x[B, 3] * w[3]`` with
  ``w`` a class-weights placeholder), broadcasts one input's "batch" against another's, or
  unites classes of different static sizes. The input on the later axis (or of the smaller
  class) is not a batch input;
- the *loss*: a batch input's examples must be reduced by some loss; a hypothetical class no
  loss reduces is shared.

Each demotion restarts the analysis. Then rounds repeat while the plan resizes shared tensors
(a resized zero state makes the loop state per-example, which may demand more) or promotes a
demanded placeholder to a batch input (a fed initial state).
"""

from __future__ import annotations

import collections
import dataclasses
import logging

from tensorflow.core.framework import types_pb2

from replicate.batchflow import table
from replicate.batchflow.context import Context
from replicate.batchflow.facts import Reason
from replicate.batchflow.inputs import one_per_column
from replicate.batchflow.lattice import SHARED, Classes, Fact
from replicate.batchflow.loss import Term, decompose
from replicate.batchflow.plan import Plan, frame_depths, resolve
from replicate.batchflow.rules.common import ROWS_CONFLICT
from replicate.batchflow.solver import order, solve
from replicate.graph.ir import IR, node_of, parse_tensor, tensor_name
from replicate.graph.ops import sparse_role

__all__ = ["Flow", "analyze", "MAX_ROUNDS"]

log = logging.getLogger(__name__)

#: Rounds of resizing and promotion before the analysis gives up.
MAX_ROUNDS = 12


@dataclasses.dataclass
class Flow:
    """The settled dataflow.

    Attributes:
        ctx: the final context (facts, classes, recorded obligations).
        inputs: batch inputs: tensor -> (axis, class representative).
        demoted: inputs that looked like batch inputs but are shared, with why.
        plan: what the rewrite must do per tower.
        losses: loss tensor -> (terms, reason it is not decomposable or None).
        order: region nodes in topological order.
        depths: loop-frame depth of each region node.
    """

    ctx: Context
    inputs: dict[str, tuple[int, int]]
    demoted: dict[str, str]
    plan: Plan
    losses: dict[str, tuple[list[Term], Reason | None]]
    order: list[str]
    depths: dict[str, int]
    #: inputs taken to hold the batch on axis 1 without the user saying so, with why
    guessed: dict = dataclasses.field(default_factory=dict)
    #: inputs of a fixed shape taken to be read whole by every tower, with why
    unsplit: dict = dataclasses.field(default_factory=dict)
    #: batch inputs that, read whole by every tower instead, leave nothing unproven
    shareable: list = dataclasses.field(default_factory=list)

    @property
    def classes(self) -> Classes:
        return self.ctx.classes

    def fact(self, ref: str) -> Fact | None:
        """The fact of tensor ``ref``."""
        return self.ctx.fact(ref)

    def dependent(self, name: str, outputs: int) -> bool:
        """True when some output of node ``name`` differs between towers."""
        for i in range(max(1, outputs)):
            fact = self.ctx.facts.get(f"{name}:{i}")
            if fact is not None and fact.kind != SHARED:
                return True
        return False

    def classes_of_inputs(self) -> dict[int, list[str]]:
        """Batch class representative -> its batch inputs, in order."""
        out: dict[int, list[str]] = collections.defaultdict(list)
        for tensor, (_, cls) in self.inputs.items():
            out[self.classes.find(cls)].append(tensor)
        return dict(out)

    def couplings(self) -> list[str]:
        """Forward batch reductions whose per-tower value reaches a loss (batch-norm moments, a
        cond on a batch sum, the longest sequence of the batch)."""
        found: dict[str, None] = {}
        for terms, _ in self.losses.values():
            for term in terms:
                fact = self.fact(term.root)
                for src in sorted(fact.taint if fact is not None else ()):
                    found.setdefault(src, None)
        for loss in self.losses:
            fact = self.fact(loss)
            for src in sorted(fact.taint if fact is not None else ()):
                found.setdefault(src, None)
        for terms, _ in self.losses.values():
            for term in terms:
                for src in term.sync:
                    found.setdefault(src, None)
        return list(found)

    def loss_syncs(self) -> set[str]:
        """Batch reductions a loss term is a nonlinear function of: synchronized in every mode."""
        return {src for terms, _ in self.losses.values() for t in terms for src in t.sync}

    def denominators(self) -> dict[str, tuple[str, ...]]:
        """Loss denominators the gradient code reads as the global batch's values -> the batch
        reductions each is computed from (:class:`~replicate.batchflow.loss.Term`)."""
        return {t.denominator[0]: t.denominator[1:] for terms, _ in self.losses.values()
                for t in terms if t.denominator}


def _drop_double_resizing(plan: Plan) -> None:
    """A round may plan to cut a tensor to the towers' rows that a later round makes
    tower-sized by the shape it is built from (a static ``StridedSliceGrad`` whose shape
    operand becomes the tower's count): cutting it again failed (the rewrite did not import).
    The shape wins; the cut goes."""
    sized = {p.via for positions in plan.elements.values() for p in positions}
    for tensor in [t for t in plan.slices if node_of(t) in sized]:
        del plan.slices[tensor]


def analyze(ir: IR, region: list[str], candidates: list[str], gradient: set[str], scopes: list[str],
            losses: list[str], forced: dict[str, int] | None = None,
            sparse: list[tuple[str, str | None, str | None]] = (), whole: frozenset = frozenset()) -> Flow:
    """Settle the batch dataflow of ``region``.

    Args:
        ir: the graph with static shapes.
        region: the tower region in graph order.
        candidates: input tensors that might carry the batch (on axis 0).
        gradient: nodes of gradient scopes.
        scopes: gradient scope prefixes.
        losses: the tensors the gradient computations differentiate.
        forced: the user's batch inputs (tensor -> axis); no evidence is weighed then.
        sparse: batch inputs fed as a SparseTensor: (indices, values, dense shape); the
            indices are the candidate, the other two follow it (None: not fed).
        whole: the user's ``shared_inputs``, never made batch inputs by a demand.
    """
    visit = order(ir, region)
    depths = frame_depths(ir, visit)
    pool = dict(forced) if forced else {t: 0 for t in candidates}

    def settle(pool: dict[str, int]) -> Flow:
        pool, demoted = dict(pool), {}
        for _ in range(len(pool) + 1):
            flow, victim = _settle(ir, region, pool, gradient, scopes, losses, visit, depths,
                                   forced is not None, sparse, whole)
            if victim is None:
                break
            for tensor, why in victim.items():
                demoted[tensor] = why
                pool.pop(tensor, None)
        flow.demoted = demoted
        return flow

    flow = settle(pool)
    looped = _time_major(ir, [t for t in pool if t in flow.inputs]) if not forced and _unproven(flow) else []
    if looped:
        # the loop's inputs and every other input laid out like them ([T, B, ...], both
        # leading dimensions dynamic: per-step labels) move together
        steps = {(ir.static_shape(t) or [None])[0] for t in looped}
        alike = [t for t in pool if t in flow.inputs and _laid_out_like(ir, t, steps)]
        # with a dynamic T a [B, T] label looks like a [T, B] one: try the loop's inputs alone
        # too (moved along, it was split by its time steps and the rewrite failed at step 1)
        options = [set(looped) | set(alike)] + ([set(looped)] if set(alike) - set(looped) else [])
        best = flow
        for moved in options:
            trial_pool = {**pool, **{t: 1 for t in moved}}
            trial = settle(trial_pool)
            # a tie with the unmoved split still moves: split by its time steps, a looped
            # input makes the towers run different numbers of steps, and the rewrite failed
            # at step 1 (review 10); the tie among the options keeps the first
            if _proves_more(trial, best, ties=best is flow):
                trial.guessed = {t: "a loop reads its leading axis step by step" if t in looped
                                 else "it is laid out like the inputs a loop reads step by step"
                                 for t in trial_pool if trial_pool[t] == 1 and t in trial.inputs}
                best, best_pool = trial, trial_pool
        if best is not flow:
            flow, pool = best, best_pool
    if not forced and _unproven(flow):
        # a lone label or mask fed time-major beside batch-major inputs ([T, B] compared with
        # transposed logits): split by its time steps, the rewrite failed at step 1. Only
        # integer and boolean inputs: a float input moved so made a mismatch of the program's
        # own layouts look consistent (a guess the warning states; review 10). Lone: an input
        # the batch flow already pairs with another (token ids with their lengths) is not,
        # and moved, a [B, T] matrix of ids with both axes dynamic was split by its time
        # steps and the rewrite failed at step 1 (review 26)
        alone = {c for c, members in flow.classes_of_inputs().items() if len(members) == 1}
        for t in [t for t in pool if pool[t] == 0 and t in flow.inputs and _laid_out_like(ir, t, {None})
                  and ir.output_dtype(t) in _LABEL_TYPES
                  and flow.classes.find(flow.inputs[t][1]) in alone]:
            trial_pool = {**pool, t: 1}
            trial = settle(trial_pool)
            if _proves_more(trial, flow):
                trial.guessed = {**flow.guessed, t: "only so do the ops that read it pair its rows "
                                 "with the batch's"}
                flow, pool = trial, trial_pool
    columns = [t for t in pool if pool[t] == 0 and t in flow.inputs and _columns(ir, t)] \
        if not forced and _blocked(flow) else []
    if columns:
        # examples as columns ([features, None] inputs and W @ X, a course's TF1 style):
        # taken for a batch of its fixed size, a [6, 4] weight read as per-example state
        # (review 36: refused). Moved to axis 1 if that proves more
        trial_pool = {**pool, **{t: 1 for t in columns}}
        trial = settle(trial_pool)
        if _blocked(trial) < _blocked(flow) and not set(trial.demoted) - set(flow.demoted):
            trial.guessed = {**{t: why for t, why in flow.guessed.items() if t in trial.inputs},
                             **{t: f"its axis 0 has a fixed size and axis 1 is its only dynamic one "
                                f"{COLUMNS}" for t in columns if t in trial.inputs}}
            flow, pool = trial, trial_pool
    fixed = _fixed_classes(ir, flow, pool) if not forced and _blocked(flow) else []
    if fixed:
        # a vector of a fixed length beside a batch of any size (multi-task loss weights, a
        # stateless seed) was split as a batch of its own: refused, or inexact, for a cause
        # the split itself made (review 11). Read whole by every tower instead, if that
        # proves more
        trial = settle({t: a for t, a in pool.items() if t not in fixed})
        if _blocked(trial) < _blocked(flow) and not set(trial.demoted) - set(flow.demoted):
            trial.guessed = {t: why for t, why in flow.guessed.items() if t in trial.inputs}
            trial.unsplit = {t: f"its shape {ir.static_shape(t)} is fixed while the batch's is not, "
                             "and split by examples it "
                             + ("could not be split over the towers" if flow.plan.unsplittable else
                                "made the result inexact") for t in fixed}
            flow = trial
    if not forced and _blocked(flow) and len(flow.classes_of_inputs()) > 1:
        # an input of its own split as examples (a few-shot program's support set) made the
        # result inexact, and the reasons only blamed the op that mixed its rows (review 36):
        # the first input which, read whole by every tower, leaves nothing unproven is named
        for t in [t for t in pool if t in flow.inputs]:
            trial = settle({u: a for u, a in pool.items() if u != t})
            if not _blocked(trial) and trial.inputs and not set(trial.demoted) - set(flow.demoted):
                flow.shareable = [t]
                break
    return flow


#: Types of labels, masks and ids.
_LABEL_TYPES = frozenset({types_pb2.DT_INT32, types_pb2.DT_INT64, types_pb2.DT_BOOL})


def _proves_more(trial: Flow, flow: Flow, ties: bool = False) -> bool:
    """A retry with inputs moved to axis 1 is kept only when it proves more (or as much, with
    ``ties``) and demotes nothing more (a per-step label left on axis 0 beside inputs moved
    to axis 1 was claimed exact and split by the time steps)."""
    better = _unproven(trial) <= _unproven(flow) if ties else _unproven(trial) < _unproven(flow)
    return better and not set(trial.demoted) - set(flow.demoted)


def _blocked(flow: Flow) -> int:
    """What keeps the result from being exact: unproven losses, plan reasons, and ops no
    split of the batch can run."""
    return _unproven(flow) + len(flow.plan.unsplittable)


def _fixed_classes(ir: IR, flow: Flow, pool: dict[str, int]) -> list[str]:
    """Batch inputs of a fully static shape whose batch class holds no input of a dynamic
    size, when some candidate has a dynamic batch size (else they are the batch; the
    candidate may have been demoted for them: loss weights stacked with its reductions)."""
    def dynamic_size(t: str) -> bool:
        shape = ir.static_shape(t)
        return shape is not None and pool.get(t, 0) < len(shape) and shape[pool.get(t, 0)] is None

    if not any(dynamic_size(t) for t in pool):
        return []
    classes = flow.classes
    mixed_in = {classes.find(c) for t, (_, c) in flow.inputs.items() if dynamic_size(t)}
    out = []
    for t, (_, cls) in flow.inputs.items():
        shape = ir.static_shape(t)
        if classes.find(cls) not in mixed_in and shape and all(d is not None for d in shape):
            out.append(t)
    return out


def moved(tensor: str, why: str) -> str:
    """How reports state the guess that ``tensor`` holds its batch on axis 1 (``Flow.guessed``)."""
    layout = "laid out with its examples" if why.endswith(COLUMNS) else "time-major, its batch"
    return f"input '{tensor}' is taken to be {layout} on axis 1 ({why})"


#: The end of the reason for moving an input whose examples are its columns to axis 1.
COLUMNS = "(one example per column)"


def _columns(ir: IR, tensor: str) -> bool:
    """``tensor`` may hold one example per column: a fixed axis 0, and axis 1 its only
    dynamic axis."""
    shape = ir.static_shape(tensor)
    return one_per_column(shape) and None not in shape[2:]


def _laid_out_like(ir: IR, tensor: str, steps: set) -> bool:
    """``tensor`` may be ``[T, B, ...]`` as the loop's inputs are: a dynamic axis 1 after a
    leading axis of their number of steps (dynamic, or the same static T: a per-step label
    declared ``[T, None]`` stayed on axis 0 as a "batch of T" beside inputs moved to axis 1)."""
    shape = ir.static_shape(tensor)
    return shape is not None and len(shape) >= 2 and shape[1] is None and shape[0] in steps


#: Ops that unstack their input's leading axis into the elements a loop reads one by one.
_UNSTACKS = {"TensorArrayScatterV3": 2, "TensorListFromTensor": 0}


def _time_major(ir: IR, inputs: list[str]) -> list[str]:
    """Inputs of rank 2 or more whose leading axis a loop reads element by element (a
    time-major ``[T, B, ...]`` placeholder fed to ``dynamic_rnn(time_major=True)``): the
    batch may be their axis 1. Taken for axis 0, the loop carried the state from one
    "example" to the next and the rewrite split along time (it failed at step 1)."""
    out = []
    for t in inputs:
        shape = ir.static_shape(t)
        if shape is None or len(shape) < 2 or shape[1] is not None:
            continue
        if _unstacked(ir, t):
            out.append(t)
    return out


#: Ops between a time-major input and the loop that keep its layout: identities, elementwise
#: ops (a dropout's mask, a scale) and reversing the sequences along their time axis.
def _keeps_layout(op: str) -> bool:
    return op in table.UNARY or op in table.BROADCAST or op in table.PASS_THROUGH \
        or op == "ReverseSequence"


def _unstacked(ir: IR, tensor: str) -> bool:
    """A loop reads ``tensor``'s leading axis element by element, directly or through ops that
    keep its layout (a variational dropout, ``tf.reverse_sequence`` of a backward RNN)."""
    work, seen = [tensor], set()
    while work and len(seen) < 64:
        ref = work.pop()
        for c, i in ir.data_consumers(ref):
            if _UNSTACKS.get(c.op) == i:
                return True
            if c.name not in seen and _keeps_layout(c.op):
                seen.add(c.name)
                work.append(f"{c.name}:0")
    return False


def _unproven(flow: Flow) -> int:
    """How many losses the dataflow could not decompose, and plan reasons."""
    return sum(1 for _, reason in flow.losses.values() if reason is not None) + len(flow.plan.reasons)


def _settle(ir: IR, region: list[str], pool: dict[str, int], gradient: set[str], scopes: list[str],
            losses: list[str], visit: list[str], depths: dict[str, int], forced: bool,
            sparse: list[tuple[str, str | None, str | None]] = (), whole: frozenset = frozenset()
            ) -> tuple[Flow, dict[str, str] | None]:
    classes = Classes()
    inputs = {}
    triples = {t[0]: t for t in sparse if t[0] in pool}
    roles: dict[str, str] = {}
    for tensor, axis in pool.items():
        if any(tensor in t[1:] for t in triples.values()):
            continue                # named with its indices: it follows them
        if tensor in triples:       # the examples are rows of the dense shape, not entries
            cls = classes.new(None)
            for position, part_ in enumerate(triples[tensor]):
                role = sparse_role(position)
                if part_ is not None:
                    inputs[part_], roles[part_] = (0, cls), role
            continue
        shape = ir.static_shape(tensor)
        inputs[tensor] = (axis, classes.new(shape[axis] if shape and axis < len(shape) else None))
    resized: dict[str, tuple] = {}
    plan = Plan()
    for _ in range(MAX_ROUNDS):
        ctx = solve(ir, region, inputs, gradient, classes, resized, visit, sparse=roles)
        if not forced:
            victim = _conflict_victim(classes, inputs)
            if victim:
                return Flow(ctx, inputs, {}, Plan(), {}, visit, depths), victim
        earlier, plan = plan, resolve(ctx, depths, scopes)
        plan.absorb(earlier)
        changed = False
        for tensor, d in plan.promote.items():
            if tensor in whole:
                # the user says every tower reads it whole, and its rows pair with the batch's
                # (review 37: it was made a batch input all the same, silently)
                why = (f"'{tensor}' is named in shared_inputs, but its rows pair with the batch's "
                       f"in '{d.by}': every tower would need its own rows of it")
                if not any(r.what == why for r in plan.unsplittable):
                    plan.unsplittable.append(Reason(node_of(tensor), why, "leave it out of "
                                                    "shared_inputs: it is then split with the batch"))
                continue
            if tensor not in inputs:
                shape = ir.static_shape(tensor)
                inputs[tensor] = (d.dim, d.cls)
                if shape and shape[d.dim] is not None:
                    classes.union(d.cls, classes.new(shape[d.dim]), node_of(tensor))
                changed = True
        for tensor, entry in plan.resized.items():
            if resized.get(tensor) != entry:
                resized[tensor] = entry
                changed = True
        if not changed:
            break
    _drop_double_resizing(plan)
    for a, b, where, why in classes.conflicts:
        if why.endswith(ROWS_CONFLICT) and a is not None and b is not None \
                and classes.find(a) == classes.find(b):
            # one batch after all (united elsewhere), yet paired row for row with two layouts
            # (a mask fed flat [B*T] times a per-token loss): a split cannot serve both
            plan.unsplittable.append(Reason(where, f"'{where}' pairs rows of one batch held as "
                                            f"{why[:-len(ROWS_CONFLICT)]}rows per "
                                            "example (a tensor fed flattened with its time steps?); "
                                            "replicate splits fed tensors by examples",
                                            "feed it with one row per example ([batch, steps]) and "
                                            "flatten it in the graph"))
            break
    decomposed = {loss: decompose(ctx, loss) for loss in losses}
    flow = Flow(ctx, {t: (a, classes.find(c)) for t, (a, c) in inputs.items()}, {}, plan, decomposed,
                visit, depths)
    if forced:
        return flow, None
    reduced = {m for terms, _ in decomposed.values() for t in terms
               for c in _term_classes(ctx, t) for m in _members(classes, c)}
    if any(reason is not None for _, reason in decomposed.values()):
        return flow, None           # the loss is inexact anyway: keep every hypothesis
    unused = {t: "the loss does not reduce over its leading dimension"
              for t, (_, cls) in inputs.items() if t in pool and classes.find(cls) not in reduced}
    return flow, (unused or None)


def _members(classes: Classes, c: int) -> set[int]:
    """Class ``c`` and, when it holds copies of one batch one after the other in different
    layouts (NCF's positives and each one's negatives, review 28), that batch, and the
    batches that the same concatenation of another tensor holds at the same places (its
    items beside its users), as representatives. A concatenation of two batches alone (a
    GAN's real and generated examples, a batch and a replay buffer) reduces neither: which
    is the batch is then undecided."""
    out, work = set(), [c]
    while work:
        x = classes.find(work.pop())
        if x in out:
            continue
        out.add(x)
        joins = [members for key, members in classes.parts.items() if classes.find(key) == x]
        copies = {len(m) for m in joins if len({classes.find(p) for p in m}) == 1}
        work.extend(p for m in joins if len(m) in copies for p in m)
    return out


def _term_classes(ctx, term) -> list[int]:
    """The batch classes a loss term reduces: a ratio's numerator and denominator may reduce
    two batches (``reduce_sum(xent) / reduce_sum(mask)`` with the mask fed on its own)."""
    found = [term.cls] if term.cls is not None else []
    if term.kind == "ratio":
        node = ctx.ir.nodes[node_of(term.root)]
        for ref in node.inputs[:2]:
            fact = ctx.fact(ref)
            if fact is not None and fact.cls is not None:
                found.append(fact.cls)
    return found


def _conflict_victim(classes: Classes, inputs: dict[str, tuple[int, int]]) -> dict[str, str] | None:
    """The hypothetical batch inputs to drop for the first conflict found, with why."""
    if not classes.conflicts:
        return None
    members: dict[int, list[str]] = collections.defaultdict(list)
    for tensor, (_, cls) in inputs.items():
        members[classes.find(cls)].append(tensor)
    for keep, drop, where, why in classes.conflicts:
        if keep is None:            # evidence against one hypothesis, none for another
            victims = members.get(classes.find(drop))
            if victims:
                return {t: f"its entries are picked at '{where}' by positions the same in every "
                        "tower" for t in victims}
            continue
        keep, drop = classes.find(keep), classes.find(drop)
        if keep == drop:
            continue
        if why != "lookup" and len(members.get(drop, [])) > len(members.get(keep, [])):
            keep, drop = drop, keep
        victims = members.get(drop)
        if not victims:
            continue
        other = members.get(keep, ["?"])[0]
        what = {"two batch axes": f"its leading dimension meets a non-batch dimension of the "
                                  f"computation of '{other}' at '{where}'",
                "broadcast": f"it is broadcast against '{other}' at '{where}'",
                "matrix product": f"it is multiplied with '{other}' at '{where}' along another axis",
                "lookup": f"it is a table looked up by the values of '{other}' at '{where}'"
                }.get(why, f"{why} at '{where}' disagree with '{other}'")
        return {t: what for t in victims}
    return None


def tensor(ref: str) -> str:
    """The canonical ``name:k`` spelling of ``ref``."""
    return tensor_name(*parse_tensor(ref))
