"""Cost of HotBufferCache.write_host of n draft tokens (GPU kv), host time per call and the
stream's time per call, on whichever tree PYTHONPATH names (main: drop_tokens each call)."""
import json
import sys
import time

import cupy
import numpy as np

from hisparse_cupy import HotBufferCache

L, R, H, MAXLEN, ROW = 78, 16, 2048, 8192, 656
c = HotBufferCache(n_layers=L, max_requests=R, max_len=MAXLEN, row_bytes=ROW, hot_size=H,
                   top_k=1024, extra_page=64)
rids = [c.admit(5000) for _ in range(R)]
s = cupy.cuda.Stream(non_blocking=True)
out = {"tree": sys.argv[1] if len(sys.argv) > 1 else "?"}
for n in (1, 3):
    with s:
        kv = cupy.asarray(np.random.default_rng(0).integers(0, 256, (L, n, ROW), np.uint8))
    s.synchronize()
    for _ in range(20):
        c.write_host(rids[0], 5000, kv, stream=s)
    s.synchronize()
    host, dev = [], []
    for _rep in range(7):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(s)
        t = time.perf_counter()
        for i in range(200):
            c.write_host(rids[i % R], 5000, kv, stream=s)
        host.append((time.perf_counter() - t) / 200 * 1e6)
        b.record(s)
        b.synchronize()
        dev.append(cupy.cuda.get_elapsed_time(a, b) * 1000 / 200)
    out[f"n{n}_host_us"] = float(np.median(host))
    out[f"n{n}_stream_us"] = float(np.median(dev))
print(json.dumps(out))
c.close()
