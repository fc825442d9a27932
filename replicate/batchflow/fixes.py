"""What to do about a reason: advice by a fragment of the reason, or by the library code
(RaggedTensor, the dense CTC loss) whose op gave it. Tables, read by the loss decomposition
and the refusals."""

from __future__ import annotations

__all__ = ["FIXES", "RAGGED_FIX", "LIBRARY_FIXES", "fix_for", "library_fix", "ragged"]

#: What to do about a loss that mixes examples, by a fragment of the mixing op's reason
#: (first match wins); the last entry is the general advice.
FIXES = (
    ("dense width of a sparse result",
     "give the sparse tensor a fixed width before making it dense: tf.SparseTensor(sp.indices, "
     "sp.values, [tf.shape(x, out_type=tf.int64)[0], MAX_LEN]), or keep it sparse "
     "(tf.nn.safe_embedding_lookup_sparse)"),
    ("adds shared rows to the batch",
     "replicate follows shared rows only after the batch's rows, as nce_loss and "
     "sampled_softmax_loss append the sampled classes to the labels: put the batch first"),
    ("part batch, part shared",
     "replicate follows rows that are part batch, part shared only through gathers, "
     "elementwise ops and the slices that take the batch rows and the shared rows apart "
     "(as nce_loss and sampled_softmax_loss do): slice them apart before any other op"),
    ("the batch size used as a value",
     "divide the summed loss by the batch size (reduce_sum(loss) / B) instead of each example, "
     "or feed the global batch size as a placeholder"),
    ("decided by the batch size",
     "bound the loop or decide the branch by a constant or a fed value, not tf.shape(x)[0]"),
    ("with the batch size as its value",
     "divide the summed loss by the batch size instead, or feed the global batch size"),
    ("also draws from with no order between them",
     "draw from seeded tf.random ops (tf.random.normal(..., seed=...)), or from one "
     "tf.random.Generator per draw"),
    ("drawn from once per step only",
     "draw from seeded tf.random ops (tf.random.normal(..., seed=...)), or from one "
     "tf.random.Generator per draw"),
    ("a loop over the batch's examples draws",
     "draw the noise for the whole batch before tf.map_fn (one tf.nn.dropout on the stacked "
     "result), or train this graph on one device"),
    ("carries a value from one example to the next",
     "if the loop is over time steps of a time-major input ([T, B, ...]), name its batch axis: "
     "batch_inputs={'x:0': 1} (--batch-inputs x:0@1); else keep each example's computation to "
     "itself (tf.map_fn, not tf.scan over the batch), or train this graph on one device"),
    ("puts values of the whole batch into its results",
     "compute what the examples share (a batch mean, the batch size) outside the loop and "
     "feed it as a constant, or train this graph on one device"),
    ("two different orders",
     "keep the examples in the order they are fed (regroup both sides alike), or train this "
     "graph on one device"),
    ("by row numbers local to each tower",
     "number the rows from the batch's own size (tf.range(tf.shape(x)[0]) with a dynamic batch "
     "dimension, [None, ...]), which each tower then counts from its own first example, or "
     "train this graph on one device"),
    ("", "compute the loss per example and reduce it with a mean or sum over the batch, or "
         "train this graph on one device"),
)


#: The advice for a RaggedTensor's row ops (their ``Range`` over the row count and segment
#: ids are not followed across towers): the padded tensor under its mask is per example.
RAGGED_FIX = ("keep the padded [batch, T, ...] tensor h with its mask m = tf.sequence_mask(lengths, "
              "T) (m[:, :, None] beside a [batch, T, D] tensor) and reduce under the mask, so "
              "each example keeps its own rows: tf.reduce_max(tf.where(m, h, tf.fill(tf.shape(h), "
              "-1e9)), axis=1), tf.reduce_sum(h * tf.cast(m, h.dtype), 1), divided by "
              "tf.reduce_sum(tf.cast(m, h.dtype), 1) for a mean; or train this graph on one device")


#: Library code whose ops the user never wrote, by the name scope it builds them in: the
#: advice names the user's call instead of an op inside it.
LIBRARY_FIXES = (
    ("Ragged", RAGGED_FIX),
    ("ctc_loss_dense",
     "tf.nn.ctc_loss with dense labels flattens the batch and numbers its rows; pass the labels "
     "as a tf.SparseTensor (its indices name each label's example), which replicate follows "
     "example by example"),
)


def library_fix(name: str) -> str | None:
    """The advice for an op inside library code (``RaggedReduceMax/RaggedSplitsToSegmentIds/
    range``, ``ctc_loss_dense/While_1``), else None."""
    scopes = name.split("/")[:-1]
    return next((fix for scope, fix in LIBRARY_FIXES if any(s.startswith(scope) for s in scopes)),
                None)


def ragged(name: str) -> bool:
    """Whether ``name`` is inside RaggedTensor code."""
    return library_fix(name) is RAGGED_FIX


def fix_for(why: str, name: str = "") -> str:
    """The advice for a reason ``why`` given at op ``name``."""
    return library_fix(name) or next(fix for fragment, fix in FIXES if fragment in why)
