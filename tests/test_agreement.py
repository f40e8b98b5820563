"""The streamed agreement, driven for 2 to 6 simulated processes over random schedules.

Each simulated process is a thread running the real protocol code (`Reader`,
`Decider` / `Follower`, `KeyValueExchange`, `Ledger`, `plan.decide`, the
liveness beat) over one shared in-memory store (`memory_store.MemoryStore`,
the client's methods). Hypothesis draws the per-process batches (row counts,
empty batches), the window (`synchronize_lookahead`), random read delays, and
endings on random processes at random positions: exhausted, failed (the source
raises), closed (the consumer stops after k batches and closes) and timed out
(a process stalls in its source beyond `sync_timeout_s`). Options: `paddings`
(so the promise is exact: with no error every real row once, dummies where a
process ran out).

Properties:
* every process that did not close ends the same way: all stop, or all raise
  the same message (the failing process re-raises its own exception);
* every process yields the same decided positions (a closing one a prefix);
* every real row is yielded at most once, in source order, and exactly once
  when the stream stopped without error or close;
* the streamed decisions equal `plan.decide` applied to the whole reports
  (window by window is the same, position by position), and with an abort
  (close, timeout) they are a prefix of it;
* nothing is left in the store once every process ended.
"""

from __future__ import annotations

import base64
import json
import pickle
import random
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grain_jax_sync._src import (
  messages,
  plan,
  prefetch,
  reader,
  sources,
)
from grain_jax_sync._src.agreement import common, core, decider, driver, endings, follower, ledger
from grain_jax_sync._src.exchange import key_value
from grain_jax_sync._src.memory_store import MemoryStore

RULES = plan.Rules(batch_size=8, drop_last=False, pad=True)
TIMEOUT_S = 0.4  # Where a schedule stalls a process on purpose (real threads, real time).
STALL_S = 1.2
NO_STALL_TIMEOUT_S = 30.0  # Elsewhere: a loaded machine must not time a healthy run out.
EXAMPLES = 40


class _Closed(Exception):
  pass


def _ids(p, b, n):
  return 100_000 * p + 100 * b + np.arange(n, dtype=np.int32)


def _source(p, spec, seed):
  rng = random.Random(seed)
  for b, n in enumerate(spec["rows"]):
    if "read_s" in spec:
      time.sleep(spec["read_s"])  # Every read takes this long.
    elif rng.random() < 0.3:
      time.sleep(rng.random() * 0.003)
    if spec["ending"] == "failed" and b == spec["at"]:
      raise OSError(f"disk on fire at batch {b}")
    if spec["ending"] == "timeout" and b == spec["at"]:
      time.sleep(STALL_S)
    yield {"x": _ids(p, b, n)}


def _agreement(p, n, store, source, *, lookahead, timeout_s, rules=RULES, built=None):
  """Process p's side of the streamed agreement (decider or follower) over `store`."""
  read = reader.Reader(sources.open_source(source), process_index=p, check_int32=False)
  ex = key_value.KeyValueExchange(store, "grain_jax_sync/prop", process_index=p, process_count=n)
  who = common.Identity(process=p, devices=1, config={"batch_size": 8}, resume=0)
  return _driven(read, ex, rules, who, lookahead=lookahead, timeout_s=timeout_s, built=built)


def _driven(read, ex, rules, who, *, lookahead, timeout_s, built=None):
  """The core of process `who.process`, driven over `ex` as the session drives it inline."""
  kind = decider.Decider if who.process == 0 else follower.Follower
  core = kind(
    rules,
    who,
    namespace=ex.namespace,
    process_count=ex.process_count,
    lookahead=lookahead,
    timeout_s=timeout_s,
    position=0,
    threaded=built is not None,
    paced=False,
  )
  return driver.Driver(core, read, ex, built)


def _host(p, n, store, spec, lookahead, seed, out, rules=RULES, timeout_s=NO_STALL_TIMEOUT_S):
  source = _source(p, spec, seed)
  stage = _agreement(p, n, store, source, lookahead=lookahead, timeout_s=timeout_s, rules=rules)
  record, yielded = [], 0
  runs = iter(stage)
  try:
    for run in runs:
      for r, step in run.steps:
        ids = None if r is None else np.asarray(r.batch.leaves[0]).tolist()
        record.append((step.action.value, step.rows, ids))
        yielded += step.action == messages.Action.YIELD
        if spec["ending"] == "closed" and yielded >= spec["at"]:
          raise _Closed()
    out[p] = ("stop", record, None)
  except _Closed:
    runs.close()
    stage.ask(core.Closing(yielded))
    stage.post_ending()
    out[p] = ("closed", record, None)
  except BaseException as e:  # noqa: BLE001 - compared by the test.
    out[p] = ("raise", record, e)


