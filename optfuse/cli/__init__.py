"""The ``optfuse`` command line (typer): the top layer. Commands parse their arguments, call one
:mod:`optfuse.pipeline` flow and print; nothing below imports this package.

- :mod:`.app`: the app, the root options, :func:`main`;
- :mod:`.ui`: console, progress display, warnings, JSON output and the error guard (public helpers
  for every command module);
- :mod:`.args`: the options several commands share (shapes, precision, tolerances, input and
  output files, ``--json``) and their parsing;
- :mod:`.fuse` (fuse, inspect, verify, demo), :mod:`.build` (build, convert), :mod:`.recipe`
  (recipe check, recipe init), :mod:`.kernels` (kernels build, list): the commands;
- :mod:`.show`: the console tables.
"""

from .app import app, main

__all__ = ["app", "main"]
