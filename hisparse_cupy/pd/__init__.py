"""Prefill on another node: a request's KV carried into the decode host's page pool over NIXL.

- :mod:`.receive`: :class:`KVReceiver`, the decode side (reservations, tickets, quarantine,
  :class:`Arrival` / :class:`Polled`);
- :mod:`.send`: :class:`KVSender`, the prefill side, and :mod:`.pending`: its
  :class:`PendingSend` (a send in flight);
- :mod:`._nixl`: the NIXL binding and the control messages; :mod:`._ticket`: a ticket's checks.

The protocol and its trust boundary: ``docs/design.md``, "Prefill on another node". Names are
imported on first use.
"""

from .._lazy import lazy

_NAMES = {"Arrival": "_nixl", "KVReceiver": "receive", "KVSender": "send",
          "PendingSend": "pending", "Polled": "_nixl", "Sent": "_nixl", "nixl_api": "_nixl"}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy(__name__, _NAMES)