@st.composite
def schedules(draw):
  n = draw(st.integers(2, 6))
  hosts = []
  for p in range(n):
    rows = draw(st.lists(st.integers(0, 8), max_size=7))
    ending = draw(
      st.sampled_from(["exhausted"] * 6 + ["failed", "closed"] + (["timeout"] if p else []))
    )
    at = (
      draw(st.integers(0, max(0, len(rows) - 1))) if ending != "closed" else draw(st.integers(1, 4))
    )
    if ending in ("failed", "timeout") and not rows:
      ending = "exhausted"
    hosts.append({"rows": rows, "ending": ending, "at": at})
  timeouts = [p for p, h in enumerate(hosts) if h["ending"] == "timeout"]
  for p in timeouts[1:]:  # At most one stalled process per schedule (each costs a second).
    hosts[p]["ending"] = "exhausted"
  return n, hosts, draw(st.integers(1, 4)), draw(st.integers(0, 2**16))


def _expected(n, hosts, rules=RULES):
  """`plan.decide` over every process's whole report (what a windowed exchange decides)."""
  reports = []
  for p, h in enumerate(hosts):
    stop = h["at"] if h["ending"] in ("failed", "timeout") else len(h["rows"])
    if h["ending"] == "timeout":
      stop = len(h["rows"])  # A stalled process still has all its rows.
    rows = tuple(x for x in h["rows"][:stop] if x)
    error = None
    if h["ending"] == "failed":
      position = len(rows)
      e = OSError(f"disk on fire at batch {h['at']}")
      end = endings.failed(p, position, h["at"], e, f"reading batch {h['at']} from its source")
      error = end.error
    reports.append(
      messages.Report(process_index=p, rows=rows, exhausted=error is None, error=error)
    )
  return plan.decide(reports, rules)


def _in_threads(n, args_of):
  """Runs `target(*args)` for each process p, `(target, args) = args_of(p)`; fails on a hang."""
  threads = [threading.Thread(target=args_of(p)[0], args=args_of(p)[1]) for p in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  assert not any(t.is_alive() for t in threads), "a simulated process hangs"


def _run(n, hosts, lookahead, seed, rules=RULES):
  store = MemoryStore()
  out: dict = {}
  stalls = any(h["ending"] == "timeout" for h in hosts)
  timeout_s = TIMEOUT_S if stalls else NO_STALL_TIMEOUT_S
  _in_threads(
    n, lambda p: (_host, (p, n, store, hosts[p], lookahead, seed + p, out, rules, timeout_s))
  )
  return store, out


def _real_ids(record):
  return [i for _, _, ids in record if ids is not None for i in ids]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules())
def test_every_process_ends_the_same_way_and_rows_are_conserved(schedule):
  _check_schedule(schedule, RULES)


# Where a short batch's fate depends on whether it is its host's last: the
# decider waits for that host's next batch (or end), never guesses.
WAITING = [
  plan.Rules(batch_size=None, drop_last=False, pad=True, wait_for_last=True),
  plan.Rules(batch_size=None, drop_last=True, pad=False, wait_for_last=True),
  plan.Rules(batch_size=8, drop_last=True, pad=False, wait_for_last=True),
  plan.Rules(batch_size=8, drop_last=True, pad=True, wait_for_last=True),
]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules(), st.sampled_from(WAITING))
def test_waiting_for_the_last_batch_decides_as_if_every_end_were_known(schedule, rules):
  _check_schedule(schedule, rules)


def _check_schedule(schedule, rules):
  """Runs one schedule over the in-memory store and checks every property, in turn."""
  n, hosts, lookahead, seed = schedule
  store, out = _run(n, hosts, lookahead, seed, rules)
  assert store.keys() == []  # Nothing left behind.
  ended = [p for p in range(n) if out[p][0] != "closed"]
  outcomes, texts = _check_one_ending(n, hosts, out, ended)
  steps = _check_same_positions(n, out)
  _check_rows_at_most_once(n, hosts, out, outcomes, rules)
  _check_decided_as_planned(n, hosts, out, ended, rules, steps, outcomes, texts)


