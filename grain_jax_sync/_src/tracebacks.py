"""An ending's traceback, made to let go of the library's frames.

An exception that the pipeline raises to the consumer carries, in its
traceback, the frames it went through; `clear_library_frames` clears the
locals of the ones that belong to this package, so that the exception does
not keep the consumer's frame (and its iterators) alive until a garbage
collection.
"""

from __future__ import annotations

import contextlib
import os
import types

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def clear_library_frames(error: BaseException | None) -> None:
  """Clears the locals of this library's finished frames in `error`'s tracebacks.

  An ending raised to the consumer went through frames (the reader's, the
  agreement's, the build stage's) whose locals hold objects that hold the
  exception itself: a cycle from the exception through its traceback, which
  kept it alive until a garbage collection, and with it the consumer's frame
  and every iterator in it. A peer then waited for such an iterator, one
  the process had dropped, up to `sync_timeout_s`. File names and line
  numbers are kept; frames still running (the caller's) are skipped.
  """
  seen: set[int] = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    tb = error.__traceback__
    while tb is not None:
      frame: types.FrameType | None = tb.tb_frame
      # A frame that caught the error also holds its callers (`f_back`).
      while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        with contextlib.suppress(RuntimeError):  # Still running.
          frame.clear()
        frame = frame.f_back
      tb = tb.tb_next
    error = error.__cause__ or error.__context__
