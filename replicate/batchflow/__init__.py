"""The batch dataflow: which axis of every tensor carries the examples, and what that means
for splitting a training step across towers.

Facts (:mod:`~replicate.batchflow.lattice`) flow from the batch inputs through every op by
rules (:mod:`~replicate.batchflow.rules`, driven by the op tables in
:mod:`~replicate.batchflow.table`) to a fixpoint (:mod:`~replicate.batchflow.solver`).
"""
