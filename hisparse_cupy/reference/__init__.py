"""NumPy oracle: the package's algorithms in executable form.

Everything here runs on the CPU and mutates the given NumPy state in place exactly as the
kernels mutate device state, so a GPU call can be compared with it element for element:

- ``_single.py``: the single-step swap (:func:`swap_in`) and the cache invariants;
- ``_multi.py``: the multi-step swap (:func:`multistep_swap_in`), its invariants, and
  :func:`mirror_layer`;
- ``_resident.py``: the direct path, rows whose every token has a device row of its own (a
  resident request: :func:`resident_swap`; the positional layout of the sparse swaps).
"""

from .._abi import N_STATUS, ST_BADROW, ST_NOHOST, ST_RANGE
from ._multi import (
    MULTISTEP_KINDS,
    MultiStepResult,
    check_multistep_invariants,
    mirror_layer,
    multistep_swap_in,
)
from ._resident import ResidentResult, resident_swap
from ._single import InvariantError, SwapResult, check_invariants, swap_in

__all__ = [
    "InvariantError", "MULTISTEP_KINDS", "MultiStepResult", "N_STATUS", "ResidentResult",
    "ST_BADROW", "ST_NOHOST", "ST_RANGE", "SwapResult", "check_invariants",
    "check_multistep_invariants", "mirror_layer", "multistep_swap_in", "resident_swap",
    "swap_in",
]
