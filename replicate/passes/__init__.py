"""The passes of the rewrite, in the order :mod:`replicate.rewrite` runs them, and their runner.

One module per pass (``analyze``, ``place``, ``split``, ``clone``, ``sync``, ``rebatch``,
``draw``, ``weigh``, ``aggregate``, ``rewire``, ``guard``, ``accumulate``, ``between``,
``mirror``, ``validate``), each with a class holding its configuration and a ``run(ir)``; its
docstring says which ``ir.facts`` it requires and what it produces. ``pipeline`` runs them;
private helpers are ``_*.py``. See docs/architecture.md for the picture.
"""
