"""Releasing the pages of an mmapped tensor: only whole pages inside it go, and its data reads back."""
from __future__ import annotations

import mmap

import numpy as np

from soma_runtime.memory import release


def resident_file_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile"))


def test_release_drops_whole_pages_and_data_reads_back(tmp_path):
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
    data.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    view = mapped[1000: (6 << 20) + 1000].reshape(-1, 1024)        # starts and ends mid-page
    assert int(view.sum(dtype=np.int64)) == int(data[1000: (6 << 20) + 1000].sum(dtype=np.int64))
    before = resident_file_kb()
    released = release(view)
    assert released == (6 << 20) - mmap.PAGESIZE                     # the two partial pages stay
    assert before - resident_file_kb() >= released // 1024 - 64
    np.testing.assert_array_equal(view.reshape(-1), data[1000: (6 << 20) + 1000])


def test_release_leaves_plain_arrays_alone():
    assert release(np.ones((4, 1024), np.float32)) == 0
