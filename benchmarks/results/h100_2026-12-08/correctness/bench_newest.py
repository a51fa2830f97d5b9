"""Cost of Step.backup_newest (the newest kernel, record=True, plus its D2H copy) and of the
newest kernel alone (write_host=False), per call, on whichever tree PYTHONPATH names.
78 layers, 656-byte rows, every request past H (so slot H is recorded in every layer)."""
import json
import sys

import cupy
import numpy as np

from hisparse_cupy import HotBufferCache

L, R, H, K, MAXLEN = 78, 32, 512, 256, 2048
out = {}
c = HotBufferCache(n_layers=L, max_requests=R, max_len=MAXLEN, row_bytes=656, hot_size=H,
                   top_k=K, extra_page=64, max_steps=1)
rids = [c.admit(1500) for _ in range(R)]
rng = np.random.default_rng(0)
for B in (1, 8, 32):
    req = cupy.asarray(rids[:B], cupy.int32)
    for wh in (False, True):
        times = []
        for _rep in range(7):
            lens = cupy.asarray(rng.integers(1200, 1900, B), cupy.int32)
            step = c.begin_step(req, lens)
            s = step.stream
            for _ in range(10):
                step.backup_newest(write_host=wh)
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(s)
            for _ in range(200):
                step.backup_newest(write_host=wh)
            b.record(s)
            b.synchronize()
            times.append(cupy.cuda.get_elapsed_time(a, b) * 1000 / 200)
            step.finish()
        out[f"B{B}_writehost{int(wh)}_us"] = float(np.median(times))
print(json.dumps({"tree": sys.argv[1] if len(sys.argv) > 1 else "?", **out}))
c.close()
