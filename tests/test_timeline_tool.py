"""tools/flashmla_upstream/timeline.py, FlashMLA's kernels with time stamps (CPU: the stamps'
insertion into sources, FlashMLA 9241ae3's where the seeds are at hand, and the phase table
from a stamp buffer; the stamped build and its runs need nvcc and a GPU)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("timeline", REPO / "tools" / "flashmla_upstream" / "timeline.py")
timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timeline)

SEED_FLASHMLA = REPO.parent / "shared" / "seeds" / "flashmla-upstream-9241ae3"


def test_a_stamp_goes_before_or_after_the_chosen_occurrence_of_its_line(tmp_path):
    (tmp_path / "k.cuh").write_text("a\n  wait();\nb\n  wait();\nc")
    timeline.apply_stamps(tmp_path, [timeline.Stamp("k.cuh", "wait();", 2, 2, True, "  S2;"),
                                     timeline.Stamp("k.cuh", "wait();", 1, 2, False, "  S1;"),
                                     timeline.Stamp("k.cuh", "a", 1, 1, True, "X\nY")])
    assert (tmp_path / "k.cuh").read_text() == "a\nX\nY\n  S1;\n  wait();\nb\n  wait();\n  S2;\nc"


@pytest.mark.parametrize("text", ["a\nc", "wait();\nwait();\nwait();"])
def test_a_line_found_another_number_of_times_is_refused(tmp_path, text):
    (tmp_path / "k.cuh").write_text(text)
    with pytest.raises(ValueError, match=r"expected 2 line\(s\) reading 'wait\(\);'.*not FlashMLA 9241ae3"):
        timeline.apply_stamps(tmp_path, [timeline.Stamp("k.cuh", "wait();", 1, 2, True, "S;")])
    assert (tmp_path / "k.cuh").read_text() == text          # nothing half-applied


@pytest.mark.skipif(not SEED_FLASHMLA.is_dir(), reason=f"FlashMLA 9241ae3's sources are not at {SEED_FLASHMLA}")
def test_every_stamp_finds_its_line_in_flashmla_9241ae3(tmp_path):
    for path in {s.path for s in timeline.STAMPS}:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text((SEED_FLASHMLA / path).read_text())
    timeline.apply_stamps(tmp_path)
    for path in (timeline.SPARSE, timeline.DENSE):       # the macros open the kernel, before any stamp
        text = (tmp_path / path).read_text()
        assert text.index("#define FM_STAMP") < text.index("FM_STAMP(0)") < text.index("FM_REQUEST(0)")
    assert (tmp_path / timeline.PARAMS).read_text().count("unsigned long long* fm_probe;") == 2


def test_phases_are_us_after_each_ctas_entry_then_intervals_within_and_between_requests():
    stamps = np.zeros((1, 3, timeline.SLOTS), dtype=np.int64)
    first = timeline.FIRST_REQUEST_SLOT
    stamps[0, 0, [0, 1]] = [1_000, 1_500]                       # two requests: starts at +1 and +5 us
    stamps[0, 0, [first, first + 8, first + 8 + 6]] = [2_000, 6_000, 9_000]
    stamps[0, 1, [0, 1, first]] = [3_000, 3_200, 4_000]
    stamps[0, 2, 0] = 5_000                                     # an idle part: returned before slot 1
    stamps[0, 0, first + 6] = 5_500                             # request 0 ends 0.5 us before request 1 starts
    stamps[0, 0, first + 8 + 5] = 8_000
    rows = dict(timeline.phase_rows(stamps, sparse=False))
    assert sorted(rows["scheduler row read (after entry)"]) == [0.2, 0.5]
    assert list(rows["per request: O stores read (TMA) -> end of request"]) == [1.0]
    assert list(rows["per request: end of request -> next request's start"]) == [0.5]
    assert rows["per request: request start -> Q arrived"].size == 0
    assert "producer: done (after entry)" not in rows
    assert "producer: done (after entry)" in dict(timeline.phase_rows(stamps, sparse=True))
    assert timeline._requests_per_cta(stamps).tolist() == [2, 1]
