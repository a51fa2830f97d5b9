"""Measuring knobs: launch choices fixed for a benchmark, a probe or a sanitizer run (results
never depend on them; engines never set them). Each is a context manager that sets a value in
its family's ``FIXED`` table (data the family reads when it plans a launch) and restores it.

    with knobs.resolve_cluster(4):      # the single-step resolve: 4 blocks per batch row
        swap_in(...)
    with knobs.copy_blocks(0):          # the multi-step commit: no copy blocks
        multistep_swap_in(...)
    with knobs.pdl(False):              # calls with pdl=None launch plainly
        ...

Launches already planned (a :class:`~hisparse_cupy.Step`'s, a captured graph) keep theirs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .. import _checks
from .._kernels import launch, multistep, swap

__all__ = ["copy_blocks", "pdl", "resolve_cluster"]


@contextlib.contextmanager
def _fixed(table: dict, key: str, value) -> Iterator[None]:
    before = table[key]
    table[key] = value
    try:
        yield
    finally:
        table[key] = before


def resolve_cluster(blocks: int | None):
    """The single-step resolve's blocks per batch row: 1, 2, 4 or 8 (sm_90+ for more than 1),
    or None (:func:`hisparse_cupy._kernels.swap.resolve_cluster` chooses)."""
    return _fixed(swap.FIXED, "cluster", swap.cluster_arg(blocks))


def copy_blocks(blocks: int | None):
    """The multi-step commit's copy blocks per batch row (0 .. 64), or None
    (:func:`hisparse_cupy._kernels.multistep.copy_blocks` chooses)."""
    if blocks is not None:
        blocks = _checks.integer("copy_blocks", blocks, 0, 64)
    return _fixed(multistep.FIXED, "copy_blocks", blocks)


def pdl(enabled: bool):
    """What a call's ``pdl=None`` means on a device that has PDL (sm_90+): launch the dependent
    kernels with Programmatic Dependent Launch, or plainly (the process default comes from
    ``HISPARSE_CUPY_PDL``)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    return _fixed(launch.FIXED, "pdl", enabled)
