"""The documentation: the site builds without warnings and its code runs.

Every ```python block in docs/*.md and README.md is one of:

* run as it is: each block on its own, with its own imports, in a fresh
  namespace and working directory (a page's blocks share one interpreter
  with 8 CPU devices, in order; a block sees no name an earlier one made);
* first line ``# Runs under simulate``: run as its own script under
  ``python -m grain_jax_sync simulate FILE --processes 2 --devices 4``;
* first line ``# Needs ...`` (a multi-host job, your data, MaxText): shown,
  not run; the line says what it needs and, where there is one, which
  example runs the same thing.

README's "Example" block is run under simulate by tests/test_examples.py, and
alone as one process here.
Fences without a language (or ``text``) are commands and output, not code.
"""

import ast
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

import grain_jax_sync
from grain_jax_sync import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
SIMULATE = "# Runs under simulate"
NEEDS = "# Needs "
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)


def _pages() -> list[str]:
  names = sorted(f for f in os.listdir(DOCS) if f.endswith(".md"))
  return [os.path.join(DOCS, f) for f in names] + [os.path.join(ROOT, "README.md")]


def _located_blocks(path: str) -> list[tuple[int, str]]:
  """Each block with the page line its code starts on."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  example = "## Example\n\n```python\n"  # README's: it runs in test_examples.py.
  at = text.find(example) if path.endswith("README.md") else -1
  skip = at + len(example) if at >= 0 else -1
  return [
    (text.count("\n", 0, m.start(1)) + 1, m.group(1))
    for m in FENCE.finditer(text)
    if m.start(1) != skip
  ]


def _blocks(path: str) -> list[str]:
  return [block for _, block in _located_blocks(path)]


def _kind(block: str) -> str:
  first = block.lstrip().splitlines()[0] if block.strip() else ""
  if first.startswith(SIMULATE):
    return "simulate"
  if first.startswith(NEEDS):
    return "needs"
  return "run"


PAGES = [p for p in _pages() if _blocks(p)]


def test_every_python_block_parses():
  for page in PAGES:
    for block in _blocks(page):
      ast.parse(block, filename=page)  # Even a snippet that is only shown.


# Runs a page's blocks, each as the `__main__` script `block_<line>.py` in a
# directory of its own, and names every block that raised. The script's lines
# are the page's (blank lines before the block), so tracebacks point there.
_RUNNER = """
import json, os, sys, traceback, types

page, blocks = json.load(open(sys.argv[1]))
failed = []
for line, code in blocks:
  where = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), f"block_{line}")
  os.makedirs(where)
  os.chdir(where)
  path = os.path.join(where, f"block_{line}.py")
  with open(path, "w") as f:
    f.write("\\n" * (line - 1) + code)
  main = types.ModuleType("__main__")
  main.__file__ = path
  sys.modules["__main__"] = main  # The simulator's processes import it from there.
  try:
    exec(compile("\\n" * (line - 1) + code, path, "exec"), main.__dict__)
  except BaseException:
    failed.append(line)
    print(f"{page}: the block at line {line} raised:", file=sys.stderr)
    traceback.print_exc()
