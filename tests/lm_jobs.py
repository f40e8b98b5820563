"""Mixture and packing jobs: in one process over `ElasticIterator`s (no JAX), and on real processes.

`play` runs every process of a job in this process, as the library would on
each host; `lm_job` is one real process of a multi-process job.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

import grain_jax_sync as gjs
from grain_jax_sync._src import options as options_lib
from grain_jax_sync._src.sources.elastic import resume as resume_lib
from grain_jax_sync._src.sources.elastic.stream import ElasticIterator

WEIGHTS = (1, 2, 5)


def rows(k: int, n: int) -> list[dict[str, Any]]:
  """Source `k`'s `n` records: which source, which record."""
  return [{"s": np.int32(k), "i": np.int32(i)} for i in range(n)]


def texts(k: int, n: int) -> list[dict[str, Any]]:
  """Source `k`'s `n` token sequences: record ``(k, i)`` is ``1 + (7i + k) % 40`` tokens of one id."""
  return [{"tok": np.full(1 + (7 * i + k) % 40, 1 + 10_000 * k + i, np.int32)} for i in range(n)]


def documents(n: int, seed: int = 0) -> list[dict[str, Any]]:
  """`n` documents of 1 to 1,000 tokens: token ``i`` of document ``d`` is ``1000 d + i + 1``."""
  lengths = np.random.default_rng(seed).integers(1, 1001, n)
  return [{"tok": (1000 * d + 1 + np.arange(k)).astype(np.int32)} for d, k in enumerate(lengths)]


