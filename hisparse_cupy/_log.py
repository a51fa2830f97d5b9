"""The package's logger, ``logging.getLogger("hisparse_cupy")``.

Quiet by default. ``HISPARSE_CUPY_LOG=debug`` (or ``info``, ``warning``) sets its level and
prints to stderr; or configure the logger like any other. Logged: each kernel source compiled
or loaded for a device (info), each launch configuration and foreign stream created (debug).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("hisparse_cupy")

_level = os.environ.get("HISPARSE_CUPY_LOG", "").strip().upper()
if _level:
    if _level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError(f"HISPARSE_CUPY_LOG must be debug, info, warning or error, got "
                         f"{os.environ['HISPARSE_CUPY_LOG']!r}")
    log.setLevel(_level)
    if not log.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        log.addHandler(h)
