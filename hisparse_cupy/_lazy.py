"""Public names of a package imported on first use (PEP 562), so importing the package needs
NumPy only and each name's module is loaded when a caller first reaches it."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable

# how to get CuPy (the package is not on PyPI: its extras install from a checkout)
INSTALL_CUPY = ("install the extra that matches your driver, hisparse_cupy[cuda12] (CUDA 12.x "
                "driver) or hisparse_cupy[cuda13] (driver >= 580): from a checkout, "
                "pip install -e '.[cuda12]' (or '.[cuda13]'); or CuPy alone, "
                "pip install cupy-cuda12x (or cupy-cuda13x)")
NEEDS_CUPY = (f"hisparse_cupy needs CuPy for its GPU API: {INSTALL_CUPY}. "
              "hisparse_cupy.reference works without it.")


def lazy(package: str, names: dict[str, str | None], extra: tuple[str, ...] = (),
         deprecated: dict[str, tuple[object, str]] | None = None) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package`` whose public ``names`` map to the submodule
    that defines each (None: the name is a submodule); ``__dir__`` lists them and ``extra``.
    ``deprecated``: old names -> ``(value, what to use instead)``, given with a warning."""

    def __getattr__(name: str):
        if deprecated and name in deprecated:
            value, instead = deprecated[name]
            warnings.warn(f"{package}.{name} is deprecated and goes in 0.3: {instead}",
                          DeprecationWarning, stacklevel=2)
            return value
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        mod = names[name]
        try:
            m = importlib.import_module(f".{mod or name}", package)
        except ImportError as e:
            if e.name == "cupy" or (e.name or "").startswith("cupy."):
                raise ImportError(NEEDS_CUPY) from e
            raise
        value = m if mod is None else getattr(m, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted([*names, *extra])

    return __getattr__, __dir__
