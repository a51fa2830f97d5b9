"""The protocol between a prefill sender and a decode receiver, in one place: the ticket, the
control messages, the digest, and the checks of what a peer sends. Nothing here touches NIXL;
``_nixl.py`` carries the messages, ``_receive.py`` and ``_send.py`` act on them. Why the
protocol is this way (its guarantees, the page rule, the trust boundary, the figures):
``docs/design.md``, "Prefill on another node".

**The ticket** (:func:`new_ticket`, version :data:`TICKET_VERSION`; a JSON dict that the
engines carry over their own control plane): the receiver's agent ``name``/``instance`` and NIXL
``metadata`` (base64), a random ``xfer_id`` and a secret ``token`` (128 bits each), ``req_id``,
``n_tokens, page_tokens, n_layers, row_bytes, timeout_s``, ``mem`` ("DRAM") and ``dev``, the
``runs`` of consecutive pages as ``[first token, tokens]``, the destination ``descs`` as
``[addr, bytes]`` layer-major (layer 0's runs, then layer 1's...), ``mode`` ("pull" or "push"),
``verify`` (per-layer sums), and ``shm`` where the pool is a shared ``HostKVPool`` (name,
identity as ``[boot id, device, inode]``, base address, bytes). The sender checks it with
:func:`check_ticket` before anything moves.

**The messages** (NIXL notifications, ``KIND:`` then a JSON object, :func:`message` /
:func:`parse`). Every one a sender sends carries the reservation's ``xfer_id``, ``token`` and the
send's ``tag`` (``xfer_id/attempt``: a resend's answers are told from the last's):

- sender -> receiver (:data:`TO_RECEIVER`): ``offer`` (a pull: the sender's ``agent`` name,
  ``mem``, ``dev``, its ``descs`` and the ``metadata`` of their registration, ``sums``; checked
  by :func:`check_offer`), ``withdraw`` (a pull past its deadline), ``begin`` (a write or a
  same-node copy asks for a grant: ``how``, ``digest``, ``verify``, ``metadata``), ``done`` (its
  bytes are in place: ``digest``, ``sums``; a WRITE's is NIXL's notification, sent once the
  WRITE is complete) and ``abort`` (granted, it writes nothing more: ``why``);
- receiver -> sender (:data:`TO_SENDER`), naming the send's ``tag``: ``grant`` (write now),
  ``ok`` (arrived) and ``fail`` (with ``why``).

A message that does not parse, names another kind or carries a non-``str`` ``tag``, ``xfer_id``
or ``token`` is None to :func:`parse` (counted and ignored); a token is compared with
:func:`same_secret`; a peer's text goes into a reason through :func:`text`.

**The digest** (:func:`digest`): SHA-256 of what a ticket lets land (its sizes, its
destination descriptors, and the shared pool's name, identity, base and size: the same-node
path writes the pool the ticket names). The receiver keeps its own; a write's ``begin`` and
``done`` carry the sender's, so a ticket altered in transit is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json

import numpy as np

from .._checks import integer

TICKET_VERSION = 3  # 3: the digest covers the shared pool's name
TO_RECEIVER = ("offer", "withdraw", "begin", "done", "abort")
TO_SENDER = ("grant", "ok", "fail")
MAX_MESSAGE = 1 << 26  # longer notifications are not parsed (an offer of 1M descriptors fits)


def new_ticket(*, agent: str, instance: str, metadata: str, xfer_id: str, token: str, req_id,
               n_tokens: int, page_tokens: int, n_layers: int, row_bytes: int,
               timeout_s: float, runs: np.ndarray, descs: np.ndarray, push: bool,
               verify: bool, shm: dict | None) -> dict:
    """The ticket of a reservation (the fields above), as JSON-ready Python values."""
    return {"version": TICKET_VERSION, "agent": agent, "instance": instance,
            "metadata": metadata, "xfer_id": xfer_id, "token": token, "req_id": req_id,
            "n_tokens": n_tokens, "page_tokens": page_tokens, "n_layers": n_layers,
            "row_bytes": row_bytes, "timeout_s": timeout_s, "mem": "DRAM", "dev": 0,
            "runs": np.asarray(runs).tolist(), "descs": np.asarray(descs).tolist(),
            "mode": "push" if push else "pull", "verify": verify,
            **({"shm": shm} if shm else {})}


def message(kind: str, **fields) -> bytes:
    """A control message: ``kind`` (one of :data:`TO_RECEIVER` / :data:`TO_SENDER`) and its
    fields as JSON."""
    return kind.encode() + b":" + json.dumps(fields, separators=(",", ":")).encode()


def parse(msg, kinds) -> tuple[str, dict] | None:
    """``(kind, fields)`` of a control message of one of ``kinds``, or None for anything else
    (not bytes, too long, another kind, not JSON, not an object, a non-str ``tag``, ``xfer_id``
    or ``token``): never raises, so one peer's junk cannot stop a poll."""
    try:
        msg = bytes(msg)
    except (TypeError, ValueError):
        return None
    kind, sep, body = msg.partition(b":")
    if not sep or len(msg) > MAX_MESSAGE:
        return None
    kind = kind.decode("ascii", "replace")
    if kind not in kinds:
        return None
    try:
        fields = json.loads(body)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return None
    if not isinstance(fields, dict) or any(
            k in fields and not isinstance(fields[k], str) for k in ("tag", "xfer_id", "token")):
        return None
    return kind, fields


