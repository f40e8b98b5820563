"""The agreement protocol: this host's reads + the exchange -> decided runs.

Two forms, one decision (`plan.decide`); import each name from its module:

* `lockstep.Lockstep`: every process reads a window, the reports are all-gathered and
  every process decides the same plan. One process (no exchange) and the
  collective fallback (which runs in the caller's thread) use it.
* Streamed (`decider.Decider` on process 0, with its `ledger.Ledger`;
  `follower.Follower` on the others; `streamed.Streamed`, what both share):
  the key-value store. Every process other than 0 posts its rows
  (and its ending) in chunks as it reads; process 0, the decider, reads every
  chunk, decides each position as soon as every process's row (or ending) for
  it is known and posts the decision; every process, process 0 included, acts
  on the same decisions, so every host yields the same batches and ends the
  same way, with the same message.

Endings. Every ending is a report with a position: exhausted and failed
(from the reader, at the position of the failed read) are decided in order
with the rows; closed (posted by `Streamed.close`), timed out and lost (found
by the decider while it waits) end the stream at once. A process posts its
ending before it raises or stops, and yields only decided positions.
"""
