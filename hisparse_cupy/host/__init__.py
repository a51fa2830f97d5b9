"""The host tier: the pinned, device-mapped pool that holds every token's KV.

- :class:`HostKVPool` (``_pool.py``): ``[n_layers, n_rows, row_bytes]``, allocated, attached
  to a shared segment (``_shm.py``: named, file-backed, huge pages; :func:`shared_pools` says
  where they go and what pages they get there) or registered in place;
- :class:`HostPages` (``_pages.py``): the page allocator of a paged pool (shared prefixes,
  engine-held pages), :class:`PoolExhausted`, and :func:`consecutive_runs` (where a list of
  pages or rows breaks into runs that lie one after the other: one copy or descriptor each).

Names are imported on first use: :class:`HostPages` needs NumPy only.
"""

from .._lazy import lazy

_NAMES = {"HostKVPool": "_pool", "HostPages": "_pages", "PoolExhausted": "_pages",
          "consecutive_runs": "_pages", "shared_pools": "_shm"}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy(__name__, _NAMES)
