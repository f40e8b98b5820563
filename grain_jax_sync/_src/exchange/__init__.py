"""Moves reports and decisions between processes. Knows nothing about batches.

Three transports: `LocalExchange` (one process, or synchronization off),
`KeyValueExchange` (the key-value store) and `CollectiveExchange` (the
fallback without a store client). `streams.py` names each iterator's keys.
Only this package talks to other processes.
"""

from __future__ import annotations

import logging

from grain_jax_sync._src.exchange.collective import CollectiveExchange
from grain_jax_sync._src.exchange.key_value import KeyValueExchange, distributed_client

logger = logging.getLogger(__name__)


class LocalExchange:
  """No communication: each process decides alone."""

  busy_s = 0.0  # Nothing is exchanged.

  def __init__(self, process_index: int = 0):
    self.process_index = process_index
    self.process_count = 1

  def all_gather(self, window: int, payload: str) -> list[str]:
    del window
    return [payload]


def make_exchange(
  *, synchronize: bool, namespace: str | None
) -> LocalExchange | KeyValueExchange | CollectiveExchange:
  """Picks the transport for this process (the caller starts its liveness beat)."""
  import jax  # pylint: disable=g-import-not-at-top

  index, count = jax.process_index(), jax.process_count()
  if count == 1 or not synchronize:
    return LocalExchange(index)
  client = distributed_client()
  if client is not None:
    assert namespace is not None
    return KeyValueExchange(client, namespace, process_index=index, process_count=count)
  logger.info("grain_jax_sync: no key-value store client; exchanging via collectives")
  return CollectiveExchange(process_index=index, process_count=count)


__all__ = ["LocalExchange", "make_exchange"]