def _check_one_ending(n, hosts, out, ended):
  """Every process that ended ends the same way, with one message; returns both."""
  outcomes = {out[p][0] for p in ended}
  assert len(outcomes) <= 1, {p: out[p][0] for p in range(n)}
  texts = set()
  for p in ended:
    e = out[p][2]
    if isinstance(e, OSError):  # The failing process: its own exception.
      assert hosts[p]["ending"] == "failed"
    elif e is not None:
      texts.add(str(e))
  assert len(texts) <= 1, texts
  return outcomes, texts


def _check_same_positions(n, out):
  """Every process acts on the same positions (a closing one on a prefix); returns them."""
  longest = max((out[p][1] for p in range(n)), key=len)
  steps = [(a, rows) for a, rows, _ in longest]
  for p in range(n):
    mine = [(a, rows) for a, rows, _ in out[p][1]]
    assert mine == steps[: len(mine)]
    if out[p][0] != "closed":
      assert len(mine) == len(steps)
  return steps


def _check_rows_at_most_once(n, hosts, out, outcomes, rules):
  """Real rows: at most once, in source order; exactly once without error or close."""
  for p in range(n):
    got = _real_ids(out[p][1])
    fed = [i for b, x in enumerate(hosts[p]["rows"]) for i in _ids(p, b, x).tolist()]
    assert got == fed[: len(got)]
    stopped = outcomes == {"stop"} and all(out[q][0] != "closed" for q in range(n))
    if stopped and not rules.drop_last:  # `drop_last` stops at the shortest host.
      assert got == fed


def _check_decided_as_planned(n, hosts, out, ended, rules, steps, outcomes, texts):
  """The streamed decisions are `plan.decide`'s (a prefix of them when a run was cut short)."""
  want = _expected(n, hosts, rules)
  want_steps = [(s.action.value, s.rows) for s in want.steps]
  aborted = any(out[p][0] == "closed" for p in range(n)) or any(
    isinstance(out[p][2], endings.PeerTimeoutError) for p in ended
  )
  if aborted:
    assert steps == want_steps[: len(steps)]
  else:
    assert steps == want_steps
    assert outcomes == ({"stop"} if want.end == messages.Outcome.STOP else {"raise"})
    if want.error is not None and want.error.kind == messages.ErrorKind.VALUE:
      assert texts == {want.error.message}


def test_decisions_are_o1_per_position_and_chunks_go_to_process_0_only():
  # 4 processes x 30 batches: the store holds no per-process decision data.
  n = 4
  hosts = [{"rows": [8] * 30, "ending": "exhausted", "at": 0} for _ in range(n)]
  store, out = _run(n, hosts, 10, 0)
  assert {out[p][0] for p in range(n)} == {"stop"}, {p: out[p][2] for p in range(n)}
  assert all(len(out[p][1]) == 30 for p in range(n))
  assert store.keys() == []


class _Recording(MemoryStore):
  """Keeps every chunk and decision written, in order."""

  def __init__(self):
    super().__init__()
    self.chunks: list[messages.Chunk] = []
    self.decisions: list[messages.Decision] = []
    self.rows_posted_at: list[int] = []  # Per decision: the follower's rows posted before it.

  def key_value_set(self, key, value, allow_overwrite=False):
    if "/s/" in key:
      self.chunks.append(messages.Chunk.from_json(value))
    elif "/d/" in key:
      self.decisions.append(messages.Decision.from_json(value))
      self.rows_posted_at.append(sum(len(c.report.rows) for c in self.chunks))
    super().key_value_set(key, value, allow_overwrite)


def _run_recorded(hosts, lookahead):
  store = _Recording()
  out: dict = {}
  _in_threads(len(hosts), lambda p: (_host, (p, len(hosts), store, hosts[p], lookahead, p, out)))
  assert {out[p][0] for p in range(len(hosts))} == {"stop"}, {p: v[2] for p, v in out.items()}
  assert [len(out[p][1]) for p in range(len(hosts))] == [len(h["rows"]) for h in hosts]
  return store


