"""Checking a rewrite by running it: the numeric certificate (``certificate``), the engine of
``replicate verify`` (``verify``), one device against towers (``equivalence``) and synthetic
inputs (``synthetic``)."""
