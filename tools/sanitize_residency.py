"""Residency's moves for compute-sanitizer (issue 60): seeds of the randomized step test
(tests/_stepfuzz.py) with a device budget in every configuration, so each run admits requests
resident and sparse, demotes, promotes, cancels promotions mid-fill, switches and grows, on
streams ordered only by the library's own events (a call's stream at times held busy), with
KV dropped by the caller and its memory reused right after each call; every output byte
checked. The demotion's device-side tables and copy, the promotion's fill and switch with the
device's count of written tokens, and the newest-row kernel's count all run here. Exits
non-zero on a wrong byte."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _stepfuzz import Fuzz  # noqa: E402

if __name__ == "__main__":
    moves = 0
    for seed in (3, 5, 8):
        r = Fuzz(True, seed, sync_every=10, budget=True).run(40)
        moves += r["moves"]
        print(f"seed {seed}: {r['calls']} calls, {r['moves']} moves ({r['cancels']} cancelled "
              f"mid-fill), {r['holds']} held streams, errors {r['errors']}")
    assert moves, "no residency move ran"
    print("sanitize_residency: every byte right")
