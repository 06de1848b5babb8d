"""Stores: backends keyed by block hash, and the one connector that drives any of them.

A store is two small protocols, one per side, each opened by the backend for its own side (they
may live in different processes):

- :class:`StoreIndex` (scheduler side): how long a prefix of keys the store holds, and — for a store
  whose placement the scheduler decides (the CPU tier assigns its slots there) — reservations for
  loads and saves, whose results travel to the worker inside the plan (``BlockLoad.source``,
  ``BlockSave.target``), and their release.
- :class:`StoreIO` (worker side): load keys into blocks, save blocks under keys.

:class:`StoreBackend` turns the pair into the full connector contract with :class:`StoreScheduler`
and :class:`StoreWorker`, which every store shares, over the core's :mod:`kvbridge.lifecycle`:
lookup, allocation, the step plan, loads and saves on a background thread, failure reports.
A save never runs inside the forward pass: ``finish_step`` hands it to the IO thread, and a request
that ends with a save in flight keeps its blocks (``delay_free``) until the save is over.

Modules: :mod:`.base` (what a store author writes against), :mod:`.scheduler` and :mod:`.worker`
(the two sides every store shares), :mod:`.backend` (the backend that ties them).
"""

from kvbridge.store.backend import StoreBackend
from kvbridge.store.base import LayerwiseIO, StoreIndex, StoreIO
from kvbridge.store.scheduler import StoreScheduler
from kvbridge.store.worker import StoreWorker

__all__ = ["LayerwiseIO", "StoreBackend", "StoreIO", "StoreIndex", "StoreScheduler", "StoreWorker"]