sys.exit(f"blocks that raised, by line: {failed}" if failed else 0)
"""


@pytest.mark.parametrize(
  "page", [p for p in PAGES if any(_kind(b) == "run" for b in _blocks(p))], ids=os.path.basename
)
def test_page_python_blocks_run_each_on_its_own(page, tmp_path):
  blocks = [(line, b) for line, b in _located_blocks(page) if _kind(b) == "run"]
  (tmp_path / "blocks.json").write_text(json.dumps([page, blocks]))
  (tmp_path / "runner.py").write_text(_RUNNER)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json")],
    cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
  )  # fmt: skip
  assert proc.returncode == 0, f"{page}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def test_readme_example_runs_alone_as_one_process(tmp_path):
  """README's first snippet as `python example.py`: no job to join, so one process."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    code = re.search(r"## Example\n\n```python\n(.*?)```", f.read(), re.S).group(1)
  script = tmp_path / "example.py"
  script.write_text(code)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("JAX_COORDINATOR_ADDRESS", None)
  proc = subprocess.run(
    [sys.executable, str(script)],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  # 10 batches of 32 rows, all real: no peer, so no dummy batch.
  assert proc.stdout == "host 0: 320 real rows in 10 batches\n"
  assert (
    "grain_jax_sync: no multi-process job found (jax.distributed.initialize:"
    " coordinator_address should be defined); running as one process" in proc.stderr
  )


SIM_BLOCKS = [
  (os.path.basename(p), i, b)
  for p in PAGES
  for i, b in enumerate(_blocks(p))
  if _kind(b) == "simulate"
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("page,index,block", SIM_BLOCKS, ids=[f"{p}-{i}" for p, i, _ in SIM_BLOCKS])
def test_simulate_blocks_run_on_two_simulated_hosts(page, index, block, tmp_path):
  script = tmp_path / f"block_{index}.py"
  script.write_text(block)
  outcomes = testing.run_script(str(script), num_processes=2, devices_per_process=4, timeout_s=180)
  assert len(testing.values(outcomes)) == 2, page


def test_sphinx_site_builds_without_warnings(tmp_path):
  proc = subprocess.run(
    [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", DOCS, str(tmp_path)],
    cwd=ROOT, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-5000:]
  for page in ("contents", "index", "api", "quickstart", "faq", "changelog"):
    assert (tmp_path / f"{page}.html").is_file()


def test_api_page_has_an_entry_for_every_public_name():
  with open(os.path.join(DOCS, "api.md"), encoding="utf-8") as f:
    api = f.read()
  names = [f"grain_jax_sync.{n}" for n in grain_jax_sync.__all__]
  names += [f"grain_jax_sync.testing.{n}" for n in testing.__all__]
  missing = [n for n in names if not re.search(rf"\.\. auto\w+:: {re.escape(n)}\b", api)]
  assert not missing


def test_every_docs_page_is_in_a_toctree():
  with open(os.path.join(DOCS, "contents.md"), encoding="utf-8") as f:
    contents = f.read()
  entries = set(re.findall(r"^(?:[^\n<]*<)?([\w-]+)>?$", contents, re.M))
  pages = {f[:-3] for f in os.listdir(DOCS) if f.endswith(".md")} - {"contents"}
  assert pages <= entries, pages - entries


def test_docs_requirements_pin_the_same_versions_as_the_docs_extra():
  with open(os.path.join(DOCS, "requirements.txt"), encoding="utf-8") as f:
    pins = [line.strip() for line in f if line.strip() and not line.startswith("#")]
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    extra = tomllib.load(f)["project"]["optional-dependencies"]["docs"]
  assert sorted(pins) == sorted(extra)


def test_grain_sharding_note_matches_grain():
  """docs/sources.md: what Grain's DataLoader sharding reads of 19 records."""
  grain = pytest.importorskip("grain")

  def read(index: int, drop_remainder: bool) -> list[int]:
    shard = grain.sharding.ShardOptions(
      shard_index=index, shard_count=2, drop_remainder=drop_remainder
    )
    sampler = grain.samplers.IndexSampler(
      num_records=19, shard_options=shard, shuffle=False, num_epochs=1
    )
    loader = grain.DataLoader(data_source=list(range(19)), sampler=sampler, worker_count=0)
    return [int(x) for x in loader]

  assert read(0, False) == list(range(0, 9)) and read(1, False) == list(range(10, 19))
  assert read(0, True) == list(range(0, 9)) and read(1, True) == list(range(9, 18))


def test_every_file_the_docs_name_under_examples_exists():
  named = set()
  for page in _pages():
    with open(page, encoding="utf-8") as f:
      named |= set(re.findall(r"examples/([a-z_]+\.py)", f.read()))
  assert named, "the docs name no example"
  assert not sorted(n for n in named if not os.path.isfile(os.path.join(ROOT, "examples", n)))


def test_internals_walk_names_only_modules_that_exist():
  # docs/internals.md walks one batch through the code, one module a line: a
  # renamed or merged module must take its new name there too.
  with open(os.path.join(ROOT, "docs", "internals.md")) as f:
    text = f.read()
  walk = text[text.index("## One batch, step by step") : text.index("## Data flow")]
  names = set(re.findall(r"(?<![\w/.])((?:[a-z_]+/)*[a-z_]+\.py)\b", walk))
  assert {"iterator.py", "reader.py", "build.py", "transfer.py", "plan.py"} <= names
  src = os.path.join(ROOT, "grain_jax_sync", "_src")
  modules = {n for n in names if not n.startswith("tests/")}
  missing = sorted(n for n in modules if not os.path.isfile(os.path.join(src, n)))
  assert not missing, f"docs/internals.md names modules that do not exist: {missing}"


def test_every_test_the_guarantees_name_exists():
  # Each promise names the test that keeps it, or the `check_*` function of
  # a test that runs several cases in one launch; a renamed or removed test
  # must not leave a promise pointing at nothing. A trailing `*` names every
  # test with that prefix.
  with open(os.path.join(DOCS, "guarantees.md")) as f:
    named = re.findall(r"`(?:tests/[\w/]+\.py::)?((?:test|check)_\w+)(\*?)`", f.read())
  defined = set()
  tests = os.path.join(ROOT, "tests")
  for name in os.listdir(tests):
    if name.endswith(".py"):
      with open(os.path.join(tests, name)) as f:
        defined |= set(re.findall(r"^def ((?:test|check)_\w+)", f.read(), re.M))
  missing = [
    n + star
    for n, star in named
    if not (any(d.startswith(n) for d in defined) if star else n in defined)
  ]
  assert len(named) > 50 and missing == []
