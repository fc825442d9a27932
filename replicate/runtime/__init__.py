"""The distributed runtime: clusters, servers, between-graph workers and their recovery.

Nothing here is imported by ``import replicate`` or by ``replicate.transform`` of an in-graph
rewrite; :mod:`replicate.runtime.between` is the public name of :mod:`replicate.runtime.between`."""
