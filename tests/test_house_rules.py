"""The house rules on size and complexity (issue 23), checked on the sources.

Modules are split by concept, never by length (no line cap); no function under `grain_jax_sync/` over 60
lines of code (a docstring does not count: from the first statement after it
to the end); ruff's C901 at most 10 (pyproject's `max-complexity`) everywhere
ruff checks, with no `noqa: C901` to silence it; no import circle among the
modules under `grain_jax_sync/` (issue 32). Pure: reads files with `ast` and
`tokenize` and runs ruff in a subprocess; imports no JAX.

Import circles: every import statement counts wherever it is, at the top, in
a function (a lazy import) or under ``if TYPE_CHECKING:``; a circle through
a lazy import is still two modules that each need the other. ``from pkg
import name`` points to ``pkg.name`` where that is a module, else to
``pkg`` (its ``__init__``). The parent packages that Python runs before a
submodule are not counted: a package's ``__init__`` imports its own
submodules, so every package would be a circle with its members.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "grain_jax_sync"
TREES = ("grain_jax_sync", "benchmarks", "tests", "examples")
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250
MAX_COMPLEXITY = 10

# A comment that silences C901: `noqa` with C901 among its codes, or a bare
# `noqa` (every code) on a function's signature.
_NOQA_C901 = re.compile(r"#\s*noqa\s*:[^#]*\bC901\b", re.IGNORECASE)
_NOQA_ALL = re.compile(r"#\s*noqa\b(?!\s*:)", re.IGNORECASE)
# ruff's concise output: `path:line:col: C901 `name` is too complex (11 > 10)`.
_RUFF_C901 = re.compile(
  r"^(?P<where>\S+:\d+):\d+: C901 `(?P<name>[^`]+)` is too complex \((?P<n>\d+) > \d+\)"
)


def _rel(path: pathlib.Path) -> str:
  return path.relative_to(ROOT).as_posix()


def _python_files(*trees: str) -> list[pathlib.Path]:
  return sorted(p for t in trees for p in (ROOT / t).rglob("*.py") if "__pycache__" not in p.parts)


MODULES = _python_files("grain_jax_sync")


def code_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  """Lines of code of `fn`: from the first statement after its docstring to its end.

  Without a docstring, from its first decorator (or `def`) to its end.
  """
  body = fn.body
  first = body[0]
  if (
    isinstance(first, ast.Expr)
    and isinstance(first.value, ast.Constant)
    and isinstance(first.value.value, str)
  ):
    if len(body) == 1:
      return 0
    start = body[1].lineno
  else:
    start = fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno
  assert fn.end_lineno is not None
  return fn.end_lineno - start + 1


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
  return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _function_at(tree: ast.AST, line: int) -> str:
  """The function whose `def` (signature included) spans `line`, or the module."""
  for fn in _functions(tree):
    if fn.lineno <= line < fn.body[0].lineno:
      return fn.name
  return "<module>"


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_every_function_has_at_most_60_lines_of_code(path):
  tree = ast.parse(path.read_text(), filename=str(path))
  long = [
    f"{_rel(path)}:{fn.lineno} {fn.name}: {code_lines(fn)} lines of code"
    f" (at most {MAX_FUNCTION_LINES})"
    for fn in _functions(tree)
    if code_lines(fn) > MAX_FUNCTION_LINES
  ]
  assert not long, "\n".join(long)


def test_no_class_is_over_250_lines():
  # Issue 48: a class that grows past it holds more than one concept.
  long = [
    f"{_rel(path)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
    for path in MODULES
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
    if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
  ]
  assert not long, "\n".join(long)


@pytest.mark.parametrize("tree", TREES)
def test_no_noqa_silences_c901(tree):
  found = []
  for path in _python_files(tree):
    with path.open("rb") as f:
      comments = [t for t in tokenize.tokenize(f.readline) if t.type == tokenize.COMMENT]
    if not any(_NOQA_C901.search(t.string) or _NOQA_ALL.search(t.string) for t in comments):
      continue
    module = ast.parse(path.read_text(), filename=str(path))
    for t in comments:
      line, name = t.start[0], _function_at(module, t.start[0])
      if _NOQA_C901.search(t.string) or (_NOQA_ALL.search(t.string) and name != "<module>"):
        found.append(f"{_rel(path)}:{line} {name}")
  assert not found, f"{len(found)} `noqa: C901` (fix the complexity instead):\n" + "\n".join(found)


def _function_of_complexity(n: int) -> str:
  """A function whose McCabe complexity is `n`: one branch per `if`, plus one."""
  ifs = "".join(f"  if x == {i}:\n    return {i}\n" for i in range(n - 1))
  return f"def f(x):\n{ifs}  return -1\n"


def test_ruff_flags_complexity_11_and_passes_10_under_the_project_config():
  # The project's config (found from the file's place in the tree) is the one
  # that `test_ruff_finds_no_function_over_complexity_10` runs under.
  pytest.importorskip("ruff")

  def c901(source: str) -> list[str]:
    proc = subprocess.run(
      [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "C901"]
      + ["--output-format", "concise", "--stdin-filename", "grain_jax_sync/_probe.py", "-"],
      cwd=ROOT, input=source, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return [m["n"] for m in map(_RUFF_C901.match, proc.stdout.splitlines()) if m]

  assert c901(_function_of_complexity(MAX_COMPLEXITY)) == []
  assert c901(_function_of_complexity(MAX_COMPLEXITY + 1)) == [str(MAX_COMPLEXITY + 1)]


@pytest.mark.parametrize("tree", TREES)
def test_ruff_finds_no_function_over_complexity_10(tree):
  pytest.importorskip("ruff")
  proc = subprocess.run(
    [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "C901"]
    + ["--output-format", "concise", tree],
    cwd=ROOT, capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  out = proc.stdout + proc.stderr
  found = [
    f"{m['where']} {m['name']}: complexity {m['n']} (at most {MAX_COMPLEXITY})"
    for m in map(_RUFF_C901.match, out.splitlines())
    if m
  ]
  assert not found, "\n".join(found)
  assert proc.returncode == 0, out[-5000:]


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, name: str, is_package: bool) -> list[str]:
  """The module names one import statement of module `name` names (absolute or relative)."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names]
  base = node.module or ""
  if node.level:
    package = name.split(".") if is_package else name.split(".")[:-1]
    package = package[: len(package) - node.level + 1]
    base = ".".join([*package, *([base] if base else [])])
  return [base, *(f"{base}.{a.name}" for a in node.names)]


