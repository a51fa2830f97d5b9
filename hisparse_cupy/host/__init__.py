"""The host tier: the pinned, device-mapped pool that holds every token's KV.

- :mod:`.pool`: :class:`HostKVPool` (``[n_layers, n_rows, row_bytes]``: allocated, attached to
  a shared segment, or registered in place);
- :mod:`.shm`: shared segments (named, file-backed, huge pages) other processes attach;
- :mod:`.pages`: :class:`HostPages`, the page allocator of a paged pool (shared prefixes,
  engine-held pages), and :class:`PoolExhausted`.

Names are imported on first use: :mod:`.pages` needs NumPy only.
"""

from .._lazy import lazy

_NAMES = {"HostKVPool": "pool", "HostPages": "pages", "PoolExhausted": "pages"}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy(__name__, _NAMES)
