"""Named dimensions: which unknown dimensions of a graph are equal at run time.

Requires: the IR with its static shapes, and the facts computed so far (a transpose's
permutation, a concat's axis are read from them).

Produces: for an unknown dimension ``k`` of tensor ``t``, the tensor and dimension it was
copied from, followed back as far as a proof reaches. Two dimensions with the same source are
equal whatever the feeds; the reshape rules use that to see that ``tf.reshape(y, [-1,
tf.shape(words)[1], C])`` undoes the fold of ``y``'s batch and time axes (a padded tagger whose
time axis is fed as ``None``).

Each step back is a fact about an op's output shape that TensorFlow's kernel guarantees:

- identities, elementwise ops of one input, loop and cond plumbing keep their input's shape;
- a reshape to a packed target takes dimension ``k`` from the target's element ``k``, when that
  element reads ``tf.shape(t)[j]``; a transpose moves dimensions by its permutation;
- a concat keeps every dimension but its axis, which all its inputs share; a stack inserts one;
- a gather's leading dimensions are its indices'; the rest are its parameters' rows';
- a matmul's rows are its first operand's, its columns its second's;
- ``Fill`` and the random ops take dimension ``k`` from element ``k`` of their shape operand;
- ops that broadcast: the dimension of the only operand where it is not 1, or of every such
  operand when all of them are named alike (an unknown dimension may be 1 at run time; two
  different unknowns prove nothing);
- ``TensorListStack``'s leading dimension is the list's length: the ``num_elements`` of the
  ``TensorListReserve`` that made it, or the rows of the tensor it was made from, through
  loops whose body only sets items of it (``dynamic_rnn``'s outputs); with TF1 loops, a
  ``TensorArray``'s gather of ``range(size)`` has the size it was made with, unless it was
  made ``dynamic_size``.

Where no step is proved, the dimension is named after the tensor that has it, which equals
no other name: a missing step costs precision, never soundness.
"""

from __future__ import annotations

from replicate.batchflow import table
from replicate.batchflow.table import IDENTITIES, behind
from replicate.graph.ir import node_of, parse_tensor, tensor_name

__all__ = ["source", "token"]

#: Ops whose output has their first input's shape, besides the elementwise ones of one input.
_SAME_AS_FIRST = frozenset({"BiasAdd", "BiasAddV1", "ReverseSequence", "ReverseV2", "Softmax",
                            "LogSoftmax", "Enter", "Exit", "Identity", "Switch", "RefEnter",
                            "RefExit", "RefSwitch"})

#: Ops whose output has its own dimensions (a default value fed over; the branch a Merge takes).
_OWN = frozenset({"PlaceholderWithDefault", "Merge", "RefMerge"})

_LOOPS = frozenset({"While", "StatelessWhile"})

#: Where a TF1 TensorArray's handle passes unchanged (into and out of a TF1 loop).
_HANDLE_PATH = frozenset({"Identity", "Enter", "RefEnter", "Exit", "RefExit"})

_MAX_STEPS = 48


def token(ctx, ref: str, index: int) -> str:
    """The name of dimension ``index`` of ``ref``: equal for two dimensions only when the
    same run-time value is proved for both."""
    found, k = source(ctx, ref, index)
    return f"{found}#{k}"


def source(ctx, ref: str, index: int) -> tuple[str, int]:
    """``(tensor, dimension)`` that dimension ``index`` of ``ref`` is a copy of."""
    memo = ctx.dim_sources
    start = (tensor_name(*parse_tensor(ref)), index)
    if start in memo:
        return memo[start]
    memo[start] = start                 # a cycle through a loop proves nothing
    at = start
    for _ in range(_MAX_STEPS):
        step = _back(ctx, *at)
        if step is None:
            break
        at = (tensor_name(*parse_tensor(step[0])), step[1])
        if at in memo and memo[at] != at:
            at = memo[at]
            break
    memo[start] = at
    return at


def _back(ctx, ref: str, index: int) -> tuple[str, int] | None:
    """One proved step back from dimension ``index`` of ``ref``, or None."""
    node = ctx.ir.nodes.get(node_of(ref))
    if node is None or not node.inputs or node.op in _OWN:
        return None
    op, out = node.op, parse_tensor(ref)[1]
    if op == "IdentityN":
        return (node.inputs[out], index) if out < len(node.inputs) else None
    if op in table.UNARY or op in table.PASS_THROUGH or op in _SAME_AS_FIRST:
        return node.inputs[0], index
    if op == "Select":
        return (node.inputs[1], index) if len(node.inputs) > 1 else None
    if op == "Reshape" and len(node.inputs) > 1:
        return _reshape(ctx, node, index)
    if op == "Transpose" and len(node.inputs) > 1:
        perm = ctx.int_value(node.inputs[1])
        if perm is None or index >= len(perm) or not _is_int(perm[index]):
            return None
        return node.inputs[0], int(perm[index])
    if op in ("ConcatV2", "Concat"):
        return _concat(ctx, node, index)
    if op == "Pack":
        axis, rank = int(node.attr("axis", 0)), ctx.rank(ref)
        if axis < 0:
            if rank is None:
                return None
            axis += rank
        return None if index == axis else (node.inputs[0], index - (index > axis))
    if op in ("GatherV2", "ResourceGather", "Gather"):
        return _gather(ctx, node, index)
    if op == "MatMul" and len(node.inputs) == 2:
        if index == 0:
            return node.inputs[0], 1 if node.attr("transpose_a", False) else 0
        return node.inputs[1], 0 if node.attr("transpose_b", False) else 1
    if op in table.SHAPE_SOURCES:
        return _shaped_by(ctx, node.inputs[table.SHAPE_SOURCES[op]], index)
    if op in table.BROADCAST or op in table.SAME_SHAPE:
        return _broadcast(ctx, ref, node, index)
    if op == "TensorListStack" and index == 0:
        return _list_length(ctx, node.inputs[0])
    if op == "TensorArrayGatherV3" and index == 0:
        return node.inputs[1], 0
    if op == "Range" and index == 0 and len(node.inputs) == 3 \
            and ctx.int_value(node.inputs[0]) == (0,) and ctx.int_value(node.inputs[2]) == (1,):
        return _length(ctx, node.inputs[1])
    return None


