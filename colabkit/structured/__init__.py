"""Structured low-rank matrices, measured against dense: see :mod:`colabkit.structured.matrix`."""