def document_pieces(batches: Any) -> dict[int, list[np.ndarray]]:
  """Each document's pieces (token offsets), in the order packed rows deliver them.

  `batches`: jobs, each a list per process of its batches. Checks that each
  piece's positions go on from the document's start (`restart_positions` off).
  """
  out: dict[int, list[np.ndarray]] = {}
  for job in batches:
    for per_process in job:
      for b in per_process:
        for tok, seg, pos in zip(
          *(np.asarray(b[k]) for k in ("tok", "tok_segment_ids", "tok_positions")), strict=True
        ):
          assert np.all(tok[seg == 0] == 0)
          for s in np.unique(seg[seg > 0]):
            offsets = tok[seg == s] % 1000 - 1
            assert np.array_equal(pos[seg == s], offsets)
            out.setdefault(int(tok[seg == s][0]) // 1000, []).append(offsets)
  return out


def token_counts(sources: list[list[dict[str, Any]]]) -> dict[int, int]:
  """Each record's id and its tokens."""
  return {int(r["tok"][0]): len(r["tok"]) for s in sources for r in s}


def packed_records(batch: dict[str, Any]) -> list[tuple[int, int]]:
  """(record id, tokens) of each segment of packed rows, checking its segment ids and positions."""
  out = []
  for tok, seg, pos in zip(
    *(np.asarray(batch[k]) for k in ("tok", "tok_segment_ids", "tok_positions")), strict=True
  ):
    assert np.all(tok[seg == 0] == 0) and np.all(pos[seg == 0] == 0)
    used = np.flatnonzero(seg)
    assert np.array_equal(used, np.arange(len(used)))  # Tokens first, then padding.
    assert np.all(np.diff(seg[used]) >= 0)  # Segments in order, from 1.
    for s in np.unique(seg[used]):
      m = seg == s
      assert np.array_equal(pos[m], np.arange(m.sum()))
      assert len(set(tok[m].tolist())) == 1
      out.append((int(tok[m][0]), int(m.sum())))
  return out


def mixture(kind: str, sizes: tuple[int, ...], batch: int, **kwargs: Any) -> gjs.ElasticSource:
  """The sources of `sizes` mixed 1:2:5; ``kind`` "rows" batches records, "pack" packs texts.

  ``kind`` "docs": no mixture, ``documents(sizes[0])`` packed at length 64.
  """
  if kind == "docs":

    def pack(ds: Any) -> Any:
      return gjs.pack_sequences(ds, length=64).batch(batch)

    return gjs.elastic_source(documents(sizes[0]), pack, **kwargs)
  if kind == "rows":
    sources = [rows(k, n) for k, n in enumerate(sizes)]
    return gjs.elastic_mixture(sources, WEIGHTS, lambda ds: ds.batch(batch), **kwargs)
  sources = [texts(k, n) for k, n in enumerate(sizes)]

  def transform(ds: Any) -> Any:
    return gjs.pack_sequences(ds, length=64, num_bins=4).batch(batch)

  return gjs.elastic_mixture(sources, WEIGHTS, transform, **kwargs)


def settings(batch_size: int) -> dict[str, Any]:
  """The settings digest of `iter_jax_batches` with `batch_size`, ``paddings=0``, a mask."""
  keywords = {"batch_size": batch_size, "paddings": 0, "mask_key": "mask"}
  return options_lib.make("iter_jax_batches", keywords, process_count=1).digest()


def export(its: list[ElasticIterator], batches: int, digest: Any = "s") -> list[dict[str, Any]]:
  """Every process's iterator-level state after `batches` batches (as `get_state` frames it)."""
  return [
    {
      "process_index": i,
      "process_count": len(its),
      "batches": batches,
      "settings": digest,
      "version": 1 if digest == "s" else 2,
      "source": json.loads(json.dumps(it.export_state(it.get_state()))),
    }
    for i, it in enumerate(its)
  ]


def play(
  src: Any,
  count: int,
  steps: int | None,
  states: list[Any] | None = None,
  batch_size: int | None = None,
):
  """A job of `count` processes in one process: each reads `steps` batches (None: all).

  `batch_size`: the states carry `settings` of it, and a resume checks them as
  `iter_jax_batches` does. Returns (each process's batches, every process's
  state after them).
  """
  its = [ElasticIterator(src, index=p, count=count) for p in range(count)]
  digest = "s" if batch_size is None else settings(batch_size)
  if states is not None:
    for p, it in enumerate(its):
      mine = resume_lib.for_this_process(
        it, states, process_index=p, process_count=count, settings=digest
      )
      assert mine["settings"] == digest  # What `options.check_state` compares.
      it.set_state(mine["source"])
  out = []
  for it in its:
    got = []
    while steps is None or len(got) < steps:
      try:
        got.append(next(it))
      except StopIteration:
        break
    out.append(got)
  return out, export(its, steps or 0, digest)


# -- real processes -------------------------------------------------------------------


def lm_job(
  kind: str,
  sizes: tuple[int, ...],
  batch: int,
  directory: str,
  name: str,
  load: str | None,
  steps: int | None,
) -> dict[str, Any]:
  """One process of a job: resume from job `load`'s states, read `steps` global batches, save.

  Returns the global batches (lists), this host's `stats()` sources and its state.
  """
  import jax
  from jax.experimental import multihost_utils

  src = mixture(kind, sizes, batch, seed=3, num_epochs=None if kind == "rows" else 1)
  it = gjs.iter_jax_batches(src, batch_size=batch, paddings=0, mask_key="mask")
  if load is not None:
    folder = os.path.join(directory, load)
    states = []
    for f in sorted(os.listdir(folder)):
      with open(os.path.join(folder, f)) as file:
        states.append(json.load(file))
    it.set_state(states)
  out = []
  for b in it:
    g = {
      k: np.asarray(multihost_utils.process_allgather(v, tiled=True)).tolist() for k, v in b.items()
    }
    out.append(g)
    if steps is not None and len(out) == steps:
      break
  state = it.get_state()
  os.makedirs(os.path.join(directory, name), exist_ok=True)
  with open(os.path.join(directory, name, f"state_{jax.process_index():03d}.json"), "w") as f:
    json.dump(state, f)
  # Every process's state is on disk before any process starts a job that loads them.
  multihost_utils.sync_global_devices(f"lm_job {name}: states saved")
  sources = it.stats().get("sources")
  it.close()
  return {"batches": out, "sources": sources, "state": state}


def mixed_by_process(weights: list[list[float]], seeds: list[int]) -> str:
  """One process of a job whose process `p` mixes two sources by ``weights[p]``, ``seeds[p]``:
  its batch count, or the error it raised."""
  import jax

  p = jax.process_index()
  src = gjs.elastic_mixture(
    [rows(0, 10), rows(1, 20)], weights[p], lambda ds: ds.batch(8), seed=seeds[p], num_epochs=1
  )
  try:
    with gjs.iter_jax_batches(src, batch_size=8, paddings=0, mask_key="mask") as it:
      return f"{sum(1 for _ in it)} batches"
  except ValueError as e:
    return str(e)


def run_jobs(
  count: int,
  devices: int,
  kind: str,
  sizes: tuple[int, ...],
  batch: int,
  directory: str,
  jobs: dict,
) -> dict[str, list[dict[str, Any]]]:
  """`lm_job`s, ``{name: (load, steps)}``, in turn in one launch of count x devices processes.

  A job may load the states of a job before it in `jobs` or of an earlier
  launch. Returns each job's value per process, after checking that every
  process gathered the same global batches; a job that raises is named.
  """
  from helpers import TIMEOUT, run_cases

  cases = {
    name: (lm_job, (kind, sizes, batch, directory, name, load, steps), {})
    for name, (load, steps) in jobs.items()
  }
  by_process = run_cases(count, devices, cases, timeout_s=TIMEOUT * len(jobs))
  out = {name: [values[name] for values in by_process] for name in jobs}
  for name, outs in out.items():
    assert all(o["batches"] == outs[0]["batches"] for o in outs), name
  return out
