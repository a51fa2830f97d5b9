"""A ticket, an offer and a sender's ``kv`` checked (the NIXL transport's inputs, from another
process: nothing in them is trusted before these checks)."""

from __future__ import annotations

import numpy as np

from .._checks import integer
from ._nixl import text


def ticket(t, version: int) -> dict:
    """The ticket checked: its fields' types, and its descriptors against its runs."""
    if not isinstance(t, dict):
        raise TypeError(f"ticket must be the dict KVReceiver.reserve returned, got "
                        f"{type(t).__name__}")
    if t.get("version") != version:
        raise ValueError(f"ticket['version'] is {t.get('version')!r}; this sender reads "
                         f"version {version}")
    for k in ("agent", "instance", "xfer_id", "token", "metadata", "mem"):
        if not isinstance(t.get(k), str) or (k == "mem" and t[k] != "DRAM"):
            raise ValueError(f"ticket[{k!r}] must be a str{' (DRAM)' * (k == 'mem')}, got "
                             f"{t.get(k)!r:.80}")
    if t.get("mode") not in ("pull", "push"):
        raise ValueError(f"ticket['mode'] must be 'pull' or 'push', got {t.get('mode')!r:.40}")
    if not isinstance(t.get("verify"), bool):
        raise ValueError(f"ticket['verify'] must be a bool, got {t.get('verify')!r:.40}")
    out = dict(t)
    for k in ("n_tokens", "page_tokens", "n_layers", "row_bytes", "dev"):
        out[k] = integer(f"ticket[{k!r}]", t.get(k), int(k != "dev"))
    try:
        runs = np.asarray(t.get("runs"), np.int64).reshape(-1, 2)
        descs = np.asarray(t.get("descs"), np.uint64).reshape(-1, 2)
    except (ValueError, TypeError, OverflowError) as e:
        raise ValueError(f"ticket's runs / descs are not lists of int pairs ({e})") from None
    L, n, rb = out["n_layers"], out["n_tokens"], out["row_bytes"]
    ends = np.cumsum(runs[:, 1])
    if not runs.size or (runs[:, 1] < 1).any() or ends[-1] != n or \
            (runs[:, 0] != ends - runs[:, 1]).any():
        raise ValueError(f"ticket['runs'] must cut tokens 0..{n} into consecutive runs, got "
                         f"{t['runs']!r:.200}")
    if descs.shape[0] != L * runs.shape[0] or \
            (descs[:, 1].reshape(L, -1) != (runs[:, 1] * rb).astype(np.uint64)).any():
        raise ValueError(f"ticket's descriptors do not match its runs: {L} layers x "
                         f"{runs.shape[0]} runs of tokens * {rb} bytes expected, got "
                         f"{descs.shape[0]} descriptors")
    out["runs"], out["descs"] = runs, descs
    if "shm" in t:  # a shared pool's: every descriptor inside it
        shm = t["shm"]
        try:
            ok = isinstance(shm["name"], str) and len(shm["identity"]) == 3 and \
                isinstance(shm["identity"][0], str) and \
                all(isinstance(v, int) and v >= 0 for v in
                    (*shm["identity"][1:], shm["base"], shm["bytes"]))
        except (TypeError, KeyError):
            ok = False
        if not ok or (descs[:, 0] < shm["base"]).any() or \
                (descs[:, 0] + descs[:, 1] > shm["base"] + shm["bytes"]).any():
            raise ValueError(f"ticket['shm'] must name a shared pool ({{name, identity, base, "
                             f"bytes}}) holding every descriptor, got {shm!r:.200}")
    return out


def offer(o, sender: str, want: np.ndarray):
    """A pull's offer checked against the reservation's ``want`` descriptors ``[addr, bytes]``:
    ``(its descriptors, memory type, device id)``."""
    if not isinstance(o, dict) or o.get("agent") != sender or \
            not isinstance(o.get("metadata"), str):
        raise ValueError(f"offer must be a dict from agent {sender!r} with its metadata")
    mem, dev = o.get("mem"), integer("offer['dev']", o.get("dev"), 0)
    if mem not in ("DRAM", "VRAM"):
        raise ValueError(f"offer['mem'] must be DRAM or VRAM, got {text(mem, 40)!r}")
    try:
        descs = np.asarray(o.get("descs"), np.uint64).reshape(-1, 2)
    except (ValueError, TypeError, OverflowError) as e:
        raise ValueError(f"offer['descs'] is not a list of int pairs ({e})") from None
    if descs.shape != want.shape or (descs[:, 1] != want[:, 1]).any():
        raise ValueError(f"offer['descs'] do not match the reservation's {want.shape[0]} "
                         f"descriptors (their byte counts)")
    return descs, mem, dev


def memory_of(x):
    """``(address, memory type, device id)`` of a NumPy array or a GPU array."""
    if isinstance(x, np.ndarray):
        return x.__array_interface__["data"][0], "DRAM", 0
    if not hasattr(x, "__cuda_array_interface__"):
        return None
    dev = getattr(x, "device", None)  # CuPy's .id, torch's .index
    ids = [getattr(dev, a, None) for a in ("id", "index")]
    return x.__cuda_array_interface__["data"][0], "VRAM", next(
        (i for i in ids if isinstance(i, int)), 0)


def kv_source(kv, L: int, n: int, rb: int):
    """``(address, layer stride, memory type, device id)`` of ``kv``, checked: uint8
    ``[L, n, rb]``, each layer's rows one after the other."""
    if (where := memory_of(kv)) is None:
        raise TypeError(f"kv must be a NumPy array or a GPU array (__cuda_array_interface__), "
                        f"got {type(kv).__name__}")
    cai = None if isinstance(kv, np.ndarray) else kv.__cuda_array_interface__
    shape, dtype = (kv.shape, kv.dtype) if cai is None else \
        (tuple(cai["shape"]), np.dtype(cai["typestr"]))
    if dtype != np.uint8 or tuple(shape) != (L, n, rb):
        raise ValueError(f"kv must be uint8 [{L}, {n}, {rb}] (the ticket's n_layers, n_tokens, "
                         f"row_bytes), got {dtype} {list(shape)}")
    strides = kv.strides if cai is None else (cai.get("strides") or (n * rb, rb, 1))
    if strides[2] != 1 or strides[1] != rb or strides[0] < 0:
        raise ValueError(f"kv's rows must follow each other in each layer (strides [>= 0, "
                         f"{rb}, 1]), got strides {list(strides)}: pass a contiguous copy")
    return where[0], strides[0], where[1], where[2]
