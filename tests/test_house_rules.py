"""The house rules on size and complexity (issue 23), checked on the sources.

No module under `grain_jax_sync/` over 400 lines; no function there over 60
lines of code (a docstring does not count: from the first statement after it
to the end); ruff's C901 at most 10 (pyproject's `max-complexity`) everywhere
ruff checks, with no `noqa: C901` to silence it. Pure: reads files with `ast`
and `tokenize` and runs ruff in a subprocess; imports no JAX.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import tokenize
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "grain_jax_sync"
TREES = ("grain_jax_sync", "benchmarks", "tests", "examples")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
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
def test_module_has_at_most_400_lines(path):
  n = len(path.read_text().splitlines())
  assert n <= MAX_MODULE_LINES, f"{_rel(path)}: {n} lines (at most {MAX_MODULE_LINES})"


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


def test_ruff_max_complexity_is_10():
  with (ROOT / "pyproject.toml").open("rb") as f:
    config = tomllib.load(f)
  assert config["tool"]["ruff"]["lint"]["mccabe"]["max-complexity"] == MAX_COMPLEXITY


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
