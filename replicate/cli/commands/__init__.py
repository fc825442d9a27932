"""Subcommands of the ``replicate`` CLI.

Each module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``;
its docstring is the subcommand's ``--help`` description. ``replicate.cli`` lists them.
"""