def same_secret(a, b) -> bool:
    """``a == b`` for two tokens, in time that does not depend on where they differ. Takes any
    two values (a peer's token is whatever its JSON held): False unless both are ``str``; any
    ``str`` compares, lone surrogates included (UTF-8 with ``surrogatepass`` encodes every
    ``str``, and no two alike)."""
    return isinstance(a, str) and isinstance(b, str) and hmac.compare_digest(
        a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


def text(v, n: int) -> str:
    """A peer's value ``v`` fit for a message to the engine: a ``str`` cut to ``n`` characters
    (lone surrogates written as ``\\udxxx``, so the result always encodes), a number or None as
    written, anything else by its type and size (no ``repr`` of a structure a peer nested a
    thousand deep). Never raises."""
    if isinstance(v, str):
        return v[:n].encode("utf-8", "backslashreplace").decode("utf-8")
    if v is None or isinstance(v, (bool, float)) or (isinstance(v, int) and abs(v) < 1 << 64):
        return repr(v)
    if isinstance(v, (list, dict)):
        return f"a {type(v).__name__} of {len(v)}"
    return f"a {type(v).__name__}"


def digest(n_layers: int, n_tokens: int, row_bytes: int, descs: np.ndarray,
           shm: dict | None) -> str:
    """SHA-256 (hex) of what a ticket lets land: its sizes, its destination descriptors
    ``[addr, bytes]`` and the shared pool that holds them (None: none), all of what names it:
    ``name`` and ``identity`` (what the same-node path attaches) and ``base`` and ``bytes``
    (where the descriptors point in it)."""
    pool = None if shm is None else [str(shm["name"]), [str(shm["identity"][0]),
                                                        *map(int, shm["identity"][1:])],
                                     int(shm["base"]), int(shm["bytes"])]
    h = hashlib.sha256(f"{n_layers},{n_tokens},{row_bytes};".encode())
    h.update(json.dumps(pool, separators=(",", ":")).encode("utf-8", "surrogatepass") + b";")
    h.update(np.ascontiguousarray(descs[:, :2], dtype="<u8").tobytes())
    return h.hexdigest()


def ticket_digest(t: dict) -> str:
    """The :func:`digest` a sender computes from ticket ``t`` (checked: :func:`check_ticket`)."""
    return digest(t["n_layers"], t["n_tokens"], t["row_bytes"], t["descs"], t.get("shm"))


def check_ticket(t) -> dict:
    """The ticket checked (its version, its fields' types, its descriptors against its runs, a
    shared pool holding every descriptor): a copy with ``runs`` and ``descs`` as arrays."""
    if not isinstance(t, dict):
        raise TypeError(f"ticket must be the dict KVReceiver.reserve returned, got "
                        f"{type(t).__name__}")
    if t.get("version") != TICKET_VERSION:
        raise ValueError(f"ticket['version'] is {t.get('version')!r}; this sender reads "
                         f"version {TICKET_VERSION}")
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


def check_offer(o, sender: str, want: np.ndarray):
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
