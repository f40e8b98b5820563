"""The agreement protocol: this host's reads + the exchange -> decided runs.

Two forms, one decision (`plan.decide`); import each name from its module:

* `lockstep.Lockstep`: every process reads a window, the reports are
  all-gathered and every process decides the same plan (one process, and the
  collective fallback).
* Streamed, over the key-value store (`decider.Decider` on process 0, with its
  `ledger.Ledger`; `follower.Follower` on the others; `streamed.Streamed`):
  the others post their rows (and ending) in chunks as they read; process 0
  decides each position once every process's row (or ending) for it is known
  and posts the decision, which every process acts on.

Endings. Exhausted and failed are decided in order with the rows; closed,
timed out and lost end the stream at once. A process posts its ending before
it raises or stops, and yields only decided positions.
"""
