"""Prefill on another node: a request's KV carried into the decode host's page pool over NIXL.

- :class:`KVReceiver` (``_receive.py``): the decode side (reservations, tickets, quarantine,
  :class:`Arrival` / :class:`Polled`);
- :class:`KVSender` (``_send.py``): the prefill side, and its :class:`PendingSend` (a send in
  flight, ``_pending.py``);
- ``_nixl.py``: the NIXL binding and the control messages; ``_ticket.py``: a ticket's checks.

The protocol and its trust boundary: ``docs/design.md``, "Prefill on another node". Names are
imported on first use.
"""

from .._lazy import lazy

_NAMES = {"Arrival": "_nixl", "KVReceiver": "_receive", "KVSender": "_send",
          "PendingSend": "_pending", "Polled": "_nixl", "Sent": "_nixl", "nixl_api": "_nixl"}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy(__name__, _NAMES)
