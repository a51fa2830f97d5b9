"""A few seeds of the randomized step test (tests/_stepfuzz.py) for compute-sanitizer: the
step API's every path (lifecycle, single- and multi-step swaps, the Prefetcher toggled with
its mirror of shared layers, prediction, graph replays, every stream kind) with every output
byte checked; exits non-zero on a wrong byte."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _stepfuzz import Fuzz  # noqa: E402

if __name__ == "__main__":
    # Prefetcher configurations (14: multi-step, so toggles mirror; 14 and 16: a device budget
    # that holds every request resident at times, lean steps)
    for seed in (12, 14, 16):
        r = Fuzz(True, seed, sync_every=10).run(30)
        print(f"seed {seed}: {r['calls']} calls, {r['graph_steps']} graph steps, "
              f"{r['toggles']} toggles, errors {r['errors']}")
    print("sanitize_stepfuzz: every byte right")
