"""Instruments for tests, benchmarks and ``python -m hisparse_cupy check``: never on an engine's
path, and nothing on that path imports them.

- :mod:`.probe`: :func:`~.probe.copy_probe`, the planned copy's measuring instance (dry runs,
  slowed rows, counted bad rows) on chosen streams;
- :mod:`.twin`: a cache and its NumPy twin stepped together (the oracle beside the GPU);
- :mod:`.selfcheck`: every kernel against the oracle on this GPU (``check``).

The public oracle is :mod:`hisparse_cupy.reference`.
"""

__all__ = ["knobs", "probe", "selfcheck", "twin"]