def test_a_quick_source_is_posted_by_half_the_read_ahead_and_decided_just_ahead():
  # Lookahead 4: a host holds at most 4 undecided batches and posts every 2,
  # except its first read, posted at once: the job waits for the first batch.
  hosts = [{"rows": [8] * 300, "ending": "exhausted", "at": 0, "read_s": 0.0}] * 2
  store = _run_recorded(hosts, 4)
  sizes = [len(c.report.rows) for c in store.chunks if c.report.rows]
  assert sum(sizes) == 300 and sizes[0] == 1 and sizes[-1] == 1, sizes
  assert set(sizes[1:-1]) == {2}, sizes
  decided = [len(d.steps) for d in store.decisions if d.steps]
  assert sum(decided) == 300
  assert max(decided) <= 4, decided  # Never beyond what every host has read.


def test_a_slow_source_is_posted_by_the_same_rule_as_a_quick_one():
  # No timer: how long a read takes changes nothing in what is posted when
  # (the first read at once, then every half read-ahead, then the rest).
  hosts = [{"rows": [8] * 6, "ending": "exhausted", "at": 0, "read_s": 0.012}] * 2
  store = _run_recorded(hosts, 4)
  assert [len(c.report.rows) for c in store.chunks if c.report.rows] == [1, 2, 2, 1]
  # Process 0 decides what every host posted when it looks: how many a
  # decision carries depends on when it looks (a loaded machine merges the
  # last two), never on the read time; no decision runs ahead of the rows.
  decided = 0
  for d, posted in zip(store.decisions, store.rows_posted_at, strict=True):
    decided += len(d.steps)
    assert decided <= posted, (decided, posted)
  assert decided == 6 and len(store.decisions[0].steps) == 1


class _BuildProgress:
  """The build thread's progress as the read-ahead counts it (`common.Built`): one position a step."""

  def __init__(self):
    self._done = 0
    self._advanced = threading.Condition()

  def done(self):
    return self._done

  def wait_done(self, beyond, timeout_s):
    with self._advanced:
      if self._done <= beyond:
        self._advanced.wait(timeout_s)

  def advance(self):
    with self._advanced:
      self._done += 1
      self._advanced.notify()


def _host_beside_a_step(p, n, store, rows, lookahead, step_s, out):
  """The agreement in its own thread, as the session runs it, and a consumer that steps."""
  spec = {"rows": [8] * rows, "ending": "exhausted", "at": 0, "read_s": 0.0}
  built = _BuildProgress()
  source = _source(p, spec, p)
  stage = _agreement(p, n, store, source, lookahead=lookahead, timeout_s=5.0, built=built)
  runs = prefetch.Prefetcher(iter(stage), buffer_size=1, in_hand=False)
  ids = []
  for run in runs:
    for r, _ in run.steps:
      time.sleep(step_s)  # The training step, then the build thread takes the next one.
      ids.append(int(np.asarray(r.batch.leaves[0])[0]))
      built.advance()
  runs.close()
  out[p] = ids


def test_beside_a_step_a_quick_source_is_posted_and_decided_in_runs_of_half_the_read_ahead():
  # Lookahead 10 beside a 10 ms step: once the build thread holds decided
  # positions, each host waits for it to take half the read-ahead and then
  # posts (process 0: decides) 5 at a time, not one batch per batch taken.
  store, out = _Recording(), {}
  _in_threads(2, lambda p: (_host_beside_a_step, (p, 2, store, 60, 10, 0.01, out)))
  for p in (0, 1):
    assert out[p] == [100_000 * p + 100 * b for b in range(60)]  # Every batch, in order.
  sizes = [len(c.report.rows) for c in store.chunks if c.report.rows]
  decided = [len(d.steps) for d in store.decisions if d.steps]
  assert sum(sizes) == 60 and sum(decided) == 60
  assert max(decided) <= 10, decided  # Never beyond what every host has read.
  # The first reads go at once (nothing decided yet); then runs of 5, and
  # what is left at the end (one batch per batch taken would be 60 runs).
  assert max(sizes) <= 5, sizes
  for runs in (sizes, decided):
    assert runs.count(5) >= 6 and len(runs) <= 24, runs


