"""A pytest plugin: ``-rs`` prints one line per skip reason, with its count (pytest folds skips by
file, line and reason, so the same reason at 74 places printed 74 lines). ``tests/conftest.py``
imports its hook; ``tests/test_cli.py`` runs it alone on a generated module."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and isinstance(rep.longrepr, tuple) and len(rep.longrepr) == 3:
        rep.longrepr = (HERE, None, rep.longrepr[2])  # (folded by reason alone)
