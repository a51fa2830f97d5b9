"""Residency: which requests keep all their KV on the GPU while the budget allows.

- :class:`DeviceBudget` (``_budget.py``): the cache's device rows as pages, each request
  resident (a page per ``P`` tokens: every selected token has a device row), sparse (a hot
  buffer over the host pool) or promoting; admission, growth, demotion and promotion, and the
  default policy (which requests to demote for room, which to promote). NumPy only.
- :class:`Residency` (``_residency.py``): ``cache.residency``, what an engine calls to move
  requests (``demote``, ``promote``, ``make_room``, ``promote_ready``, ``switch_promoted``) and
  to ask whether a step runs lean; its ``budget`` is the scheduler's view. A cache without a
  device budget has one too: nothing is resident and every move refuses.

Names are imported on first use.
"""

from .._lazy import lazy

_NAMES = {"DeviceBudget": "_budget", "Residency": "_residency"}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy(__name__, _NAMES)
