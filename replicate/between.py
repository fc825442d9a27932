"""The public name of between-graph replication at run time (:mod:`replicate.runtime.between`).

``replicate.between.for_task``, ``server_config`` and ``import_meta_graph`` are imported from
here by worker scripts; the code lives with the rest of the distributed runtime.
"""

from replicate.runtime.between import *  # noqa: F401,F403 - the public names
from replicate.runtime.between import __all__  # noqa: F401
