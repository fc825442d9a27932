"""Pictures of replicated graphs: collapse to name scopes (networkx), draw with Graphviz.

- :mod:`replicate.viz.groups`: which part (tower, split, aggregation, variables, update...)
  each node belongs to.
- :mod:`replicate.viz.collapse`: the graph of boxes (one per name scope, within a budget)
  and of edges counting the tensors between them; :mod:`replicate.viz.strays` moves the
  ops of leftover boxes into their neighbours' boxes.
- :mod:`replicate.viz.render`: DOT text, and SVG or PNG through Graphviz's ``dot``;
  :mod:`replicate.viz.layout` (bundled edges, towers in order) and
  :mod:`replicate.viz.style` (colours per device) help it.
"""

from replicate.viz.collapse import DEFAULT_MAX_NODES, Partition, collapse, partition
from replicate.viz.groups import Group, Roles, assign, roles_from_analysis, roles_from_ops
from replicate.viz.render import FORMATS, check_dot, dot_source, render

__all__ = ["collapse", "partition", "Partition", "DEFAULT_MAX_NODES", "Group", "Roles", "assign",
           "roles_from_analysis", "roles_from_ops", "FORMATS", "check_dot", "dot_source", "render"]
