"""The distributed runtime: clusters, servers, between-graph workers and their recovery.

``import replicate`` imports none of it, nor does an in-graph ``replicate.transform`` on one
machine. The compiler reads cluster descriptions through :mod:`replicate.runtime.cluster` when
given ``cluster=``, and plans and finishes a between-graph template through
:mod:`replicate.runtime.between` when given ``between_graph=True``. Worker scripts import
:mod:`replicate.between`, the public name of :mod:`replicate.runtime.between`.
"""
