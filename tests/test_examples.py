"""The examples, the README's example and the command-line tool run as documented.

Each example runs as its header says, at a small size, under `python -m
grain_jax_sync simulate` (2 processes x 4 devices unless said): several runs
one after the other in one launch (`tests/example_runs.py` calls each
example's ``main(argv)`` with the run's arguments), so that the processes
start once. Every host prints one ``result: {json}`` line per run, and the
tests check its values, each run's checks named on failure.
"""

import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
from helpers import check_each

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
  """Runs `python -m grain_jax_sync ARGS` from the repository root; asserts it succeeded."""
  proc = subprocess.run(
    [sys.executable, "-m", "grain_jax_sync", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert proc.returncode == 0, (
    f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
  )
  return proc


def _cli(*args: str, timeout: float = 240) -> str:
  """Runs `python -m grain_jax_sync ARGS` from the repository root; its stdout."""
  return _run(*args, timeout=timeout).stdout


RUNS = os.path.join(ROOT, "tests", "example_runs.py")
LABELLED = re.compile(r"^\[process (\d+)\] (.*)$", re.M)


class Launch:
  """Example runs in one `simulate` launch of tests/example_runs.py, and what each process printed.

  Each run's lines, per process: its ``loss``, ``eval`` and ``result`` lines
  parsed (`lines`), and every line (`printed_by_every_process`). The runs go one after the other in the
  same processes; a run that fails ends the launch, and `lines` of a run
  that printed no result names it, with the launch's output.
  """

  def __init__(self, runs: dict[str, list[str]], *, processes=2, devices=4, signal=None):
    # The first run's bound includes starting the processes (as one launch's was).
    timeout = 100 * (len(runs) + 1)
    specs = [
      shlex.join([label, os.path.join(ROOT, path), *argv]) for label, (path, *argv) in runs.items()
    ]
    args = ["--processes", str(processes), "--devices", str(devices), "--timeout", str(timeout)]
    args += ["--signal", signal] if signal else []
    self.proc = subprocess.run(
      [sys.executable, "-m", "grain_jax_sync", "simulate", RUNS, *args, "--", *specs],
      cwd=ROOT, capture_output=True, text=True, timeout=timeout + 60,
    )  # fmt: skip
    self.found: dict[str, list[dict[str, list]]] = {}
    self.printed: dict[str, list[list[str]]] = {}
    current: list[str | None] = [None] * processes
    for p, line in LABELLED.findall(self.proc.stdout):
      p = int(p)
      if line.startswith("run: "):
        current[p] = line[len("run: ") :]
        fresh = [{"loss": [], "eval": [], "result": []} for _ in range(processes)]
        self.found.setdefault(current[p], fresh)
        self.printed.setdefault(current[p], [[] for _ in range(processes)])
      elif current[p] is not None:
        entry = self.found[current[p]][p]
        self.printed[current[p]][p].append(line)
        kind, sep, text = line.partition(": ")
        if sep and kind in ("loss", "eval", "result"):
          entry[kind].append(json.loads(text))

  def _output(self) -> str:
    return f"exit {self.proc.returncode}\n{self.proc.stdout[-4000:]}\n{self.proc.stderr[-4000:]}"

  def check_exit(self) -> None:
    assert self.proc.returncode == 0, self._output()

  def lines(self, label: str) -> list[dict[str, list]]:
    """The run's parsed lines per process, after checking that every process printed one result."""
    got = self.found.get(label)
    assert got is not None and [len(g["result"]) for g in got] == [1] * len(got), (
      f"run {label!r} printed no result on every process\n{self._output()}"
    )
    return got

  def printed_by_every_process(self, label: str) -> list[list[str]]:
    """Every line of the run, per process (its lines past the launch's `run:` marker)."""
    assert label in self.printed, f"run {label!r} did not start\n{self._output()}"
    return self.printed[label]

  def results(self, label: str) -> list[dict]:
    """Each process's ``result:`` of the run, in process order."""
    return [g["result"][0] for g in self.lines(label)]


def _ckpt_files(folder) -> list[str]:
  return sorted(f for f in os.listdir(folder) if f.endswith(".json"))


def check_train_masked(outs):
  # Host 1 has 130 examples = 9 batches of 16; host 0 has 100 = 7: the short
  # host gets masked dummies, so both run 9 steps per epoch.
  assert outs[0] == outs[1]
  assert outs[0]["steps"] == 20 * 9
  assert abs(outs[0]["w"] - 3) < 0.05 and abs(outs[0]["b"] - 1) < 0.05


def check_flax_classifier(outs):
  # 201 mock examples: shards of 100 and 101, so 4 steps of 32 rows per host;
  # the masked count is every example once.
  assert outs[0] == outs[1]
  assert outs[0]["steps"] == 4 and outs[0]["examples"] == 201
  # It learns (the label drawn into the mock image): the loss falls, and
  # the accuracy over the 4 steps, the first at a guess, is above a guess's 0.1.
  first, last = outs[0]["loss_first_last"]
  assert last < first - 0.1 and outs[0]["train_accuracy"] > 0.12


def check_exact_eval(outs):
  # Shares of 100 and 201 examples: host 0 runs out after 7 batches and yields
  # dummies until host 1's 13th; every example is counted once.
  assert [o["host_examples"] for o in outs] == [100, 201]
  for o in outs:
    assert o["exact"] is True
    assert (o["examples"], o["id_sum"], o["batches"]) == (301, 301 * 300 // 2, 13)
  assert outs[0]["correct"] == outs[1]["correct"]


def check_drop_ins(outs):
  # 40 + 65 records: 5 batches of 16 per host (host 0 padded, then a dummy).
  for o in outs:
    assert o == {
      "batches": 5,
      "every_record_once": True,
      "real_rows": 105,
      "records": 105,
      "same_batches": True,
      "state_batches": 5,
    }


def check_orbax_resume(outs, ckpt):
  # 50 and 63 records in batches of 8: 8 global batches, saved after 3.
  for o in outs:
    assert o == {
      "batches": 8,
      "restored_step": 3,
      "resumed_equals_uninterrupted": True,
      "same_final_state": True,
    }
  assert _ckpt_files(ckpt / "3" / "data") == ["process_0-of-2.json", "process_1-of-2.json"]


def check_train_flax_orbax(full, stopped, resumed, ckpt):
  # Shards of 300 and 301 examples: 38 steps of 8 rows per host each epoch.
  for runs in (full, stopped, resumed):
    assert runs[0] == runs[1]  # Every host printed the same losses, evals and result.
  assert full[0]["result"] == [{"resumed_from": 0, "step": 76, "stopped_by": None}]
  # Every test example counted once at each epoch's end.
  assert [(e["epoch"], e["examples"]) for e in full[0]["eval"]] == [(1, 601), (2, 601)]
  # It learns (the label drawn into the mock image): more than half right
  # after epoch 1 (a guess: a tenth), more after epoch 2.
  correct = [e["correct"] for e in full[0]["eval"]]
  assert 601 // 2 < correct[0] < correct[1], correct
  assert full[0]["loss"][-1]["loss"] < 0.8 * full[0]["loss"][0]["loss"]
  # Process 1's SIGTERM after its batch 5 stopped every host at one step of epoch 0 (38 steps),
  # within the documented k <= B <= k + 2R (docs/guarantees.md section 10): R counts
  # `decide_ahead_s` of the example's steps, longer than its epoch, so B is checked against it.
  (stop,) = stopped[0]["result"]
  assert stop["stopped_by"] == 1 and 5 <= stop["step"] < 38
  assert stopped[0]["eval"] == []
  files = _ckpt_files(ckpt / str(stop["step"]) / "data")
  assert files == ["process_0-of-2.json", "process_1-of-2.json"]
  # The restart continues from that step: the same losses, bit for bit, and the same evals.
  assert resumed[0]["result"] == [{"resumed_from": stop["step"], "step": 76, "stopped_by": None}]
  losses = stopped[0]["loss"] + resumed[0]["loss"]
  assert [x["step"] for x in losses] == list(range(1, 77))
  assert losses == full[0]["loss"]
  assert resumed[0]["eval"] == full[0]["eval"]


def check_readme(printed):
  # Hosts hold 10 and 11 batches of 32 rows: 11 global batches, 672 real rows.
  for p, lines in enumerate(printed):
    assert f"host {p}: 672 real rows in 11 batches" in lines, lines


def _readme_script(folder) -> str:
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    readme = f.read()
  script = folder / "readme_example.py"
  script.write_text(re.search(r"## Example\n\n```python\n(.*?)```", readme, re.S).group(1))
  return str(script)


FLAX_SMALL = ["--mock-examples", "601", "--batch-size", "8", "--epochs", "2"]


@pytest.mark.multiprocess
@pytest.mark.timeout(100 * 10 + 120)
def test_examples_and_the_readme_example_print_their_documented_values_on_two_hosts(tmp_path):
  for extra in ("tensorflow_datasets", "flax", "optax"):  # The examples' imports.
    pytest.importorskip(extra)
  # One launch, 2 processes x 4 devices, each example at its small size one
  # after the other. train_flax_orbax first: process 1's SIGTERM after its
  # batch 5 (the launch's --signal) stops that run; a restart on its
  # checkpoint and an uninterrupted run follow.
  flax = "examples/train_flax_orbax.py"
  launch = Launch(
    {
      "flax_stopped": [flax, "--ckpt-dir", str(tmp_path / "flax"), *FLAX_SMALL],
      "flax_resumed": [flax, "--ckpt-dir", str(tmp_path / "flax"), *FLAX_SMALL],
      "flax_full": [flax, "--ckpt-dir", str(tmp_path / "flax_full"), *FLAX_SMALL],
      "train_masked": ["examples/train_masked.py", "--epochs", "20"],
      "flax_classifier": [
        "examples/flax_classifier.py", "--mock-examples", "201", "--batch-size", "32"
      ],
      "exact_eval": ["examples/exact_eval.py", "--examples", "301", "--batch-size", "16"],
      "drop_ins": ["examples/drop_ins.py", "--records", "40", "--batch-size", "16"],
      "orbax_resume": ["examples/orbax_resume.py", "--checkpoint-dir", str(tmp_path / "orbax")],
      "readme": [_readme_script(tmp_path)],
    },
    signal="1:SIGTERM:5",
  )  # fmt: skip
  check_each(
    {
      "launch": launch.check_exit,
      "train_flax_orbax": lambda: check_train_flax_orbax(
        *(launch.lines(f"flax_{k}") for k in ("full", "stopped", "resumed")), tmp_path / "flax"
      ),
      "train_masked": lambda: check_train_masked(launch.results("train_masked")),
      "flax_classifier": lambda: check_flax_classifier(launch.results("flax_classifier")),
      "exact_eval": lambda: check_exact_eval(launch.results("exact_eval")),
      "drop_ins": lambda: check_drop_ins(launch.results("drop_ins")),
      "orbax_resume": lambda: check_orbax_resume(
        launch.results("orbax_resume"), tmp_path / "orbax"
      ),
      "readme": lambda: check_readme(launch.printed_by_every_process("readme")),
    }
  )


@pytest.mark.multiprocess
@pytest.mark.timeout(100 * 4 + 120)
def test_hf_text_example_stopped_on_sigterm_and_resumed_equals_the_uninterrupted_run(tmp_path):
  pytest.importorskip("datasets")
  # One launch: process 1's SIGTERM after its batch 4 stops the first run;
  # the restart on its checkpoint and an uninterrupted run follow.
  example, small = "examples/hf_text.py", ["--examples", "400"]
  launch = Launch(
    {
      "stopped": [example, "--ckpt-dir", str(tmp_path / "ckpt"), *small],
      "resumed": [example, "--ckpt-dir", str(tmp_path / "ckpt"), *small],
      "full": [example, "--ckpt-dir", str(tmp_path / "full"), *small],
    },
    signal="1:SIGTERM:4",
  )
  launch.check_exit()
  full, stopped, resumed = (launch.lines(k) for k in ("full", "stopped", "resumed"))
  for runs in (full, stopped, resumed):
    assert runs[0] == runs[1]  # Every host printed the same losses and result.
  # 200 sentences a host, 8 a step: 25 steps an epoch, 2 epochs.
  assert full[0]["result"] == [{"resumed_from": 0, "step": 50, "stopped_by": None}]
  (stop,) = stopped[0]["result"]
  # Within k + 2R (docs/guarantees.md section 10): R counts `decide_ahead_s` of the example's
  # steps, longer than its 50, so the stop is checked to land before the end.
  assert stop["stopped_by"] == 1 and 4 <= stop["step"] < 50
  assert resumed[0]["result"] == [{"resumed_from": stop["step"], "step": 50, "stopped_by": None}]
  losses = stopped[0]["loss"] + resumed[0]["loss"]
  assert losses == full[0]["loss"]  # Exact: the same batches, bit for bit.
  assert full[0]["loss"][-1]["loss"] < 0.5 * full[0]["loss"][0]["loss"]  # It learns.


def check_elastic_resume(saved, outs):
  assert [o["trained_examples"] for o in saved] == [48, 48]  # 3 steps x 2 hosts x 8 rows.
  for o in outs:
    assert o == dict(outs[0], phase="resume", processes=3, exactly_once=True)
    assert o["trained_examples"] == o["kept_examples"] == 160
    assert o["steps"] > 3


def check_lm_mixture(stopped, resumed, ckpt):
  stop = stopped[0]["step"]
  # Process 1's SIGTERM after its batch 3 stopped both hosts at one step, and each saved there:
  # within k + 2R (docs/guarantees.md section 10), R counting `decide_ahead_s` of the example's
  # steps, longer than its 40, so the stop is checked to land before the end.
  assert stopped[0]["stopped_by"] == 1 and 3 <= stop < 40
  assert _ckpt_files(ckpt / str(stop) / "data") == ["process_0-of-2.json", "process_1-of-2.json"]
  for runs, n in ((stopped, 2), (resumed, 3)):
    for r in runs:  # Every host agrees; one packed shape, compiled before the loop.
      assert {k: v for k, v in r.items() if k != "shares_this_host"} == {
        k: v for k, v in runs[0].items() if k != "shares_this_host"
      }
      assert r["processes"] == n and r["specs"] == [[4 * n, 64]] and r["compiles_in_loop"] == 0
      assert r["documents_whole_once"] is True
  last = resumed[0]
  assert last["resumed_from"] == stop and last["step"] == 40 and last["stopped_by"] is None
  docs = last["documents_per_source"]
  assert sum(docs) > sum(stopped[0]["documents_per_source"]) > 0
  # The 1:2:5 weights, short of the documents still in the packers' open rows.
  assert np.allclose(np.divide(docs, sum(docs)), [1 / 8, 2 / 8, 5 / 8], atol=0.03), docs
  for r in resumed:
    assert np.allclose(r["shares_this_host"], [1 / 8, 2 / 8, 5 / 8], atol=0.03)
  assert last["loss_first_last"][1] < 0.6 * stopped[0]["loss_first_last"][0]  # It learns.


@pytest.mark.multiprocess
@pytest.mark.timeout(2 * 100 * 3 + 120)
def test_lm_mixture_and_elastic_resume_examples_stopped_on_2_hosts_resume_on_3_every_record_once(
  tmp_path,
):
  # Two launches of 2 devices a process: on 2 processes, lm_mixture stopped
  # by process 1's SIGTERM after its batch 3, then elastic_resume's save
  # phase; on 3 processes, both resume from their checkpoints.
  lm, lm_ckpt = "examples/lm_mixture.py", ["--ckpt-dir", str(tmp_path / "lm")]
  elastic = ["examples/elastic_resume.py", "--checkpoint-dir", str(tmp_path / "elastic")]
  on_2 = Launch(
    {"lm_mixture": [lm, *lm_ckpt], "elastic_resume": [*elastic, "--phase", "save"]},
    devices=2,
    signal="1:SIGTERM:3",
  )
  on_3 = Launch(
    {"lm_mixture": [lm, *lm_ckpt], "elastic_resume": [*elastic, "--phase", "resume"]},
    processes=3,
    devices=2,
  )
  check_each(
    {
      "launch on 2 processes": on_2.check_exit,
      "launch on 3 processes": on_3.check_exit,
      "lm_mixture": lambda: check_lm_mixture(
        on_2.results("lm_mixture"), on_3.results("lm_mixture"), tmp_path / "lm"
      ),
      "elastic_resume": lambda: check_elastic_resume(
        on_2.results("elastic_resume"), on_3.results("elastic_resume")
      ),
    }
  )


# `python -m grain_jax_sync` as if tqdm were not installed.
WITHOUT_TQDM = (
  "import runpy, sys; sys.modules['tqdm'] = None;"
  " runpy.run_module('grain_jax_sync', run_name='__main__', alter_sys=True)"
)


@pytest.mark.multiprocess
def test_demo_command_prints_agreed_batches_and_plain_progress_without_tqdm():
  proc = subprocess.run(
    [sys.executable, "-c", WITHOUT_TQDM, "demo"],
    cwd=ROOT, capture_output=True, text=True, timeout=240,
  )  # fmt: skip
  assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
  out = proc.stdout
  # Progress, on stderr: plain lines of batches summed over the 2 hosts, rising to 6/6.
  progress = [line for line in proc.stderr.splitlines() if line.startswith("batches (all hosts)")]
  done = [int(re.fullmatch(r"batches \(all hosts\): (\d+)/6", line)[1]) for line in progress]
  assert done and done == sorted(set(done)) and done[-1] == 6, progress
  assert "every host yielded 3 batches; 27 of 27 records seen once each: True" in out
  assert (
    "batch 2: global (16,) features bfloat16; this host: 0 real + 8 padded rows; global mask sum 1"
    in out
  )
  # stats() per host: host 0 has 10 records (8 + 2, then a dummy), host 1 has 17 (8 + 8 + 1).
  table = out.split("stats() per host", 1)[1].splitlines()[1:4]
  assert table[0].split()[:6] == [
    "host", "batches", "real_rows", "padded_rows", "dummy_batches", "dropped_batches"
  ]  # fmt: skip
  assert table[1].split()[:6] == ["0", "3", "10", "14", "1", "0"]
  assert table[2].split()[:6] == ["1", "3", "17", "7", "0", "0"]
  # The same counts in the cross-host view as host 1 sees it (host 0's from process 0's decisions).
  job = out.split("stats(all_hosts=True) on host 1", 1)[1].splitlines()[1:4]
  assert job[0].split()[-1] == "padding_fraction"
  assert job[1].split()[:6] == ["0", "3", "10", "14", "1", "0"]
  assert job[2].split()[:6] == ["1", "3", "17", "7", "0", "0"]
  assert job[1].split()[-1] == f"{14 / 24:.4f}"


def test_doctor_reports_devices_and_extras(capsys):
  from grain_jax_sync import __main__ as cli

  assert cli.main(["doctor"]) == 0
  out = capsys.readouterr().out
  assert "processes 1 (this: 0), devices 8 (local 8)" in out
  assert "grain: installed" in out and "key-value store client: no" in out
  assert (
    "default mesh: 1-D 'data' axis over 8 devices; one slice: create_device_mesh"
    " (topology-aware order)\n  device ids in mesh order: [0, 1, 2, 3, 4, 5, 6, 7];"
    " slices: none reported\n" in out
  )
  assert "(from the default mesh): 8 data shards; process 0 feeds data shards" in out


@pytest.mark.multiprocess
@pytest.mark.parametrize(
  "target", ["examples.train_masked:train", "examples/train_masked.py:train"]
)
def test_simulate_runs_a_function_by_module_or_path_with_keyword_arguments(target):
  out = _cli("simulate", target, "-n", "2", "-d", "2", "epochs=1", "--batch-size=16")
  lines = [line for line in out.splitlines() if line.startswith("process ")]
  assert len(lines) == 2 and all(": ok; value={" in line for line in lines)
  assert lines[0].split("value=")[1] == lines[1].split("value=")[1]
  assert "'steps': 9" in lines[0]  # One epoch of 9 agreed batches.


def test_simulate_passes_arguments_to_the_script_verbatim(tmp_path):
  script = tmp_path / "echo.py"
  script.write_text("import sys, jax\nprint('argv', sys.argv[1:], jax.process_count())\n")
  out = _cli("simulate", str(script), "-n", "1", "-d", "1", "--steps", "3", "--", "-n", "5")
  assert "argv ['--steps', '3', '-n', '5'] 1" in out


def test_simulate_script_failure_exits_non_zero_with_the_error(tmp_path):
  script = tmp_path / "fail.py"
  script.write_text("raise SystemExit('bad input')\n")
  proc = subprocess.run(
    [sys.executable, "-m", "grain_jax_sync", "simulate", str(script), "-n", "1", "-d", "1"],
    cwd=ROOT, capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert proc.returncode == 1
  assert "FAILED: builtins.RuntimeError" in proc.stdout and "'bad input'" in proc.stdout


def test_simulate_help_shows_the_defaults():
  out = " ".join(_cli("simulate", "--help", timeout=60).split())  # As wrapped at any width.
  assert "simulated hosts (default: 2)" in out
  assert "CPU devices per process (default: 4)" in out
  assert "seconds before every process is killed (default: 300.0)" in out
  assert "--signal PROCESS:SIGNAL:BATCH" in out and "(default: [])" not in out


UNMASKED = """
import jax
import numpy as np
import grain_jax_sync as gjs

shard = [{"x": np.ones(4, np.float32)}] * (2 + jax.process_index())
with gjs.iter_jax_batches(shard, batch_size=4, paddings=0) as it:  # No mask_key: a warning.
  print(f"host {jax.process_index()}: {sum(1 for _ in it)} batches")
"""


SIGNALLED = """
import signal
import jax
import numpy as np
import grain_jax_sync as gjs

got = []
with gjs.iter_jax_batches([{"x": np.ones(4, np.float32)}] * 5, batch_size=4) as it:
  signal.signal(signal.SIGINT, lambda *_: got.append(it.get_state()["batches"]))
  n = sum(1 for _ in it)
print(f"host {jax.process_index()}: {n} batches, SIGINT at {got}")
"""


@pytest.mark.multiprocess
def test_simulate_labels_every_process_output_and_warning_and_signals_one_process(tmp_path):
  # One run: the signalled iterator (SIGINT after batch 2 on process 1), then
  # the unmasked one (a library warning on every process).
  script = tmp_path / "signalled_then_unmasked.py"
  script.write_text(SIGNALLED + UNMASKED)
  proc = _run(
    "simulate", str(script), "-n", "2", "-d", "2", "--signal", "1:INT:2", "--timeout", "120",
    timeout=180,
  )  # fmt: skip
  # --signal: one process, after its batch 2.
  assert "[process 0] host 0: 5 batches, SIGINT at []" in proc.stdout
  assert "[process 1] host 1: 5 batches, SIGINT at [2]" in proc.stdout
  sent = "] grain_jax_sync: testing signal_at: sending SIGINT to this process after batch 2"
  assert [line[: line.index("]") + 1] for line in proc.stderr.splitlines() if sent in line] == [
    "[process 1]"
  ]
  # Every process's output and the library's warnings, labelled.
  out, err = proc.stdout.splitlines(), proc.stderr.splitlines()
  assert "[process 0] host 0: 3 batches" in out and "[process 1] host 1: 3 batches" in out
  assert out[-2:] == ["== process 0: ok ==", "== process 1: ok =="]
  for p in (0, 1):  # Logged by the library in processes that succeeded.
    warned = [line for line in err if line.startswith(f"[process {p}] grain_jax_sync: `paddings`")]
    assert len(warned) == 1 and "`mask_key` is not" in warned[0]


@pytest.mark.parametrize(
  "signal_arg,error",
  [
    ("1:SIGFOO:2", "expected PROCESS:SIGNAL:BATCH such as 1:SIGTERM:5, got '1:SIGFOO:2'"),
    ("1:TERM", "expected PROCESS:SIGNAL:BATCH such as 1:SIGTERM:5, got '1:TERM'"),
    (
      "5:TERM:2",
      "simulate: `signal_at` must hold SignalAt values for distinct processes in [0, 2)",
    ),
  ],
)
def test_simulate_refuses_a_bad_signal_option(tmp_path, signal_arg, error):
  script = tmp_path / "never.py"
  script.write_text("raise AssertionError('never runs')\n")
  proc = subprocess.run(
    [sys.executable, "-m", "grain_jax_sync", "simulate", str(script), "--signal", signal_arg],
    cwd=ROOT, capture_output=True, text=True, timeout=60,
  )  # fmt: skip
  assert proc.returncode == 2 and error in proc.stderr