def _host_first_batch(p, n, store, read_s, reads_at_first, prefetch_thread):
  """Records how many reads this host had completed when its first decided run arrived."""
  done = []

  def source():
    for b in range(6):
      time.sleep(read_s)
      done.append(b)
      yield {"x": _ids(p, b, 8)}

  built = _BuildProgress() if prefetch_thread else None
  stage = _agreement(p, n, store, source(), lookahead=10, timeout_s=5.0, built=built)
  runs = prefetch.Prefetcher(iter(stage), buffer_size=1, in_hand=False) if built else iter(stage)
  ids = []
  for run in runs:
    reads_at_first.setdefault(p, len(done))
    for r, _ in run.steps:
      ids.append(int(np.asarray(r.batch.leaves[0])[0]))
      if built is not None:
        built.advance()
  if built is not None:
    runs.close()
  reads_at_first[(p, "ids")] = ids


@pytest.mark.parametrize("prefetch_thread", [True, False], ids=["build thread", "inline"])
def test_the_first_batch_is_decided_after_one_read_on_every_host(prefetch_thread):
  # The job waits for the stream's first batch: each host posts its first
  # read at once and waits in the store for the first decision, rather than
  # read a second batch first (which took two reads of a slow source).
  store, out = MemoryStore(), {}
  _in_threads(2, lambda p: (_host_first_batch, (p, 2, store, 0.2, out, prefetch_thread)))
  for p in (0, 1):
    assert out[(p, "ids")] == [100_000 * p + 100 * b for b in range(6)]
    assert out[p] == 1, out


def _run_some(n, store, hosts, runners):
  out: dict = {}
  threads = [
    threading.Thread(target=_host, args=(p, n, store, hosts[p], 2, p, out)) for p in runners
  ]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=30)
  assert not any(t.is_alive() for t in threads)
  return out


def test_a_peer_on_another_protocol_version_gets_the_same_clear_error_everywhere():
  # Process 1 runs a future version: its first chunk is not one this version reads.
  store = MemoryStore()
  store.key_value_set("grain_jax_sync/prop/s/1/0/0", '{"v": 99, "rows": "whatever"}')
  hosts = [{"rows": [8, 8], "ending": "exhausted", "at": 0}] * 3
  out = _run_some(3, store, hosts, [0, 2])
  want = (
    "the processes run different versions of the grain_jax_sync agreement protocol"
    " (process 0: 3, process 1: 99); every process must run the same version of the library"
  )
  for p in (0, 2):
    assert out[p][0] == "raise"
    assert type(out[p][2]) is ValueError and str(out[p][2]) == want


def test_a_decision_from_another_protocol_version_raises_a_clear_error():
  store = MemoryStore()
  store.key_value_set("grain_jax_sync/prop/d/0/0", '{"v": 1, "steps": []}')
  hosts = [{"rows": [8, 8], "ending": "exhausted", "at": 0}] * 2
  out = _run_some(2, store, hosts, [1])
  assert out[1][0] == "raise" and type(out[1][2]) is ValueError
  assert str(out[1][2]).startswith(
    "the processes run different versions of the grain_jax_sync agreement protocol"
    " (process 0: 1, process 1: 3)"
  )


def test_a_chunk_that_does_not_parse_raises_naming_the_process():
  store = MemoryStore()
  store.key_value_set("grain_jax_sync/prop/s/1/0/0", "not json")
  hosts = [{"rows": [8], "ending": "exhausted", "at": 0}] * 2
  out = _run_some(2, store, hosts, [0])
  assert type(out[0][2]) is ValueError
  assert str(out[0][2]).startswith("process 1 posted a report that is not JSON")


# -- a crafted signature in the store: refused as data, never run -----------------

RAN: list[str] = []  # What a crafted pickle ran, were it unpickled.


def _ran(what: str) -> None:
  RAN.append(what)


class _Payload:
  """Unpickled, it calls `_ran`: the code anything that reaches the store could run."""

  def __reduce__(self):
    return (_ran, ("the crafted pickle",))


def _crafted_signature() -> dict:
  """A batch signature whose registered node carries a pickle (the old wire form's "p")."""
  payload = base64.b64encode(pickle.dumps(_Payload())).decode("ascii")
  node = {"o": "builtins:object", "a": "PyTreeDef(*)", "c": [["x", "*"]], "p": payload}
  return {"spec": node, "leaves": [["x", "int32", []]]}


def test_the_crafted_pickle_would_run_code_if_unpickled():
  RAN.clear()
  pickle.loads(base64.b64decode(_crafted_signature()["spec"]["p"]))  # noqa: S301 - the point.
  assert RAN == ["the crafted pickle"]
  RAN.clear()


