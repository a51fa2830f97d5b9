"""Prefill on another node: a request's KV lands in the decode host's page pool over NIXL.

1. **reserve** (decode): :meth:`KVReceiver.reserve` takes the request's pages as engine-held
   pages (``HostPages.take``: no request's table names them, so no swap reads them as they
   fill) and returns a *ticket*, a JSON dict: the receiver's agent name, instance and NIXL
   metadata (base64), a random transfer id and a secret ``token`` (128 random bits each), the
   runs of consecutive pages (``[first token, tokens]``), the destination descriptors
   ``[addr, bytes]`` layer-major (layer 0's runs, then layer 1's...), ``n_tokens, page_tokens,
   n_layers, row_bytes, timeout_s``, ``mode`` (``"pull"``, or ``"push"`` for a
   ``KVReceiver(push=True)``), ``verify`` and, when ``pool`` is a shared ``HostKVPool``, ``shm``:
   its name, identity (boot id, device, inode), base address and bytes here.
2. **ticket -> prefill** over the engines' own control plane (JSON; no other service).
3. **send** (prefill): :meth:`KVSender.send` checks ``kv`` (uint8 ``[L, n, row_bytes]``, rows
   contiguous per layer; host, or GPU by ``__cuda_array_interface__`` as VRAM) against the
   ticket and moves it one of three ways; every control message carries the transfer id and
   the token (anything else is counted and ignored):

   - **pull** (the default): the sender registers ``kv`` and sends an *offer* (its agent
     metadata for ``kv`` alone, and ``kv``'s descriptors); the receiver's next :meth:`poll`
     checks the offer against the reservation and posts one NIXL READ into the pages with
     descriptors it builds itself, so nothing lands anywhere else; it tells the sender ``ok``
     once the READ is complete (or ``fail`` with why). On one node a READ of GPU memory is a
     copy by the receiver from the sender's memory (UCX's ``cuda_ipc``): 47.9 GB/s against 38.4
     for a WRITE of the same 512 MiB, ``benchmarks/probe_pd_paths.py``.
   - **write** (``KVReceiver(push=True)`` tickets, ``KVSender(pull=False)``): the sender asks
     with *begin* (its digest of the ticket), the receiver *grants* a live reservation whose
     digest matches, the sender posts one NIXL WRITE of every run of every layer whose
     notification (*done*, sent by NIXL once the WRITE is complete) the receiver checks
     against the grant before the pages arrive.
   - **same node**: a ticket with ``shm`` whose pool is on the sender's node (same boot id,
     same file) and GPU ``kv``: after the same begin and grant the sender attaches the pool
     once (``HostKVPool.attach``), stores ``kv`` into the ticket's rows as the cache's
     admission does (``_cache_rows.store_rows``: one 2-D ``cudaMemcpyAsync`` of every layer per
     run of pages, at a D2H memcpy's rate) and sends *done* once the copies are complete.
4. **poll** (decode): :meth:`KVReceiver.poll` reads the messages, posts and progresses the
   READs and answers grants; a reservation whose bytes are in place is an :class:`Arrival`; one
   whose transfer failed, was withdrawn or was altered is reported in ``failed``; one past its
   deadline is reported timed out. No message makes it raise: each is handled on its own
   (anything that does not parse is counted and ignored, and an exception that should not
   happen is counted in ``stats["errors"]``), so one message never drops the rest of its batch
   or an arrival already formed.
5. **admit**: :meth:`KVReceiver.admit` calls ``cache.admit(n, pages=<whole pages>, kv=<a copy
   of the partial last page's rows>)`` (``HostPages.admit`` shares whole engine pages only: the
   at most ``P - 1`` rows per layer of a partial page are copied into a page of the request's)
   and drops the engine's hold; :meth:`KVReceiver.admit_args` gives those arguments instead.

**No byte lands in a page the receiver has given back.** A reservation that ends without
arriving (cancelled, timed out, failed) whose transfer has not started (no READ posted, no
grant given) puts its pages back at once, and a later offer or begin for it is refused. One
whose transfer may still write is *quarantined*: a READ until NIXL reports it complete
(``"DONE"``; a cancelled READ is waited out, never trusted to have stopped), a granted write
until its sender's *done* or *abort* (an honest sender sends one of them once its WRITE or
copies can write no more). A READ whose state NIXL cannot report (``"ERR"``, an exception such
as ``NIXL_ERR_NOT_FOUND``, a post that failed) is never taken as finished: NIXL reports
``NOT_FOUND`` for a READ whose peer's connection was dropped while its bytes go on landing
(seen over UCX), so its pages stay quarantined, counted in ``stats["unconfirmed"]``, until the
engine gives them back. :attr:`KVReceiver.quarantined` lists them;
:meth:`KVReceiver.release_quarantined` gives one back when the engine knows its sender's
process is gone. :meth:`KVReceiver.close` cancels the reservations in flight and waits up to
its ``timeout_s`` (default 5 s) for the quarantined transfers' confirmed ends, giving their
pages back; it returns the ones still quarantined, whose pages stay out of the free list (the
agent and the pool's registration are kept until the last of them is given back, by another
``close()`` or :meth:`KVReceiver.release_quarantined`).

**Connections.** NIXL does not authenticate agent names: a message names its sender, and any
agent can take any name. A receiver binds a sender's name to the first connection it loads for
it (the metadata of its first offer or begin); metadata under a known name that does not load
over that connection (a sender restarted under the same name, an impostor, junk) is refused and
the connection kept (``_nixl.Peers``), so no peer can drop a sender's connection or take its
place (a dropped connection turns that sender's READs in flight to ``NOT_FOUND`` while they
land, and loses its notifications over ~16 KB: both seen over UCX).
:meth:`KVReceiver.forget_sender` drops a connection when the engine knows its process ended (not
while a transfer with it is in progress or quarantined). The other side of the rule: a peer
holding any ticket's token can claim a name that has not sent yet. A sender replaces its
connection to a receiver (a receiver restarted under its name, named by a new ticket) only
while no send to it is in flight, and only once the new metadata has loaded in a probe agent;
a ticket whose metadata does not load leaves the connection as it was.

**Verified arrivals.** A READ lands where the receiver's own descriptors say; a write's begin and
done carry the sender's digest of the ticket (sizes, descriptors, shared pool base), refused
unless it equals the receiver's. ``verify=True`` adds a checksum per layer (``_sums``): the
sender sums ``kv`` (on the GPU for GPU ``kv``), the receiver sums the rows that landed (host
threads) and refuses an arrival whose sums differ.

**Trust boundary** (docs/design.md, "Prefill -> decode"): a pull receiver's tickets carry its
connection details only (``get_partial_agent_metadata`` with no buffer), so a peer holding one
can reach none of its memory through NIXL; the receiver reads what the sender's offer names in
the sender's memory, and the sender's offer carries the keys of ``kv``'s registration only (the
whole buffer given to :meth:`KVSender.register`, when ``kv`` is inside one). A push receiver's
tickets carry the keys of its whole pool (NIXL registers per buffer; UCX over shared memory or
TCP checks no key once a peer holds it): any holder can write any of it and read any of it (a
NIXL READ of any row of the pool, every other request's KV included, with no message to the
receiver), so push senders are trusted, as is every process of the node that can open a
shared pool's file. Keep tickets (they hold the token and the metadata) on the engines' private
control plane.

Ordering: NIXL's UCX backend (``nixlUcxEngine::postXfer`` / ``checkXfer``,
``src/plugins/ucx/ucx_backend.cpp``) posts the writes, then a flush of each endpoint, and sends
the notification (an active message) only once writes and flushes completed, and a UCX flush
completes once the writes are complete at the target (the Python docs: ``notif_msg`` is "sent
after transfer completion"): when a WRITE's *done* arrives, the bytes are in the pool. The status
check that finds the transfer done sends it: a sender that stops polling (or dies) first never
notifies (seen here), which ends as the receiver's timeout, its pages quarantined.

The receiver registers its whole pool: host memory on pages of its own (a ``HostKVPool``'s are;
a heap array sharing a page with another registration is refused). One thread drives each
object. NIXL logs INFO lines to stdout (``NIXL_LOG_LEVEL=WARN``).
UCX_RMA_PPLN_ENABLE is ``y`` unless set (else UCX emulates a GPU -> remote WRITE over TCP).

The files:

- :class:`KVReceiver` (``_receive.py``): the decode side (reservations, tickets, messages,
  :class:`Arrival` / :class:`Polled`), with its page rule and quarantine (``_quarantine.py``:
  how a reservation ends, the record of one);
- :class:`KVSender` (``_send.py``): the prefill side, and its :class:`PendingSend` (a send in
  flight, ``_pending.py``);
- ``_nixl.py``: the NIXL binding and the control messages; ``_ticket.py``: a ticket's checks.

The design and its figures: ``docs/design.md``, "Prefill on another node". Names are imported
on first use.
"""

from .._lazy import lazy

_NAMES = {"Arrival": "_nixl", "KVReceiver": "_receive", "KVSender": "_send",
          "PendingSend": "_pending", "Polled": "_nixl", "Sent": "_nixl", "nixl_api": "_nixl"}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy(__name__, _NAMES)