def _length(ctx, scalar: str):
    """The dimension scalar ``scalar`` holds: ``tf.shape(t)[k]``, or the size of a TF1
    ``TensorArray`` made with that size (not ``dynamic_size``: a write past it fails)."""
    read = ctx.shape_dimension(scalar)
    if read is not None:
        return read
    node = ctx.ir.nodes.get(node_of(behind(ctx.ir, scalar, IDENTITIES)))
    if node is None or node.op != "TensorArraySizeV3" or not node.inputs:
        return None
    made = ctx.ir.nodes.get(node_of(behind(ctx.ir, node.inputs[0], _HANDLE_PATH)))
    if made is None or made.op != "TensorArrayV3" or made.attr("dynamic_size", False):
        return None
    return ctx.shape_dimension(made.inputs[0])


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _reshape(ctx, node, index: int):
    target = ctx.ir.nodes.get(node_of(node.inputs[1]))
    if target is not None and target.op == "Pack" and index < len(target.inputs):
        return ctx.shape_dimension(target.inputs[index])
    return None


def _concat(ctx, node, index: int):
    axis_ref, values = ((node.inputs[-1], node.inputs[:-1]) if node.op == "ConcatV2"
                        else (node.inputs[0], node.inputs[1:]))
    axis = ctx.int_value(axis_ref)
    rank = ctx.rank(f"{node.name}:0")
    if axis is None or len(axis) != 1 or not _is_int(axis[0]) or rank is None or not values:
        return None
    if index == axis[0] % rank:
        return None
    return values[0], index


def _gather(ctx, node, index: int):
    if int(node.attr("batch_dims", 0)) != 0:
        return None
    if node.op == "GatherV2":
        axis = ctx.int_value(node.inputs[2]) if len(node.inputs) > 2 else None
        if axis != (0,):
            return None
    rank = ctx.rank(node.inputs[1])
    if rank is None:
        return None
    if index < rank:
        return node.inputs[1], index
    return node.inputs[0], index - rank + 1


def _shaped_by(ctx, shape_ref: str, index: int):
    """Dimension ``index`` of a tensor made to the shape held by vector ``shape_ref``."""
    producer = ctx.ir.nodes.get(node_of(behind(ctx.ir, shape_ref, IDENTITIES)))
    if producer is None:
        return None
    if producer.op == "Shape" and producer.inputs:
        return producer.inputs[0], index
    if producer.op == "Pack" and index < len(producer.inputs):
        return ctx.shape_dimension(producer.inputs[index])
    return None


def _broadcast(ctx, ref: str, node, index: int):
    """The dimension of the operands that decide it, when they are proved to agree."""
    rank = ctx.rank(ref)
    if rank is None:
        return None
    found = None
    for operand in node.inputs:
        shape = ctx.shape(operand)
        if shape is None:
            return None
        k = index - (rank - len(shape))
        if k < 0 or shape[k] == 1:
            continue                    # broadcast: this operand does not decide it
        if shape[k] is not None:
            return None                 # a static size: the dimension is known, not named
        mine = source(ctx, operand, k)
        if found is not None and found != mine:
            return None
        found = mine
    return found


def _list_length(ctx, handle: str):
    """Where the length of TensorList ``handle`` comes from."""
    for _ in range(16):
        handle = behind(ctx.ir, handle, IDENTITIES)
        name, k = parse_tensor(handle)
        node = ctx.ir.nodes.get(name)
        if node is None:
            return None
        if node.op == "TensorListReserve" and len(node.inputs) > 1:
            return _length(ctx, node.inputs[1])
        if node.op == "TensorListFromTensor":
            return node.inputs[0], 0
        if node.op not in _LOOPS or k >= len(node.inputs) or not _keeps_length(ctx, node, k):
            return None
        handle = node.inputs[k]
    return None


def _keeps_length(ctx, node, k: int) -> bool:
    """Loop variable ``k`` of While ``node`` leaves each iteration as long as it came (its
    body only sets items of it)."""
    found = ctx.body(ctx, node.attr("body"), node.inputs) if ctx.body is not None else None
    if found is None:
        return False
    body, args, outs = found
    if k >= len(args) or k >= len(outs):
        return False
    ref = outs[k]
    for _ in range(64):
        ref = behind(body, ref, IDENTITIES)
        if tensor_name(*parse_tensor(ref)) == tensor_name(*parse_tensor(args[k])):
            return True
        item = body.nodes.get(node_of(ref))
        if item is None or item.op != "TensorListSetItem" \
                or item.attr("resize_if_index_out_of_bounds", False):
            return False
        ref = item.inputs[0]
    return False