def test_a_decision_with_a_crafted_signature_is_refused_and_nothing_runs():
  RAN.clear()
  store = MemoryStore()
  decision = {"v": messages.PROTOCOL_VERSION, "j": 0, "st": [["yield", 8, 1]], "e": "continue"}
  store.key_value_set(
    "grain_jax_sync/prop/d/0/0", json.dumps({**decision, "g": _crafted_signature()})
  )
  hosts = [{"rows": [8, 8], "ending": "exhausted", "at": 0}] * 2
  out = _run_some(2, store, hosts, [1])
  assert out[1][0] == "raise" and type(out[1][2]) is ValueError
  message = str(out[1][2])
  assert message.startswith(
    "process 0 posted a decision that does not parse (ValueError: a batch structure with"
    " {'o': 'builtins:object', 'a': 'PyTreeDef(*)', 'c': [['x', '*']], 'p': "
  )
  assert "which is not a tree spec" in message
  assert RAN == []


def test_a_report_with_a_crafted_signature_is_the_same_error_on_every_host_and_nothing_runs():
  RAN.clear()
  store = MemoryStore()
  report = {"p": 1, "r": [8], "x": True, "d": 1, "s": _crafted_signature()}
  chunk = {"v": messages.PROTOCOL_VERSION, "s": 0, "a": 0, "R": report}
  store.key_value_set("grain_jax_sync/prop/s/1/0/0", json.dumps(chunk))
  hosts = [{"rows": [8, 8], "ending": "exhausted", "at": 0}] * 3
  out = _run_some(3, store, hosts, [0, 2])
  assert str(out[0][2]) == str(out[2][2])  # Word for word.
  for p in (0, 2):
    assert out[p][0] == "raise" and type(out[p][2]) is ValueError
    assert str(out[p][2]).startswith(
      "process 1 posted a report that does not parse (ValueError: a batch structure with {'o':"
    )
  assert RAN == []


# -- processes that share rows: digests beside the decision ----------------------


def _shared_reports(digests_1: tuple[str, ...]) -> list[messages.Report]:
  rows = (8, 8, 8)
  return [
    messages.Report(process_index=0, rows=rows, exhausted=True, digests=("a", "b", "c")),
    messages.Report(process_index=1, rows=rows, exhausted=True, digests=digests_1),
    messages.Report(process_index=2, rows=rows, exhausted=True, digests=("x", "y", "z")),
  ]


def test_shared_rows_that_agree_decide_as_plan_decide():
  reports = _shared_reports(("a", "b", "c"))
  got = plan.decide(reports, RULES, position=4, groups=((0, 1), (2,)))
  assert got == plan.decide(reports, RULES, position=4)
  assert got.end == messages.Outcome.STOP and len(got.steps) == 3


def test_shared_rows_that_differ_cut_the_plan_and_raise_naming_the_batch():
  reports = _shared_reports(("a", "b", "C"))
  got = plan.decide(reports, RULES, position=4, groups=((0, 1), (2,)))
  assert len(got.steps) == 2 and got.end == messages.Outcome.RAISE
  assert got.error is not None and got.error.kind == messages.ErrorKind.VALUE
  assert got.error.message.startswith(
    "batch 6: processes [0, 1] hold the same data shards (input shard 0) and must feed"
  )
  assert "process 0: c, process 1: C" in got.error.message
  # Without groups (no shared rows) the digests are not looked at.
  assert plan.decide(reports, RULES, position=4, groups=()).end == messages.Outcome.STOP


def test_a_group_of_dummy_batches_is_not_compared():
  # Process 2, alone in its group, reads 3 batches; the pair (0, 1) one each.
  reports = _shared_reports(("a",))
  for p in (0, 1):
    reports[p] = messages.Report(process_index=p, rows=(8,), exhausted=True, digests=("a",))
  got = plan.decide(reports, RULES, position=0, groups=((0, 1), (2,)))
  assert got.end == messages.Outcome.STOP
  assert [(s.real_rows[0], s.real_rows[1], s.real_rows[2]) for s in got.steps] == [
    (8, 8, 8),
    (0, 0, 8),
    (0, 0, 8),
  ]


