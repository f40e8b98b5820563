"""Two processes waiting crosswise at the start of two streams: named, not timed out.

Process a waits for the first decision of a stream that b has not started,
and b for one that a has not started. Each beat carries the streams its
process waits on (`exchange_streams.waiting_first`): both find it, with one message.
"""

from __future__ import annotations

import logging
import time

from grain_jax_sync._src import liveness as liveness_lib
from grain_jax_sync._src import messages
from grain_jax_sync._src.agreement import endings
from grain_jax_sync._src.exchange import key_value
from grain_jax_sync._src.exchange import streams as exchange_streams

logger = logging.getLogger(__name__)

# Two processes that each wait at the start of a stream the other has not
# started (iterators created or started in a different order: a stream starts
# at its first `next()`) can never go on. Named after this long crosswise, or half
# `sync_timeout_s` if shorter: longer than a live peer takes between the
# first `next()` calls of iterators it starts together (threads), on any host.
CROSS_WAIT_S = 30.0


class CrossWait:
  """Watches, while this process waits for a peer, whether the peer waits crosswise."""

  def __init__(
    self, exchange: key_value.KeyValueExchange, live: liveness_lib.Liveness, timeout_s: float
  ):
    self._exchange = exchange
    self._live = live
    self._timeout_s = timeout_s
    self._since: float | None = None  # Since when a peer waits crosswise.

  def check(self, peer: int, at_batch: int) -> messages.ReportedError | None:
    """The error once `peer` has waited long enough at the start of a stream not started here.

    `at_batch`: output batches before this stream's first (nothing is decided yet).
    """
    exchange_streams.waiting_first(self._exchange.namespace, True)
    # Streams of iterators made here but not started: an iterator never made
    # here is the timeout's case (created on some processes only).
    theirs = [
      t
      for t in self._live.waiting(peer)
      if t != self._exchange.namespace
      and exchange_streams.is_created(t)
      and not exchange_streams.is_started(t)
    ]
    now = time.monotonic()
    if not theirs:
      self._since = None
      return None
    if self._since is None:
      self._since = now
    if now - self._since < min(CROSS_WAIT_S, self._timeout_s / 2):
      return None
    return self._end_both(peer, theirs[0], at_batch)

  def _end_both(self, peer: int, theirs: str, at_batch: int) -> messages.ReportedError:
    """The crosswise error, posted also to the peer's stream, where it waits."""
    waits = sorted([(self._exchange.process_index, self._exchange.namespace), (peer, theirs)])
    (a, sa), (b, sb) = waits
    message = (
      f"process {a} waits for the first batch of iterator {_iterator(sa)!r} and"
      f" process {b} for that of iterator {_iterator(sb)!r}, and neither has"
      f" started the other's: {endings.order_cause()}"
    )
    error = messages.ReportedError(
      messages.ErrorKind.CLOSED, message, peer, at_batch, "RuntimeError", (peer,)
    )
    # The same ending in the peer's stream, where it waits: whichever of the
    # two finds it first, both raise this message (not a close of the other).
    exchange_streams.pre_end(theirs, message)
    try:
      post_end(self._exchange.sibling(theirs), 0, error)
    except Exception as e:  # noqa: BLE001 - the peer still finds it itself.
      logger.warning("grain_jax_sync: could not post the ending to %s: %s", theirs, e)
    return error

  def done(self) -> None:
    """This process no longer waits for its stream's first decision."""
    exchange_streams.waiting_first(self._exchange.namespace, False)


def _iterator(namespace: str) -> str:
  """An iterator's key prefix, without its stream's generation."""
  return namespace.rsplit("/", 1)[0]


def post_end(
  ex: key_value.KeyValueExchange, at_batch: int, error: messages.ReportedError | None
) -> None:
  """Posts this host's ending (closed, or `error`) to a stream it never started.

  As the stream's first and final decision (process 0) or chunk (any other).
  """
  p = ex.process_index
  error = error or endings.closed_error(p, at_batch)
  try:
    if p == 0:
      final = messages.Decision(0, (), messages.Outcome.RAISE, error)
      ex.post_decision(0, final.to_json(), final=True)
    else:
      report = messages.Report(process_index=p, error=error, local_devices=1)
      ex.post_chunk(messages.Chunk(start=0, ack=0, report=report).to_json(), final=True)
  finally:
    ex.end()
