"""Small run of the multi-step kernels for compute-sanitizer (exits non-zero on wrong results).

Covers init, gather and commit (PDL launch where the device has it): hits, cross-step
duplicate misses, the extra page, -1 / out-of-range / host-less entries, a padding row, partial
admission and misses beyond the scratch rows; odd calls copy the misses in the gather (as
above batch x steps COPY_IN_COMMIT_MAX_ROWS), even ones in the commit grid's copy blocks. Every
call is compared with the NumPy oracle (outputs, status, state) and every output row's bytes are
checked.
"""

from __future__ import annotations

import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hisparse_cupy import (
    HostKVPool,
    MissPlan,
    MultiStepConfig,
    MultiStepState,
    multistep_swap_in,
    reference,
)
from hisparse_cupy.testing import knobs  # noqa: E402

from _util import pattern  # noqa: E402

R, H, P, K, S_MAX, ROW = 3, 48, 8, 24, 4, 64
LENS = np.array([300, 40, 500])  # request 1 is short (positional layout)


def main() -> int:
    rng = np.random.default_rng(11)
    cfg = MultiStepConfig(R, H, P, K, max_steps=S_MAX, scratch=S_MAX * K - H, max_batch=R)
    slot_locs, scratch_locs, D = cfg.layout()
    L = int(LENS.max()) + 8
    host_locs = (np.arange(R)[:, None] * L + np.arange(L)).astype(np.int64)
    host_locs[0, 5] = -1  # a token without a host row
    tokens = np.full((R, H + P), -1, np.int32)
    tokens[0, :30] = rng.choice(np.arange(6, 299), 30, replace=False)
    tokens[1, :H] = np.arange(H)
    tokens[2, :H] = rng.choice(499, H, replace=False)
    tokens[0, H:H + 3] = [299, 300, 301]  # newest and draft tokens in the extra page
    pool = HostKVPool(1, R * L, ROW)
    pool.layer(0)[:] = pattern(0, np.arange(R * L), ROW)
    dev_np = np.zeros((D, ROW), np.uint8)
    for r in range(R):
        s = np.nonzero(tokens[r] >= 0)[0]
        dev_np[slot_locs[r, s]] = pattern(0, r * L + tokens[r, s], ROW)
    dev = cupy.asarray(dev_np)
    state = MultiStepState(cfg, cupy.asarray(host_locs), cupy.asarray(tokens),
                           cupy.asarray(slot_locs), cupy.asarray(scratch_locs), n_device_rows=D)
    np_state = dict(slot_tokens=tokens.copy(), slot_locs=slot_locs.copy(),
                    scratch_locs=scratch_locs.copy(), ref=np.zeros((R, H), np.uint32),
                    clock=np.tile(np.uint32([1, 0]), (R, 1)))
    plan = MissPlan(R, S_MAX * K)
    errors = 0
    for call in range(6):
        S = 2 + call % 3
        req = np.array([(call + i) % R for i in range(R)])
        seqs = LENS[req][:, None] + np.arange(S)
        topk = np.empty((R, S, K), np.int32)
        for b, r in enumerate(req):
            hot = tokens[r, :H][tokens[r, :H] >= 0] if r != 1 else np.arange(39)
            base = np.concatenate([rng.choice(hot, K // 2), rng.integers(0, LENS[r] - 1, K // 2)])
            for s in range(S):
                row = base.copy()
                if call >= 4:  # far beyond the hot buffer: partial admission, direct copies
                    row = rng.choice(np.arange(LENS[r] - 1), K, replace=False)
                row[:3] = [-1, LENS[r] + 40, 5]
                row[3] = LENS[r] - 1 + s  # newest / draft token of this step
                topk[b, s] = rng.permutation(row)
        num_real = R if call % 2 == 0 else R - 1
        d_nr = cupy.asarray([num_real], cupy.int32)
        with knobs.copy_blocks(None if call % 2 == 0 else 0):  # the copy blocks, or none
            out = multistep_swap_in(cupy.asarray(topk), cupy.asarray(req.astype(np.int32)),
                                    cupy.asarray(seqs.astype(np.int32)), state,
                                    host_rows=pool.device_ptr(0), n_host_rows=pool.n_rows,
                                    device_rows=dev, plan=plan, num_real=d_nr)
        got = cupy.asnumpy(out)
        cnt, src = cupy.asnumpy(plan.count[:R]), cupy.asnumpy(plan.src[:R])
        order = [src[b, : cnt[b]] - req[b] * L for b in range(R)]
        res = reference.multistep_swap_in(topk, req, seqs, host_locs=host_locs, hot_size=H,
                                     n_host_rows=pool.n_rows, num_real=num_real,
                                     miss_order=order, **np_state)
        errors += int((got != res.device_locs).sum())
        gs = state.to_numpy()
        for k in ("slot_tokens", "slot_locs", "scratch_locs", "ref", "clock"):
            errors += int((gs[k] != np_state[k]).sum())
        try:
            reference.check_multistep_invariants(gs["slot_tokens"], gs["slot_locs"],
                                            gs["scratch_locs"], gs["token_slot"], gs["ref"],
                                            gs["clock"], H, n_device_rows=D)
        except reference.InvariantError as e:
            print("invariant:", e)
            errors += 1
        d = cupy.asnumpy(dev)
        b, s, i = np.nonzero(res.tokens >= 0)
        want = pattern(0, req[b] * L + res.tokens[b, s, i], ROW)
        errors += int((d[np.maximum(got[b, s, i], 0)] != want).any(axis=1).sum())
        print(f"call {call}: S={S} misses={cnt.tolist()} partial={res.stats[:, 3].tolist()} "
              f"errors so far {errors}")
    cupy.cuda.Device().synchronize()
    pool.close()
    print(f"sanitize_spec: {errors} wrong entries")
    return 1 if errors else 0


if __name__ == "__main__":
    with knobs.pdl(True):  # the commit with PDL, whatever HISPARSE_CUPY_PDL says
        sys.exit(main())
