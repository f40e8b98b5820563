"""`benchmarks/run.py`'s options and the host rows' formatting (no benchmark runs)."""

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import host, run  # noqa: E402 - the repository root, from any directory.


def test_only_selects_workloads_and_refuses_write_and_unknown_names():
  assert run.parse_args(["--only", "cpu_per_batch", "--only", "overhead"]).only == [
    "cpu_per_batch",
    "overhead",
  ]
  assert run.parse_args([]).only is None
  with pytest.raises(SystemExit):
    run.parse_args(["--only", "nonesuch"])
  with pytest.raises(SystemExit):  # A partial table must not replace RESULTS.md.
    run.parse_args(["--write", "--only", "overhead"])


def test_host_rows_report_extra_cpu_memory_and_steps_against_their_peers():
  def cpu(extra):
    return {"cpu_us": 100 + extra, "wall_ms": 1, "extra_us": extra, "extra_lo": extra - 5}

  cfg = {"n": 30, "trials": 7, "bare": cpu(0), "ours": cpu(40), "ours_p0": cpu(20)}
  cfg["grain"] = cpu(60)
  for r in cfg.values():
    if isinstance(r, dict):
      r["extra_hi"] = r["extra_us"] + 5
  rate = {"steps_s": 10.0, "lo": 9.0, "hi": 11.0, "trials": 7}
  res = {
    "cpu_per_batch": {"8 MB, 50 ms": cfg},
    "memory_peers": {
      "bare": [2.0],
      "grain": [5.5],
      "ours": [4.25, 3.75, 9.0],
      "bare_held": [(2, 0)],
      "grain_held": [(3, 2)],
      "ours_held": [(4, 1), (5, 2), (3, 2)],
    },
    "input_bound": [
      {"bare": rate, "ours": {**rate, "steps_s": 12.0}, "device_put": rate},
      {"bare": {**rate, "steps_s": 8.0}, "ours": rate, "device_put": rate},
    ],
  }
  cpu_row, mem_row, ib_row = host.rows(res)
  assert "8 MB, 50 ms step" in cpu_row[1] and "bare loop 100 us" in cpu_row[1]
  assert cpu_row[2] == "+40 us (+35..+45); prefetch_batches=0: +20 us (+15..+25)"
  assert cpu_row[3] == "`grain.experimental.device_put`: +60 us (+55..+65)"
  # The median of the runs, the runs, and the most held in any run.
  assert mem_row[2] == "4.25 (4.25, 3.75, 9.00); held at most 5 source batches, 2 global arrays"
  assert "5.50 (5.50); held at most 3 source batches, 2 global arrays" in mem_row[3]
  assert "bare loop: 2.00 (2.00)" in mem_row[3]
  # The slowest host's figures: ours 10.0 (host 1), bare 8.0 (host 1).
  assert ib_row[2].startswith("10.0 steps/s (9.0..11.0) = 1.25 of bare")
  assert ib_row[3] == "bare loop over the loader: 8.0 steps/s (9.0..11.0)"


def test_float_check_row_shows_the_extra_cpu_over_float32_and_the_check_alone():
  fc = {"n": 100, "trials": 7, "batch_bytes": 2**19, "step_ms": 5.0, "float32_us": 229.4}
  fc.update(extra_us=131.2, extra_lo=95.0, extra_hi=216.0, check_us=14.3)
  (row,) = host.rows({"float_check": fc})
  assert "one 0.50 MiB float64 column" in row[1] and "float32: 229 us" in row[1]
  assert row[2] == "+131 us (+95..+216); the check alone: 14 us per batch"


def test_peak_rss_growth_counts_a_freed_peak_exactly_where_the_kernel_keeps_it():
  import numpy as np

  from benchmarks import workloads

  size = 256 << 20

  def spike():  # Touched, then freed before `fn` returns.
    np.ones(size // 8).sum()

  growth = workloads._peak_rss_growth(spike)  # noqa: SLF001
  if workloads._reset_high_water():  # noqa: SLF001 - Linux: the kernel's high-water mark.
    assert growth >= 0.9 * size, growth
  assert workloads._peak_rss_growth(lambda: None) < size // 4  # noqa: SLF001


def test_a_write_replaces_its_section_in_place_and_refuses_a_page_without_it(tmp_path):
  from benchmarks import results_file

  page = tmp_path / "RESULTS.md"
  page.write_text(
    "# Results\n\n<!-- a: begin -->\nold a\n<!-- a: end -->\n\n"
    "<!-- b: begin -->\nold b\n<!-- b: end -->\n\nnotes\n"
  )
  for _ in range(3):  # Written again and again: the page does not grow.
    results_file.write_section("a", "| new | a |\n", str(page))
  assert page.read_text() == (
    "# Results\n\n<!-- a: begin -->\n| new | a |\n<!-- a: end -->\n\n"
    "<!-- b: begin -->\nold b\n<!-- b: end -->\n\nnotes\n"
  )
  with pytest.raises(ValueError, match="has no section `c`"):
    results_file.write_section("c", "x", str(page))


def test_results_page_has_every_written_section_once_fits_400_lines_and_names_no_issue():
  from benchmarks import endings, results_file

  with open(results_file.PATH, encoding="utf-8") as f:
    text = f.read()
  for name in [run.SECTION, *(endings.SECTION.format(n) for n in endings.NAMES)]:
    begin, end = text.count(f"<!-- {name}: begin -->\n"), text.count(f"<!-- {name}: end -->")
    assert (begin, end) == (1, 1), name
    assert text.index(f"<!-- {name}: begin -->") < text.index(f"<!-- {name}: end -->"), name
  assert len(text.splitlines()) <= 400
  assert not re.findall(r"(?i)\bissues?\s+\d+|#\d+", text)
