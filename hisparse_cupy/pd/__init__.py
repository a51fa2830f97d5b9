"""Prefill on another node: a request's KV lands in the decode host's page pool over NIXL.

The decode side reserves the request's pages and hands a ticket to the prefill side over the
engines' own control plane; the prefill side sends its KV into those pages (a pull, a WRITE, or
on the same node copies into a shared pool); the decode side's polls report arrivals, which it
admits into the cache::

    rx = KVReceiver(cache.pool, cache.pages)              # decode
    ticket = rx.reserve(req_id, n_tokens)                 # -> the prefill process
    KVSender().send(ticket, kv)                           # prefill: kv uint8 [L, n, row_bytes]
    for arrival in rx.poll().done:                        # decode, each step
        rid = rx.admit(cache, arrival)

No byte lands in a page the receiver has given back: a reservation whose transfer may still
write is quarantined until its end is confirmed (``KVReceiver.quarantined``,
``release_quarantined``). Nothing a peer sends makes :meth:`KVReceiver.poll` raise.

The files: ``_protocol.py`` (the ticket, the control messages, the digest and their checks),
``_receive.py`` (:class:`KVReceiver`; how a reservation ends: ``_quarantine.py``), ``_send.py``
(:class:`KVSender`; a send in flight, :class:`PendingSend`: ``_pending.py``), ``_nixl.py`` (the
NIXL binding). The design, its guarantees, its trust boundary and its figures:
``docs/design.md``, "Prefill on another node". Names are imported on first use.
"""

from .._lazy import lazy

_NAMES = {"Arrival": "_nixl", "KVReceiver": "_receive", "KVSender": "_send",
          "PendingSend": "_pending", "Polled": "_nixl", "Sent": "_nixl", "nixl_api": "_nixl"}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy(__name__, _NAMES)
