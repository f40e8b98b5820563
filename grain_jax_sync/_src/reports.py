"""What one host reports for a window, and its wire form.

Every host reads up to a window of batches and reports what it got: the row
count of each batch, how its stream ended (`ReportedError` for an error), and,
in its first window, its structure and settings. `plan.decide` takes one
report per host; the exchange carries them as compact JSON (`Report.to_obj`).

Pure Python: no JAX, no I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping, Sequence
from typing import Any


class ErrorKind(enum.StrEnum):
  """How a reported error is raised on each host."""

  # Bad data or settings: every host raises ValueError with the same text.
  VALUE = "value"
  # The source itself raised: the failing host re-raises its own exception,
  # the others raise RuntimeError naming the failing process.
  SOURCE = "source"
  # A process closed (or dropped) its iterator: the others raise RuntimeError.
  CLOSED = "closed"
  # A live process did not report within `sync_timeout_s`: PeerTimeoutError.
  TIMEOUT = "timeout"
  # A process stopped its liveness beat (it died): PeerLostError.
  LOST = "lost"
  # A process asked every host to stop (`request_stop()`): every host ends
  # its stream normally at the same position; nothing is raised.
  STOPPED = "stopped"


# Endings that end the stream at once, whatever positions are still undecided
# (rows a process posted beyond such an ending are void).
ABORTS = frozenset({ErrorKind.CLOSED, ErrorKind.TIMEOUT, ErrorKind.LOST, ErrorKind.STOPPED})


@dataclasses.dataclass(frozen=True)
class ReportedError:
  """An error one host hit while reading its window."""

  kind: ErrorKind
  message: str
  process_index: int
  batch_index: int
  type_name: str = "ValueError"
  # Processes the ending is about (TIMEOUT and LOST: the awaited ones).
  missing: tuple[int, ...] = ()

  def to_json(self) -> list[Any]:
    return [
      self.kind.value,
      self.message,
      self.process_index,
      self.batch_index,
      self.type_name,
      list(self.missing),
    ]

  @classmethod
  def from_json(cls, obj: Sequence[Any]) -> ReportedError:
    kind, message, pi, bi, tn, *rest = obj
    missing = tuple(rest[0]) if rest else ()
    return cls(ErrorKind(kind), message, pi, bi, tn, missing)


@dataclasses.dataclass(frozen=True)
class Report:
  """What one host read in one window.

  Attributes:
    process_index: The reporting process.
    rows: Row count of each batch read in this window, in order.
    exhausted: True if the source ended after those batches.
    error: Set if reading or validating the batch after `rows` failed.
    signature: The host's batch structure, once it has seen a batch.
    local_devices: The data shards the host's local devices hold (its local
      rows divide among them): ``jax.local_device_count()`` unless a model
      axis replicates rows.
    config: The host's settings (first window only), compared across hosts.
    more: True if the host holds at least one more batch after `rows` (it
      read ahead). Without it the last of `rows` counts as the host's last
      batch when a short batch is judged.
    resume: The output batch the host resumes at (first window only),
      compared across hosts.
    digests: Where processes share rows: a digest of the rows of each batch
      in `rows` (`sharding.rows_digest`), compared beside `decide`
      (`agreement.decide`); empty otherwise.
    sizes: With `pad_shapes`: per batch in `rows`, its sizes of the varying
      dims (`batches.HostBatch.sizes`); empty otherwise (nothing on the wire).
  """

  process_index: int
  rows: tuple[int, ...] = ()
  exhausted: bool = False
  error: ReportedError | None = None
  signature: dict[str, Any] | None = None
  local_devices: int = 1
  config: dict[str, Any] | None = None
  more: bool = False
  resume: int | None = None
  digests: tuple[str | None, ...] = ()
  sizes: tuple[tuple[int, ...], ...] = ()

  def to_json(self) -> str:
    return json.dumps(self.to_obj(), separators=(",", ":"))

  def to_obj(self) -> dict[str, Any]:
    """The report as a JSON-ready object (only the fields that differ from their defaults)."""
    obj: dict[str, Any] = {
      "p": self.process_index,
      "r": list(self.rows),
      "x": self.exhausted,
      "d": self.local_devices,
    }
    if self.error is not None:
      obj["e"] = self.error.to_json()
    if self.signature is not None:
      obj["s"] = self.signature
    if self.config is not None:
      obj["c"] = self.config
    if self.more:
      obj["m"] = True
    if self.resume is not None:
      obj["b"] = self.resume
    if self.digests:
      obj["h"] = list(self.digests)
    if self.sizes:
      obj["z"] = [list(z) for z in self.sizes]
    return obj

  @classmethod
  def from_json(cls, text: str) -> Report:
    return cls.from_obj(json.loads(text))

  @classmethod
  def from_obj(cls, obj: Mapping[str, Any]) -> Report:
    error = ReportedError.from_json(obj["e"]) if "e" in obj else None
    return cls(
      process_index=obj["p"],
      rows=tuple(obj["r"]),
      exhausted=obj["x"],
      error=error,
      signature=obj.get("s"),
      local_devices=obj["d"],
      config=obj.get("c"),
      more=obj.get("m", False),
      resume=obj.get("b"),
      digests=tuple(obj.get("h", ())),
      sizes=tuple(tuple(z) for z in obj.get("z", ())),
    )
