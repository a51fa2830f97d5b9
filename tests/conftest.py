"""Test setup: GPU tests are marked ``gpu`` and skipped, with the reason shown, without a device."""

from __future__ import annotations

import pytest
from _skipfold import pytest_runtest_makereport  # noqa: F401 (-rs: a line per skip reason)


def _device_count() -> tuple[int, str]:
    """(devices, why none): the library's device check (hisparse_cupy._device), one copy."""
    from hisparse_cupy._device import cupy_or_why

    g = cupy_or_why()
    return (0, g) if isinstance(g, str) else (g.cuda.runtime.getDeviceCount(), "")


def _compute_capability() -> int:
    import cupy

    return int(cupy.cuda.Device().compute_capability)


def pytest_collection_modifyitems(config, items):
    n, why = _device_count()
    if n == 0:
        skip = pytest.mark.skip(reason=f"no CUDA device ({why})")
        for it in items:
            if "gpu" in it.keywords or "hopper" in it.keywords:
                it.add_marker(skip)
        return
    if _compute_capability() < 90:
        skip = pytest.mark.skip(reason="needs compute capability >= 9.0 (PDL)")
        for it in items:
            if "hopper" in it.keywords:
                it.add_marker(skip)


@pytest.fixture
def rng(request):
    """A NumPy generator seeded from the test's name (fresh inputs per test, reproducible)."""
    import zlib

    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def stream():
    """A non-blocking stream, current for the whole test (nothing runs on the legacy stream)."""
    import cupy

    st = cupy.cuda.Stream(non_blocking=True)
    with st:
        yield st
    st.synchronize()