def import_graph(paths: list[pathlib.Path]) -> dict[str, set[str]]:
  """Module -> the package modules it imports, lazy and TYPE_CHECKING imports included."""
  modules = {_module_name(p): p for p in paths}
  graph: dict[str, set[str]] = {}
  for name, path in modules.items():
    edges: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
      if not isinstance(node, (ast.Import, ast.ImportFrom)):
        continue
      named = _imported(node, name, path.name == "__init__.py")
      if isinstance(node, ast.ImportFrom):  # `from pkg import name`: pkg.name if a module.
        base, *members = named
        found = [m for m in members if m in modules]
        edges.update(found if len(found) == len(members) else [*found, base])
      else:
        edges.update(named)
    graph[name] = {m for m in edges if m in modules and m != name}
  return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The groups of modules that import each other, directly or through others."""
  reach: dict[str, set[str]] = {}
  for start in graph:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
      m = todo.pop()
      if m not in seen:
        seen.add(m)
        todo.extend(graph.get(m, ()))
    reach[start] = seen
  groups = {frozenset(m for m in reach[n] if n in reach[m]) for n in graph if n in reach[n]}
  return sorted(sorted(g) for g in groups)


def test_import_graph_counts_lazy_imports_and_finds_circles():
  graph = import_graph(MODULES)
  # A lazy import, inside `open_source`: counted.
  assert "grain_jax_sync._src.sources.grain" in graph["grain_jax_sync._src.sources"]
  assert "grain_jax_sync._src.agreement.endings" in graph["grain_jax_sync._src.agreement.streamed"]
  circles = import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}})
  assert circles == [["a", "b", "c"], ["e"]]


def test_no_import_circle_among_the_package_modules():
  circles = import_circles(import_graph(MODULES))
  shown = ["  " + " <-> ".join(c) for c in circles]
  assert not circles, "import circles (lazy and TYPE_CHECKING imports count):\n" + "\n".join(shown)


# The agreement's core: one host's protocol, with no thread, clock or store
# (docs/internals.md, "The core and its drivers"). Its drivers are the I/O.
CORE = ("core", "common", "streamed", "decider", "follower", "ledger", "endings", "lockstep")
NOT_IN_CORE = ("threading", "queue", "time", "asyncio", "socket")
NOT_IN_CORE_MODULES = (
  "exchange",
  "prefetch",
  "liveness",
  "agreement.driver",
  "session",
  "reader",
  "sources",
)


def _absolute_imports(path: pathlib.Path) -> set[str]:
  """The top-level names of every absolute import in `path`, wherever it is."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      found.add(node.module.split(".")[0])
  return found


def test_the_agreements_core_imports_no_thread_clock_store_or_stage():
  graph = import_graph(MODULES)
  for name in CORE:
    module = f"grain_jax_sync._src.agreement.{name}"
    path = ROOT / "grain_jax_sync" / "_src" / "agreement" / f"{name}.py"
    stdlib = _absolute_imports(path)
    assert not stdlib & set(NOT_IN_CORE), (module, sorted(stdlib & set(NOT_IN_CORE)))
    reached = {m.removeprefix("grain_jax_sync._src.") for m in graph[module]}
    bad = [m for m in reached if m.startswith(NOT_IN_CORE_MODULES)]
    assert not bad, (module, bad)


def _loaded_imports(path: pathlib.Path, name: str) -> list[str]:
  """The module names that importing `path` imports: its top-level imports, not under TYPE_CHECKING."""
  names = []
  for node in ast.parse(path.read_text()).body:
    if (
      isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", "") != "__future__"
    ):
      names += _imported(node, name, path.name == "__init__.py")
  return names


def test_importing_the_core_loads_no_jax_thread_clock_exchange_placement_or_stage():
  # What importing the core loads (lazy imports
  # in functions it never calls, and type-only imports, are not loaded).
  modules = {_module_name(p): p for p in MODULES}
  todo = [f"grain_jax_sync._src.agreement.{name}" for name in CORE]
  loaded: set[str] = set()
  external: set[str] = set()
  while todo:
    module = todo.pop()
    if module in loaded:
      continue
    loaded.add(module)
    for name in _loaded_imports(modules[module], module):
      if name in modules:
        todo.append(name)
      elif not name.startswith("grain_jax_sync"):
        external.add(name.split(".")[0])
  assert not external & {"jax", "threading", "time", "queue"}, sorted(external)
  forbidden = (*NOT_IN_CORE_MODULES, "placement", "agreement.interpreter")
  reached = {m.removeprefix("grain_jax_sync._src.") for m in loaded}
  assert not [m for m in reached if m.startswith(forbidden)], sorted(reached)


def test_no_file_of_the_agreement_but_the_driver_imports_time_threading_or_queue():
  for path in sorted((ROOT / "grain_jax_sync" / "_src" / "agreement").glob("*.py")):
    if path.name != "driver.py":
      found = _absolute_imports(path)
      assert not found & {"time", "threading", "queue"}, (path.name, sorted(found))
