"""What a rule sees while the batch dataflow runs: input facts, static shapes and values,
and where it records what it learned besides output facts.

Rules record three kinds of obligations for the rewrite:

- a **demand**: a shared tensor whose dimension must hold each tower's own examples (a zero
  state ``[batch, hidden]`` that meets per-example values; a folded ``ones_like``);
- a **position**: an element of an integer operand that holds the batch size, statically
  (``Reshape`` to ``[32 * 20, 200]``: element 0 is 20 rows per example); each tower needs its
  own count there;
- an **attribute position**: a shape attribute whose dimension is the batch size.

Obligations are resolved after the forward pass (:mod:`replicate.batchflow.plan`).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from replicate.batchflow import table
from replicate.batchflow.lattice import Classes, Fact, Sym, mixed, shared
from replicate.graph.ir import IR, Node, node_of, parse_tensor, tensor_name

__all__ = ["Context", "Demand", "Position"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Demand:
    """Dimension ``dim`` of a shared tensor must hold each tower's examples of ``cls``:
    ``block`` consecutive rows per example, the whole repeated ``outer`` times."""

    tensor: str
    dim: int
    cls: int
    block: int | None
    outer: int | None
    by: str

    @property
    def rows(self) -> int | None:
        """Rows per example along ``dim`` (None unless a known integer)."""
        if not isinstance(self.block, int) or not isinstance(self.outer, int):
            return None
        return self.block * self.outer


@dataclasses.dataclass(frozen=True)
class Position:
    """Element ``element`` (None for a scalar) of integer tensor ``tensor`` holds ``factor`` times
    the batch size of ``cls``; ``via`` is the node that reads ``tensor`` on the way to ``by``."""

    tensor: str
    element: int | None
    cls: int
    factor: int
    by: str
    via: str | None = None


#: Ops between a fed input and an op that reads it as fed (``tf.cast(idx, tf.int64)``, a TF1
#: cond's ``Switch``, a TF1 loop's ``Enter``).
FED_PATH = table.IDENTITIES | {"Cast", "Switch", "Enter"}


class Context:
    """Facts, shapes and recorded obligations of one run of the dataflow.

    Args:
        ir: the graph (static shapes loaded).
        inputs: batch inputs: tensor -> (axis, class).
        gradient: nodes of gradient scopes (their batch reductions are not couplings).
        classes: the batch classes.
        resized: shared tensors a previous round made tower-sized: tensor -> (dim, class, block,
            index) where ``index`` says the values are local row numbers.
    """

    def __init__(self, ir: IR, inputs: dict[str, tuple[int, int]], gradient: set[str],
                 classes: Classes, resized: dict[str, tuple] | None = None,
                 seeds: dict[str, Fact] | None = None, all_gradient: bool = False,
                 functions: dict | None = None):
        self.ir = ir
        self.inputs = inputs
        self.gradient = gradient
        self.classes = classes
        self.resized = resized or {}
        self.seeds = seeds or {}
        self.all_gradient = all_gradient
        self.functions = functions if functions is not None else {}
        #: TF1 cond ``Merge`` -> the predicates that decide it (``rules/control.py``), found once.
        self.cond_predicates: dict[str, set[str] | None] = {}
        #: ``If``/``While`` node -> the batch reductions its condition is computed from
        #: (``rules/functional.py``).
        self.decided_by: dict[str, frozenset] = {}
        #: Set by the solver, which owns the rules (so that neither this module nor a rule
        #: imports the solver or the rules): ``solve(ir, region, ...)`` analyses a function
        #: body (:func:`replicate.batchflow.solver.solve`), ``sparse_source(ctx, tensor,
        #: cls)`` gives the fact of one part of a sparse batch input
        #: (:func:`replicate.batchflow.rules.sparse.source`).
        self.solve = None
        self.sparse_source = None
        #: Set by the solver as well: ``body(ctx, function, refs)`` is a called function's
        #: IR, arguments and results (:func:`replicate.batchflow.rules.functional.body_of`).
        self.body = None
        #: Named dimensions followed back so far (:mod:`replicate.batchflow.dims`).
        self.dim_sources: dict[tuple[str, int], tuple[str, int]] = {}
        self.notes: list[tuple[str, str]] = []
        #: Placeholders without a static rank that left an op's layout unknown.
        self.shapeless: set[str] = set()
        #: In a function body: its arguments without a static rank that did so.
        self.shapeless_args: set[str] = set()
        #: Ops no split of the batch can run: node -> (what, fix).
        self.refusals: dict[str, tuple[str, str]] = {}
        self.refined: dict[str, list[int | None]] = {}
        self.facts: dict[str, Fact] = {}
        self.arrays: dict[object, Fact] = {}
        self.demands: dict[tuple[str, int], Demand] = {}
        self.positions: dict[tuple[str, int | None, str], Position] = {}
        self.attr_positions: dict[tuple[str, str], tuple[int, int, int]] = {}
        #: Reshapes that keep rows part batch, part shared: node -> the row shape after them.
        self.row_shapes: dict[str, tuple[int, ...]] = {}
        #: Gradient ``Pad`` ops of slices of such rows: node -> the forward ``Slice``.
        self.slice_pads: dict[str, str] = {}
        #: Gathers of a batch's rows by row numbers fed in a batch input of the same class
        #: (``tf.gather_nd(q, idx)``, ``idx`` fed ``[[0, a0], [1, a1], ...]``): node -> (class,
        #: the fed tensor, "column" when its first column holds the numbers or "whole").
        #: Each tower reads them less its first row's number, checked (``passes/_rows.py``).
        self.fed_rows: dict[str, tuple[int, str, str]] = {}
        #: In a function body: its arguments that carry a batch input as the driver feeds it
        #: (through identities and casts): argument -> that input (``name:index`` each).
        self.fed_args: dict[str, str] = {}
        self.changed = False

    # ------------------------------------------------------------------ reading
    def fed(self, ref: str) -> str | None:
        """The batch input, or the function argument carrying one, that ``ref`` is as fed
        (behind identities and casts), else None."""
        tensor = table.behind(self.ir, ref, FED_PATH)
        return tensor if tensor in self.inputs else self.fed_args.get(tensor)

    def fact(self, ref: str) -> Fact | None:
        """The fact of tensor ``ref`` (None while unknown, inside a loop not yet reached)."""
        key = tensor_name(*parse_tensor(ref))
        found = self.facts.get(key)
        if found is not None:
            return found
        if key in self.seeds:
            return self.seeds[key]
        if key in self.inputs:
            axis, cls = self.inputs[key]
            if key in self.sparse:
                return self.sparse_source(self, key, cls)
            from replicate.batchflow.lattice import part

            return part(axis, cls)
        name = node_of(ref)
        if name in self.ir.nodes and name not in self.region_names:
            return shared(self.int_value(key))
        return None

    region_names: frozenset = frozenset()
    #: Batch inputs fed as a SparseTensor: tensor -> ``indices``, ``values`` or ``shape``.
    sparse: dict = {}

    def shape(self, ref: str) -> list[int | None] | None:
        """The static shape TensorFlow inferred for ``ref`` in the single-device graph, with
        what the dataflow learned where inference gave up (a reduction over axes it computed)."""
        for _ in range(16):
            found = self.refined.get(tensor_name(*parse_tensor(ref)))
            if found is not None:
                return found
            shape = self.ir.static_shape(ref)
            node = self.ir.nodes.get(node_of(ref))
            if shape is not None or node is None or not node.inputs or parse_tensor(ref)[1] \
                    or node.op in ("IdentityN", "PlaceholderWithDefault") or not (
                    node.op in table.UNARY or node.op in table.PASS_THROUGH):
                return shape
            ref = node.inputs[0]        # an op of one operand keeps its shape
        return None

    def dim_token(self, ref: str, index: int) -> str:
        """A name for unknown dimension ``index`` of ``ref``, the same for two dimensions only
        when they are proved equal at run time (:mod:`replicate.batchflow.dims`)."""
        from replicate.batchflow import dims

        return dims.token(self, ref, index)

    def shape_dimension(self, ref: str) -> tuple[str, int] | None:
        """``(t, k)`` when scalar ``ref`` is ``tf.shape(t)[k]`` (through casts), else None."""
        node = self.ir.nodes.get(node_of(ref))
        while node is not None and node.op in ("Cast", "Identity") and node.inputs:
            node = self.ir.nodes.get(node_of(node.inputs[0]))
        if node is None or node.op != "StridedSlice" or len(node.inputs) < 4 \
                or int(node.attr("shrink_axis_mask", 0)) != 1:
            return None
        shape, begin = self.ir.nodes.get(node_of(node.inputs[0])), self.const(node.inputs[1])
        if shape is None or shape.op != "Shape" or begin is None or begin.size != 1 \
                or int(begin.reshape(-1)[0]) < 0:
            return None
        return shape.inputs[0], int(begin.reshape(-1)[0])

    def named_shape(self, ref: str, skip: int | None = None) -> list | None:
        """The static shape of ``ref`` with unknown dimensions named (see :meth:`dim_token`),
        except dimension ``skip`` (the batch axis), which stays None."""
        shape = self.shape(ref)
        if shape is None:
            return None
        return [d if d is not None or i == skip else self.dim_token(ref, i) for i, d in enumerate(shape)]

    def refine(self, ref: str, shape: list[int | None]) -> None:
        """Record a sharper static shape of ``ref`` than inference found."""
        old = self.ir.static_shape(ref)
        if old is None or (len(old) == len(shape) and any(o is None and s is not None
                                                          for o, s in zip(old, shape))):
            merged = shape if old is None else [o if o is not None else s for o, s in zip(old, shape)]
            self.refined[tensor_name(*parse_tensor(ref))] = merged

    def rank(self, ref: str) -> int | None:
        shape = self.shape(ref)
        return None if shape is None else len(shape)

    def const(self, ref: str) -> np.ndarray | None:
        """The value of ``ref`` if a Const produces it (looking through identities)."""
        for _ in range(8):
            node = self.ir.nodes.get(node_of(ref))
            if node is None:
                return None
            if node.op == "Const":
                return node.attr("value")
            if node.op not in ("Identity", "Snapshot") or not node.inputs:
                return None
            ref = node.inputs[0]
        return None

    def int_value(self, ref: str) -> tuple | None:
        """Symbolic integer elements of ``ref``: from its fact, else from a small Const."""
        key = tensor_name(*parse_tensor(ref))
        found = self.facts.get(key)
        if found is None and key in self.sparse and key in self.inputs:
            found = self.fact(key)          # a sparse input's dense shape: the batch size first
        if found is not None and found.value is not None:
            return found.value
        value = self.const(ref)
        if value is None or value.dtype.kind not in "iu" or value.size > 64 or value.ndim > 1:
            return None
        return tuple(int(v) for v in np.atleast_1d(value).tolist())

    def axes(self, ref: str, rank: int | None) -> list[int] | None:
        """Normalized axes held by integer tensor ``ref`` (None when not static)."""
        values = self.int_value(ref)
        if values is None or any(not isinstance(v, int) for v in values):
            return None
        if rank is None:
            return None if any(v < 0 for v in values) else sorted(set(values))
        return sorted({v + rank if v < 0 else v for v in values})

    def n_outputs(self, node: Node) -> int:
        return max(1, len(self.ir.output_types(node)))

    def in_gradient(self, node: Node) -> bool:
        return self.all_gradient or node.name in self.gradient

    def static_batch(self, cls: int) -> int | None:
        return self.classes.static(cls)

    def batch_dim(self, fact: Fact) -> int | None:
        """The static size of a partitioned fact's axis (examples times rows per example)."""
        size = self.static_batch(fact.cls)
        if size is None or not isinstance(fact.block, int) or not isinstance(fact.outer, int):
            return None
        return size * fact.block * fact.outer

    # ------------------------------------------------------------------ recording
    def demand(self, ref: str, dim: int, like: Fact, by: Node) -> None:
        """Shared tensor ``ref``'s dimension ``dim`` must be tower-sized, laid out like the
        partitioned fact ``like``."""
        key = (tensor_name(*parse_tensor(ref)), dim)
        shape = self.shape(ref)
        rows = like.block * like.outer if isinstance(like.block, int) and isinstance(like.outer, int) else None
        if shape is not None and dim < len(shape) and shape[dim] and rows and \
                shape[dim] % rows == 0 and self.static_batch(like.cls) is None:
            self.classes.pin(like.cls, shape[dim] // rows, by.name)   # a shared tensor fixes the size
        if key not in self.demands:
            self.demands[key] = Demand(key[0], dim, like.cls, like.block, like.outer, by.name)

    def position(self, ref: str, element: int | None, cls: int, factor: int | None, by: Node) -> None:
        """Element ``element`` of integer tensor ``ref`` holds ``factor`` times the batch size."""
        value = self.int_value(ref)
        if value is not None:
            idx = 0 if element is None else element
            if idx < len(value) and isinstance(value[idx], Sym):
                return          # computed from the batch at run time: right in every tower
            if idx < len(value) and value[idx] == -1:
                return          # inferred by the op
            if idx < len(value) and isinstance(value[idx], int) and factor and value[idx] > 0 \
                    and value[idx] % factor == 0 and self.static_batch(cls) is None:
                self.classes.pin(cls, value[idx] // factor, by.name)
        key = (tensor_name(*parse_tensor(ref)), element, by.name)
        if key not in self.positions:
            self.positions[key] = Position(key[0], element, cls, factor if factor else 0, by.name, by.name)

    def attr_position(self, node: Node, attr: str, dim: int, cls: int, factor: int) -> None:
        """Dimension ``dim`` of shape attribute ``attr`` of ``node`` is the batch size."""
        self.attr_positions.setdefault((node.name, attr), (dim, cls, factor))

    def unknown_rank(self, node: Node) -> str:
        """Why ``node``'s layout is unknown: the input without a static rank it reads from, and
        what to do about it."""
        for name in self._shapeless_sources(node.inputs):
            if self.ir.nodes[name].op == "Placeholder" and f"{name}:0" in self.seeds:
                self.shapeless_args.add(f"{name}:0")
                return (f"{node.op} of a tensor of unknown rank: the function's argument '{name}' "
                        "has none (the caller passes it a tensor without a static shape, such "
                        "as a placeholder declared without one: give that its shape)")
            self.shapeless.add(name)
            return (f"{node.op} of a tensor of unknown rank: input '{name}' has no static "
                    "shape (give the placeholder its shape: shape=[] for a scalar, "
                    "shape=[None] for a value per example)")
        return f"{node.op} of a tensor of unknown rank"

    def trace_shapeless(self, ref: str) -> None:
        """A function argument without a rank left a layout unknown: record the placeholders
        without a static shape that tensor ``ref`` passed to it comes from."""
        self.shapeless.update(self._shapeless_sources([ref]))

    def _shapeless_sources(self, refs: list[str]):
        """The placeholders (or function arguments) without a static rank that tensors ``refs``
        come from through producers without one, nearest first."""
        work, seen = list(refs), set()
        while work and len(seen) < 200:
            ref = work.pop()
            name = node_of(ref)
            if name in seen or name not in self.ir.nodes or self.rank(ref) is not None:
                continue
            seen.add(name)
            producer = self.ir.nodes[name]
            if producer.op in ("Placeholder", "PlaceholderWithDefault"):
                yield name
            else:
                work.extend(producer.inputs)

    def refuse(self, node: str, what: str, fix: str) -> None:
        """No split of the batch can run ``node``: the transform refuses, saying why."""
        self.refusals[node] = (what, fix)

    def note(self, node: str, what: str) -> None:
        """An obligation that cannot be met where it arises (inside a function body, shared by
        every tower): it becomes a reason."""
        if (node, what) not in self.notes:
            self.notes.append((node, what))

    def no_rule(self, node: Node, facts: list[Fact]) -> Fact:
        """The default for an op with no batch rule: shared if its inputs are, else mixed."""
        taint = frozenset().union(*(f.taint for f in facts)) if facts else frozenset()
        if all(not f.dependent for f in facts):
            return shared(taint=taint)
        first = next((f for f in facts if f.kind == "mixed"), None)
        if first is not None:
            return first.with_(taint=taint, handle=None)
        return mixed(node.name, f"no batch rule for {node.op}", taint)