def test_a_dummy_batch_beside_its_replicas_rows_raises_naming_both():
  # Process 1 ran out; process 0, which holds the same shards, did not: the
  # plan stands up to batch 0 and every host raises the same error.
  reports = _shared_reports(("a",))
  reports[1] = messages.Report(process_index=1, rows=(8,), exhausted=True, digests=("a",))
  got = plan.decide(reports, RULES, position=0, groups=((0, 1), (2,)))
  assert got.end == messages.Outcome.RAISE and len(got.steps) == 1
  assert got.error.kind == messages.ErrorKind.VALUE
  assert got.error.message.startswith(
    "batch 1: processes [0, 1] hold the same data shards (input shard 0) and must feed"
    " identical rows, but process 1 had no batch 1 (its source ended) while process 0 had one"
  )


def test_digests_travel_in_chunks_and_the_ledger_keeps_them_per_position():
  led = ledger.Ledger(2, digests=True)
  led.add_rows(0, 8, "a")
  led.add_rows(0, 8, "b")
  sent = messages.Report(process_index=1, rows=(8, 8), digests=("a", "c"))
  led.add(messages.Chunk.from_json(messages.Chunk(start=0, ack=0, report=sent).to_json()))
  reports = led.window_reports(0, led.window(0), with_config=False)
  assert [r.digests for r in reports] == [("a", "b"), ("a", "c")]
  led.forget(1)
  assert [r.digests for r in led.window_reports(1, 1, with_config=False)] == [("b",), ("c",)]
  # Without digests kept (rows not shared), reports carry none.
  plain = ledger.Ledger(1)
  plain.add_rows(0, 8, "a")
  assert plain.window_reports(0, 1, with_config=False)[0].digests == ()


