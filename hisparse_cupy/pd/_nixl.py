"""What both sides of :mod:`hisparse_cupy.pd` share of NIXL: its import, an agent with the UCX
backend, the peers an agent has loaded (:class:`Peers`: a working connection is never dropped
for metadata that does not load over it), descriptors cut into pieces, an agent's new control
messages (:func:`messages`; the messages themselves: ``_protocol.py``), and the records the
calls return."""

from __future__ import annotations

import base64
import binascii
import collections
import contextlib
import importlib
import os
import uuid

import numpy as np

from ._protocol import parse, text

NEEDS_NIXL = ("hisparse_cupy.pd needs NIXL's Python API: pip install nixl-cu12 (CUDA 12) or "
              "nixl-cu13 (CUDA 13); for host (DRAM) transfers `pip install --no-deps "
              "nixl-cu12` plus NumPy is enough (its torch dependency is not needed)")
Arrival = collections.namedtuple("Arrival", "req_id pages n_tokens xfer_id sender seconds")
Arrival.__doc__ = """A completed reservation: ``pages`` (engine-held, token order) hold its
``n_tokens`` tokens; ``sender`` wrote or offered them, ``seconds`` after the reservation."""
Polled = collections.namedtuple("Polled", "done timed_out failed", defaults=((),))
Polled.__doc__ = """What a poll found: arrivals, the req_ids that timed out, and ``(req_id,
why)`` of the pulls that failed (their pages put back)."""
Sent = collections.namedtuple("Sent", "req_id xfer_id bytes seconds descriptors")
Sent.__doc__ = "A completed send: ``bytes`` in ``seconds`` (the call), the ticket's descriptors"


def messages(a, kinds, stats, junk: str, on_error=None):
    """Agent ``a``'s new notifications that parse as control messages of ``kinds``, as
    ``(sender, kind, fields)``; every other one counted in ``stats[junk]``. Never raises: a
    batch NIXL fails to hand over is counted in ``stats["errors"]`` and its exception given to
    ``on_error``. NIXL's binding decodes each sender's agent name, so one peer whose name is
    not UTF-8 makes it drop the whole batch it came in (taken off NIXL's queue first): those
    messages are lost, and their transfers end at their deadlines (a granted write's pages
    quarantined), never with a wrong byte."""
    try:
        batch = a.get_new_notifs()
    except Exception as e:
        stats["errors"] = stats.get("errors", 0) + 1
        if on_error is not None:
            on_error(e)
        return
    for sender, msgs in batch.items():
        sender = sender.decode("utf-8", "replace") if isinstance(sender, bytes) else str(sender)
        for msg in msgs:
            got = parse(msg, kinds)
            if got is None:
                stats[junk] = stats.get(junk, 0) + 1
            else:
                yield (sender, *got)


def nixl_api():
    """NIXL's Python API (the ``nixl`` package, else the wheels' ``nixl_cu13`` / ``nixl_cu12``),
    imported on first use; ``ImportError`` naming what to install."""
    why = []
    for name in ("nixl", "nixl_cu13", "nixl_cu12"):
        for mod in (name, name + "._api"):
            try:
                m = importlib.import_module(mod)
            except ImportError as e:
                why.append(f"{mod}: {e}")
                break
            if hasattr(m, "nixl_agent"):
                return m
    raise ImportError(f"{NEEDS_NIXL} ({'; '.join(why)})")


