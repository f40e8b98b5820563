"""An ending's traceback, made to let go of the library's frames (their locals, then the frames)."""

from __future__ import annotations

import contextlib
import os
import traceback
import types
from collections.abc import Iterator

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SRC_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Set to "full" to keep the library's frames in the tracebacks `next()` raises.
FULL_ENV = "GRAIN_JAX_SYNC_TRACEBACKS"


def clear_library_frames(error: BaseException | None) -> None:
  """Clears the locals of this library's finished frames in `error`'s tracebacks.

  Their locals hold objects that hold the exception: a cycle that kept it, the
  consumer's frame and its iterators alive until a garbage collection, while a
  peer waited for such a dropped iterator up to `sync_timeout_s`.
  """
  for current in _chain(error):
    tb = current.__traceback__
    while tb is not None:
      frame: types.FrameType | None = tb.tb_frame
      # A frame that caught the error also holds its callers (`f_back`).
      while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        with contextlib.suppress(RuntimeError):  # Still running.
          frame.clear()
        frame = frame.f_back
      tb = tb.tb_next


def for_user(error: BaseException) -> BaseException:
  """`error` (about to be raised by `next()`), without this library's inner frames.

  Dropped from `error` and every exception chained to it; the user's own
  frames stay (a source that raised keeps its own). An implicit context left
  with no frame of its own was the library's bookkeeping, and is hidden.
  ``GRAIN_JAX_SYNC_TRACEBACKS=full`` keeps every frame.
  """
  if os.environ.get(FULL_ENV) == "full":
    return error
  for current in _chain(error):
    current.__traceback__ = _without_library(current.__traceback__)
    context = current.__context__
    if context is not None and current.__cause__ is None and _only_library(context.__traceback__):
      current.__suppress_context__ = True
  return error


def _chain(error: BaseException | None) -> Iterator[BaseException]:
  """`error` and the exceptions chained to it (each one's cause, else its context), once each."""
  seen: set[int] = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def _is_library(frame: types.FrameType) -> bool:
  return frame.f_code.co_filename.startswith(_SRC_DIR)


def _only_library(tb: types.TracebackType | None) -> bool:
  return all(_is_library(frame) for frame, _ in traceback.walk_tb(tb))


def _without_library(tb: types.TracebackType | None) -> types.TracebackType | None:
  """A copy of the traceback `tb` without the frames of this package's `_src`."""
  kept = []
  while tb is not None:
    if not _is_library(tb.tb_frame):
      kept.append(tb)
    tb = tb.tb_next
  out = None
  for entry in reversed(kept):
    out = types.TracebackType(out, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
  return out
