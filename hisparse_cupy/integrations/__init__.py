"""Models written by others decoding through the cache.

- :mod:`hisparse_cupy.integrations.transformers`: transformers' GLM-5 and DeepSeek-V3.2 (MLA
  with the DSA indexer; GLM-5's IndexCache layers), :class:`SparseMLA`. Needs ``torch`` and
  ``transformers`` (``pip install -e '.[transformers]'`` from a checkout); the package's core
  imports neither.
"""

from .._lazy import lazy

_NAMES = {"transformers": None}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy(__name__, _NAMES)