def seconds(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number of seconds, got {type(v).__name__}")
    if not v > 0:
        raise ValueError(f"{name} must be > 0, got {v}")
    return float(v)


def ucx_params(params) -> dict[str, str]:
    """``ucx_params`` checked: NIXL's UCX backend parameters (the names its
    ``get_plugin_params("UCX")`` lists, e.g. ``num_workers``, and ``num_threads``; :func:`agent`
    rejects others), values ints or strs, as the ``{str: str}`` NIXL takes; None: {} (NIXL's
    defaults)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise TypeError(f"ucx_params must be a dict of NIXL UCX backend parameters, got "
                        f"{type(params).__name__}")
    out = {}
    for k, v in params.items():
        if not isinstance(k, str) or not k or isinstance(v, bool) or \
                not isinstance(v, (str, int, np.integer)):
            raise TypeError(f"ucx_params[{k!r}] must map a parameter name to an int or str, "
                            f"got {v!r}")
        out[k] = str(v)
    return out


def agent(name, side: str, params: dict[str, str] | None = None):
    """``(name, a NIXL agent of that name with the UCX backend)``; default name: unique;
    ``params``: the backend's (:func:`ucx_params`)."""
    name = f"hisparse-{side}-{os.getpid()}-{uuid.uuid4().hex[:8]}" if name is None else name
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    api = nixl_api()
    os.environ.setdefault("UCX_RMA_PPLN_ENABLE", "y")  # pd's module docstring
    a = api.nixl_agent(name, api.nixl_agent_config(backends=[]))
    known = set(a.get_plugin_params("UCX")) | {"num_threads"}  # (nixl_agent_config's too)
    if unknown := sorted(set(params or {}) - known):
        raise ValueError(f"ucx_params names {unknown}: not parameters of NIXL's UCX backend "
                         f"(it takes {sorted(known)})")
    try:
        a.create_backend("UCX", dict(params or {}))
    except Exception as e:
        raise RuntimeError(f"NIXL's UCX backend did not start with ucx_params {params or {}} "
                           f"({e!r}); its parameters: {a.get_plugin_params('UCX')}") from None
    if "UCX" not in a.backends:
        raise RuntimeError(f"NIXL's UCX backend did not start ({a.get_plugin_list()})")
    return name, a


def register(a, what: str, lo: int, nbytes: int, dev: int, mem: str):
    """Agent ``a``'s registration of memory ``[lo, lo + nbytes)`` (``mem`` "DRAM" or "VRAM" of
    device ``dev``), or an error naming ``what``. UCX registers host memory with CUDA a page at
    a time, so a host buffer that shares a page with memory registered for another buffer (two
    heap arrays side by side, one of them a live pool) cannot be registered."""
    try:
        return a.register_memory([(lo, nbytes, dev, "")], mem)
    except Exception as e:
        hint = "" if mem != "DRAM" else ("; a page of it may already be registered with CUDA "
                                         "for another buffer: give it pages of its own (a "
                                         "HostKVPool, or an array over an mmap)")
        raise RuntimeError(f"{what}: NIXL could not register its {nbytes} bytes of {mem} at "
                           f"{lo:#x} ({e!r}){hint}") from None


def metadata(a, regs=None, *, keys: bool = True) -> str:
    """Agent ``a``'s metadata (base64) for a peer: by default all of it (every registered
    buffer's remote keys); with a registration ``regs`` (``register_memory``'s result) its
    connection details and that buffer's keys only; with ``keys=False`` the connection details
    alone, so a peer holding it can reach no memory of ``a`` through NIXL (it can only
    notify)."""
    if regs is None and keys:
        return base64.b64encode(a.get_agent_metadata()).decode("ascii")
    if not keys:  # an empty list of registrations (the class NIXL's agent module binds)
        regs = importlib.import_module(type(a).__module__).nixlBind.nixlRegDList(
            a.nixl_mems["DRAM"])
    return base64.b64encode(a.get_partial_agent_metadata(regs, True, ["UCX"])).decode("ascii")


def _name(got) -> str:
    """An agent name NIXL returned (bytes or str) as a ``str`` (bytes not UTF-8 kept as
    surrogates, so that the name is never mistaken for another)."""
    return got.decode("utf-8", "surrogateescape") if isinstance(got, bytes) else str(got)


def _raw(md, what: str) -> bytes:
    try:
        return base64.b64decode(md, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise ValueError(f"{what} is not base64 ({text(str(e), 200)})") from None


class Peers:
    """The peers agent ``a`` has loaded, by name, with the metadata (base64) loaded last for
    each. :meth:`load` adds a peer, or updates a known one in place (NIXL takes a known peer's
    new metadata when its connection details are those it has: its new registrations become
    reachable), and never drops or replaces a working connection for metadata that does not
    load over it. NIXL refuses to load metadata of other connection details under a known name
    (``NIXL_ERR_NOT_ALLOWED``: a restarted peer of that name, an impostor) or metadata it cannot
    read (``NIXL_ERR_MISMATCH``) and leaves the peer as it was; dropping the peer to load it
    anyway (``remove_remote_agent``) is what must not happen while it is in use: NIXL then
    reports that peer's transfers in flight as ``NIXL_ERR_NOT_FOUND`` while their bytes keep
    landing, and the peer's notifications of more than ~16 KB are lost (both seen here over
    UCX). What happens to such metadata is the owner's ``replace``:

    - False (the receiver, whose peers' metadata comes in the peers' own messages, from
      anyone who names them: NIXL does not authenticate agent names): refused, the connection
      kept as it is; :meth:`forget` (the engine's call) drops it.
    - True (the sender, whose receivers' metadata comes in tickets over the engine's control
      plane): loaded in place of the old connection when ``busy(name)`` (the caller's) is
      False, nothing in flight with that peer, and the metadata has loaded, under that name, in
      a probe agent of its own (made on first need, and left knowing no one); else refused.
      Should the swap's load fail all the same, the old metadata is loaded back."""

    def __init__(self, a, *, replace: bool):
        self.agent, self.replace = a, replace
        self.known: dict = {}  # name -> the metadata (base64) loaded last
        self.replaced = 0
        self._probe = None

    def __contains__(self, name) -> bool:
        return name in self.known

    def load(self, name: str, md, what: str, busy=None) -> None:
        """Make the agent know peer ``name`` by metadata ``md`` (base64; ``what`` names it in
        errors), or raise ``ValueError`` with nothing changed; ``busy(name)``: whether a
        transfer with that peer is in flight (asked only before a swap)."""
        if name in self.known and self.known[name] == md:
            return
        raw = _raw(md, what)
        try:
            got = self.agent.add_remote_agent(raw)
        except Exception as e:
            if name not in self.known:
                raise ValueError(f"{what} did not load ({e!r}): not NIXL agent metadata, or "
                                 f"its agent is gone (stale)") from None
            self._swap(name, md, raw, what, e, busy)
            return
        if _name(got) != name:
            if _name(got) not in self.known:  # a stranger's, loaded just now: dropped again
                with contextlib.suppress(Exception):
                    self.agent.remove_remote_agent(got)
            raise ValueError(f"{what} belongs to agent {_name(got)!r}, not {name!r}")
        self.known[name] = md

    def _swap(self, name: str, md, raw: bytes, what: str, e: Exception, busy) -> None:
        """Metadata under known name ``name`` that did not load over its connection (``e``)."""
        why = (f"{what} does not load over the connection this agent has to {name!r} ({e!r}): "
               f"another agent of that name (restarted, or an impostor), or not NIXL metadata")
        if not self.replace:
            raise ValueError(f"{why}; the connection is kept (KVReceiver.forget_sender drops "
                             f"it)")
        if busy is not None and busy(name):
            raise ValueError(f"{why}; the connection is kept while transfers with it are in "
                             f"flight")
        got = self._proven(raw)
        if got is None:
            raise ValueError(f"{why}; it does not load on its own either: the connection is "
                             f"kept")
        if got != name:
            raise ValueError(f"{what} belongs to agent {got!r}, not {name!r}")
        old = self.known.pop(name)
        with contextlib.suppress(Exception):
            self.agent.remove_remote_agent(name)
        try:
            self.agent.add_remote_agent(raw)
        except Exception as e2:
            with contextlib.suppress(Exception):
                self.agent.add_remote_agent(base64.b64decode(old))
                self.known[name] = old
            raise ValueError(f"{what} did not load in place of {name!r}'s connection "
                             f"({e2!r})") from None
        self.known[name] = md
        self.replaced += 1

    def _proven(self, raw: bytes) -> str | None:
        """The name metadata ``raw`` loads under in the probe agent (then dropped there), or
        None if it does not load."""
        try:
            if self._probe is None:
                self._probe = agent(None, "probe")[1]
            got = self._probe.add_remote_agent(raw)
        except Exception:
            return None
        with contextlib.suppress(Exception):
            self._probe.remove_remote_agent(got)
        return _name(got)

    def forget(self, name: str, busy=None) -> bool:
        """Drop peer ``name``'s connection, unless ``busy(name)``; True if it was dropped."""
        if name not in self.known or (busy is not None and busy(name)):
            return False
        del self.known[name]
        with contextlib.suppress(Exception):
            self.agent.remove_remote_agent(name)
        return True

    def clear(self, remove: bool = True) -> None:
        """The owner is closing: forget every peer (``remove``: drop its connection too, busy
        or not), the probe agent and the agent itself (so that closing lets it go)."""
        for name in list(self.known):
            del self.known[name]
            if remove:
                with contextlib.suppress(Exception):
                    self.agent.remove_remote_agent(name)
        self.agent = self._probe = None


def cut(descs: np.ndarray, piece: int) -> np.ndarray:
    """``[addr, bytes, dev]`` descriptors cut into pieces of at most ``piece`` bytes."""
    n = descs[:, 1].astype(np.int64)
    k = np.maximum(1, -(-n // piece))
    idx = np.repeat(np.arange(n.size), k)
    off = (np.arange(idx.size) - np.repeat(np.cumsum(k) - k, k)) * piece
    out = descs[idx].copy()
    out[:, 0] += off.astype(np.uint64)
    out[:, 1] = np.minimum(piece, n[idx] - off).astype(np.uint64)
    return out


def xfer_descs(a, descs: np.ndarray, dev: int, mem: str):
    """NIXL's list of ``[addr, bytes]`` rows on device ``dev`` of memory ``mem``."""
    out = np.empty((descs.shape[0], 3), np.uint64)
    out[:, :2], out[:, 2] = descs[:, :2], dev
    return a.get_xfer_descs(out, mem)