def _shared_host(p, n, store, data, groups, lookahead, out):
  read = reader.Reader(
    sources.open_source(iter(data)),
    process_index=p,
    check_int32=False,
    digest=reader.rows_digest,
  )
  ex = key_value.KeyValueExchange(store, "grain_jax_sync/shared", process_index=p, process_count=n)
  who = common.Identity(process=p, devices=1, config=None, resume=0, groups=groups)
  stage = _driven(read, ex, RULES, who, lookahead=lookahead, timeout_s=5.0)
  record = []
  try:
    for run in stage:
      record += [None if r is None else r.batch.leaves[0].tolist() for r, _ in run.steps]
    out[p] = (record, None)
  except BaseException as e:  # noqa: BLE001 - compared by the test.
    out[p] = (record, e)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
  n=st.integers(2, 5),
  batches=st.integers(1, 6),
  lookahead=st.integers(1, 4),
  differ=st.one_of(st.none(), st.tuples(st.integers(0, 4), st.integers(0, 5))),
)
def test_shared_rows_are_compared_in_the_streamed_agreement(n, batches, lookahead, differ):
  # Processes 2k and 2k + 1 share an input shard and load its rows; one process
  # may load other rows from batch `at` on.
  groups = tuple(tuple(range(s, min(s + 2, n))) for s in range(0, n, 2))
  bad, at = differ if differ is not None else (None, batches)
  if bad is not None and (bad >= n or len(groups[bad // 2]) < 2 or at >= batches):
    bad, at = None, batches  # Nobody shares its rows, or it differs past its end.
  data = []
  for p in range(n):
    shard = p // 2
    data.append(
      [{"x": _ids(shard + (100 if p == bad and b >= at else 0), b, 8)} for b in range(batches)]
    )
  store, out = MemoryStore(), {}
  _in_threads(n, lambda p: (_shared_host, (p, n, store, data[p], groups, lookahead, out)))
  for p in range(n):
    record, error = out[p]
    assert record == [d["x"].tolist() for d in data[p][:at]]  # Every batch before `at`.
    if bad is None:
      assert error is None
    else:
      assert isinstance(error, ValueError)
      assert str(error).startswith(f"batch {at}: processes {list(groups[bad // 2])} hold")
  assert len({str(out[p][1]) for p in range(n)}) == 1


def test_a_peer_found_closed_is_named_with_the_stream_it_closed_in():
  note = json.dumps(["ns/1", "process 1 closed its iterator at batch 40"])
  # Closed in this stream without posting its ending (a stage thread of its blocked).
  assert endings.closed_peer_message(note, "ns/1") == "process 1 closed its iterator at batch 40"
  # Closed in an earlier stream: it never started this one.
  assert endings.closed_peer_message(note, "ns/2") == (
    "process 1 closed its iterator at batch 40, without starting the stream that"
    " other processes restarted (reset(), set_state()): every process must restart"
    " it at the same point"
  )
  assert endings.closed_peer_message("not json", "ns/2").startswith("not json, without starting")


def _yields(run) -> int:
  return sum(step.action == messages.Action.YIELD for _, step in run.steps)


def _peer(p: int, store, spec, out) -> threading.Thread:
  """Process `p` of two in a thread: ``out[p]`` is ("end" or its error, batches yielded)."""

  def run() -> None:
    got = 0
    try:
      for r in _agreement(p, 2, store, _source(p, spec, 0), lookahead=2, timeout_s=5.0):
        got += _yields(r)
      out[p] = ("end", got)
    except RuntimeError as e:
      out[p] = (str(e), got)

  thread = threading.Thread(target=run)
  thread.start()
  return thread


def test_a_close_on_its_way_decides_no_more_and_its_ending_carries_the_count_asked_after():
  store, spec, out = MemoryStore(), {"rows": [8] * 40, "ending": "stop"}, {}
  thread = _peer(0, store, spec, out)
  stage = _agreement(1, 2, store, _source(1, spec, 0), lookahead=2, timeout_s=5.0)
  runs, got = iter(stage), 0
  while got < 3:
    got += _yields(next(runs))
  stage.ask(core.CLOSING)  # A close from another thread: the count is not known yet.
  assert list(runs) == []  # Nothing more is decided here.
  stage.ask(core.Closing(got))  # The call returned: the ending, with its count.
  stage.post_ending()
  thread.join(30)
  message, received = out[0]
  assert message.startswith(f"process 1 closed its iterator at batch {got}"), message
  assert got <= received < 40


def test_an_ending_asked_while_a_decision_is_posted_goes_after_it_not_over_it():
  # A close (or restart) asked while process 0's post of decision 2 is in
  # flight: the post lands, and the ending must be decision 3. Posted over
  # decision 2, a follower that read 2 waits for 3 until it finds process 0
  # closed, and raises the wrong error (CI, a reset under load).
  store, spec, out = MemoryStore(), {"rows": [8] * 40, "ending": "stop"}, {}
  thread = _peer(1, store, spec, out)
  stage = _agreement(0, 2, store, _source(0, spec, 0), lookahead=2, timeout_s=5.0)
  ex, posted, got = stage._exchange, [], [0]
  real = ex.post_decision

  def post_decision(seq: int, payload: str, *, final: bool = False) -> None:
    real(seq, payload, final=final)
    posted.append((seq, messages.Decision.from_json(payload), final))
    if seq == 2 and not final:
      stage.ask(core.Closing(got[0]))  # From another thread, as the post returns.

  ex.post_decision = post_decision
  for run in stage:
    got[0] += _yields(run)
  thread.join(30)
  assert [(seq, final) for seq, _, final in posted] == [
    (0, False),
    (1, False),
    (2, False),
    (3, True),
  ]
  decided = sum(s.action == messages.Action.YIELD for _, d, _ in posted[:3] for s in d.steps)
  message, received = out[1]
  assert message.startswith(f"process 0 closed its iterator at batch {got[0]}"), message
  assert received == decided  # Every position decided before the ending, then the ending.


@pytest.mark.parametrize("closer", [0, 1])
@pytest.mark.parametrize("at_call", range(1, 13))
def test_an_ending_asked_as_any_store_call_returns_reaches_the_peer(closer, at_call):
  # Whatever the closer's agreement was doing in the store (a post, a read, a
  # wait), its ending reaches the peer after the positions decided before it.
  store, spec, out = MemoryStore(), {"rows": [8] * 40, "ending": "stop"}, {}
  thread = _peer(1 - closer, store, spec, out)
  stage = _agreement(closer, 2, store, _source(closer, spec, 0), lookahead=2, timeout_s=5.0)
  ex, calls, got = stage._exchange, [0], [0]
  real = ex._call

  def call(*args, **kwargs):
    try:
      return real(*args, **kwargs)
    finally:
      calls[0] += 1
      if calls[0] == at_call:
        stage.ask(core.Closing(got[0]))  # From another thread, as this call returns.

  ex._call = call
  for run in stage:
    got[0] += _yields(run)
  thread.join(30)
  message, received = out[1 - closer]
  assert message.startswith(f"process {closer} closed its iterator at batch {got[0]}"), message
  assert received >= got[0]
