"""benchmarks/RESULTS.md: the sections that a benchmark's `--write` replaces.

The page holds the current figures, one table per benchmark. A benchmark
that writes owns the text between two marker lines,
``<!-- NAME: begin -->`` and ``<!-- NAME: end -->``, and replaces it in
place with its table and where it ran, so the page does not grow with each
run; earlier runs are in git's history of the file.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "benchmarks", "RESULTS.md")


def machine() -> str:
  """The CPU, its cores, Python, JAX and the kernel of this machine."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  import jax

  return (
    f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()},"
    f" jax {jax.__version__}, {platform.system()} {platform.release()}"
  )


def commit() -> str:
  """The checkout's commit, and whether tracked files (this page aside) differ from it."""

  def git(*args: str) -> str:
    return subprocess.run(
      ["git", *args], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()

  head = git("rev-parse", "--short", "HEAD") or "unknown"
  changed = git(
    "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/RESULTS.md"
  )
  return f"{head} with uncommitted changes" if changed else head


def provenance(command: str, run_s: float | None = None) -> str:
  """The line that heads a written section: date, commit, command and machine."""
  stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
  took = f" ({run_s:.0f} s)" if run_s is not None else ""
  return (
    f"Date: {stamp}. Commit: {commit()}. Command (from the repository root):"
    f" `{command}`{took}. Machine: {machine()}.\n"
  )


def write_section(name: str, body: str, path: str = PATH) -> None:
  """Replaces the text between `name`'s two marker lines in `path` with `body`.

  Raises:
    ValueError: `path` lacks either marker line, or has them out of order.
  """
  begin, end = f"<!-- {name}: begin -->\n", f"<!-- {name}: end -->"
  with open(path, encoding="utf-8") as f:
    text = f.read()
  start, stop = text.find(begin), text.find(end)
  if start < 0 or stop < start:
    raise ValueError(
      f"{path} has no section `{name}`: put the lines {begin.strip()!r} and {end!r}"
      " where its table goes"
    )
  text = text[: start + len(begin)] + body.rstrip("\n") + "\n" + text[stop:]
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
