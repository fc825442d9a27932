"""Rules for ops that move spatial blocks through the batch axis or crop boxes out of images:
``SpaceToBatchND``/``BatchToSpaceND`` (atrous convolution, DeepLab), their fixed-rank forms,
and ``CropAndResize`` with its gradients.

``SpaceToBatchND`` with ``k = prod(block_shape)`` lays ``k`` copies of the batch one after the
other (output row ``j * B + b`` is block ``j`` of example ``b``): each tower's rows of every
copy are its own examples' blocks, so the result is partitioned with ``k`` times the input's
``outer``. ``BatchToSpaceND`` undoes it. Block shapes and paddings that depend on the batch mix.

``CropAndResize(image, boxes, box_ind, crop_size)`` crops box ``i`` out of image
``box_ind[i]``. With ``box_ind`` the tower's own row numbers of the images (``tf.range`` over
the batch, repeated per box) and the boxes of the same batch, each crop reads its own example.
"""

from __future__ import annotations

import math

from replicate.batchflow.context import Context
from replicate.batchflow.lattice import PART, Fact
from replicate.batchflow.rules.common import couple, first_mixed, mixed, part, rows, shared
from replicate.graph.ir import Node

__all__ = ["space_to_batch", "batch_to_space", "crop_and_resize", "crop_gradient"]


def _blocks(ctx: Context, node: Node) -> int | None:
    """``k``: how many blocks each example becomes (None when not a constant)."""
    if node.op in ("SpaceToBatch", "BatchToSpace"):
        size = node.attr("block_size", None)
        return int(size) ** 2 if size is not None else None
    value = ctx.const(node.inputs[1])
    return int(math.prod(int(v) for v in value.ravel())) if value is not None else None


def _moved(ctx: Context, node: Node, ins: list[Fact], to_batch: bool) -> list[Fact]:
    taint = couple(ctx, node, ins)
    bad = first_mixed(ins)
    if bad is not None:
        return [bad]
    data, rest = ins[0], ins[1:]
    if any(f.dependent for f in rest):
        return [mixed(node.name, f"{node.op} with batch-dependent blocks or paddings", taint)]
    if data.kind != PART:
        return [shared(taint=taint)] if not data.dependent else [data.with_(taint=taint)]
    k = _blocks(ctx, node)
    if data.axis != 0 or k is None or data.outer is None:
        return [mixed(node.name, f"{node.op} of the examples along a moved axis", taint)]
    if to_batch:
        return [data.with_(outer=data.outer * k, value=None, index=None, taint=taint)]
    if data.outer % k:
        if data.outer == 1:
            # k examples make one (a mosaic): each tower needs a multiple of k to run at all
            # (review 31: 8 examples over 3 towers failed in the kernel)
            ctx.classes.granule(data.cls, k, node.name)
        return [mixed(node.name, f"{node.op} of rows that are not {k} copies of the batch", taint)]
    return [data.with_(outer=data.outer // k, value=None, index=None, taint=taint)]


def space_to_batch(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    return _moved(ctx, node, ins, True)


def batch_to_space(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    return _moved(ctx, node, ins, False)


def _own_rows(ctx: Context, index: Fact, image: Fact) -> bool:
    """``index`` holds the tower's own row numbers of ``image``'s examples."""
    tag = index.index if index.kind == PART else None
    return (tag is not None and tag[0] == "rows" and image.kind == PART and image.axis == 0
            and image.outer == 1 and rows(image) == 1 and ctx.classes.same(tag[1], image.cls))


def _crops(ctx: Context, node: Node, image: Fact, boxes: Fact, index: Fact, others: list[Fact],
           taint: frozenset) -> Fact:
    """The fact of per-box results of images ``image`` cropped by ``boxes`` from ``index``."""
    if any(f.dependent for f in others):
        return mixed(node.name, f"{node.op} with a batch-dependent crop size", taint)
    if image.kind != PART and not index.dependent and not image.dependent:
        return boxes.with_(value=None, index=None, taint=taint) if boxes.kind == PART else shared(taint=taint)
    if _own_rows(ctx, index, image) and boxes.kind == PART and boxes.axis == 0 \
            and ctx.classes.same(boxes.cls, index.cls) and rows(boxes) == rows(index):
        return boxes.with_(value=None, index=None, filtered=boxes.filtered or index.filtered, taint=taint)
    return mixed(node.name, f"{node.op} crops boxes out of images by batch-dependent image "
                 "numbers that are not each box's own example", taint)


def crop_and_resize(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``CropAndResize(image, boxes, box_ind, crop_size)`` -> one crop per box. Image numbers
    fed for the whole batch name rows a tower does not hold: refused (review 31: "box_index
    outside [0, batch_size)" at step 1)."""
    bad = first_mixed(ins)
    if bad is not None:
        return [bad]
    fed = ctx.fed(node.inputs[2])
    if fed is not None and ins[0].kind == PART and not ctx.in_gradient(node):
        ctx.refuse(node.name, f"{node.op} crops images numbered by '{fed}', fed for the whole "
                   "batch: each tower holds other images than those numbers name",
                   "compute the image numbers in the graph (tf.range over the batch), or train "
                   "this graph on one device")
        return [mixed(node.name, f"{node.op} by image numbers fed for the whole batch", couple(ctx, node, ins))]
    return [_crops(ctx, node, ins[0], ins[1], ins[2], ins[3:], couple(ctx, node, ins))]


def crop_gradient(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``CropAndResizeGradImage(grads, boxes, box_ind, image_size)`` -> the images' gradient,
    each box's added to its own example's image; ``CropAndResizeGradBoxes(grads, image,
    boxes, box_ind)`` -> one row per box."""
    bad = first_mixed(ins)
    if bad is not None:
        return [bad]
    taint = couple(ctx, node, ins)
    if node.op == "CropAndResizeGradBoxes":
        grads, image, boxes, index = ins[:4]
        return [_crops(ctx, node, image, boxes, index, [grads] if grads.kind != PART else [], taint)]
    grads, boxes, index, size = ins[:4]
    value = size.value or ctx.int_value(node.inputs[3])
    count = value[0] if value else None
    tag = index.index if index.kind == PART else None
    if tag is None or tag[0] != "rows" or getattr(count, "coef", None) != 1 \
            or not ctx.classes.same(count.cls, tag[1]):
        return [mixed(node.name, f"{node.op} into images whose count is not the batch's", taint)]
    crops = _crops(ctx, node, part(0, tag[1], 1), boxes, index, [], taint)
    return [crops if crops.kind != PART else part(0, tag[1], 1, taint=taint)]
