"""An .npz read from a record (the exact series, a weights sketch): its members' unpacked sizes bounded before numpy
inflates any of them. An .npz is a zip, and a record may come from a bundle: a member of zeros stored deflated
unpacks about a thousand times larger than it is stored, into memory."""

from __future__ import annotations

import contextlib
import io
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from harness.errors import RunRefused

# What harness writes (int64 steps, float64 values, float64 sketch sums) shrinks under 10 times deflated.
MAX_RATIO = 100
FLOOR = 64 << 20  # an .npz may always unpack to this much: a small one's ratio says nothing


class NpzRefused(RunRefused):
    """An .npz of a record that would unpack to far more than it stores: refused before numpy reads it."""


def check(stream: IO[bytes], what: str) -> None:
    """Refuse `stream` (an .npz, read from its start) when its members' listed sizes together exceed MAX_RATIO times
    its own size past FLOOR. The sizes a zip lists bound what reading its members yields: a reader stops there."""
    stored = stream.seek(0, os.SEEK_END)
    stream.seek(0)
    try:
        with zipfile.ZipFile(stream) as archive:
            unpacked = sum(info.file_size for info in archive.infolist())
    except zipfile.BadZipFile:
        unpacked = 0  # not a zip: numpy refuses it in its own words, and reads no member
    stream.seek(0)
    if unpacked > max(FLOOR, MAX_RATIO * stored):
        raise NpzRefused(
            f"{what} unpacks to {unpacked} bytes, {unpacked // max(stored, 1)} times the {stored} bytes it stores, over "
            f"the {MAX_RATIO} times an .npz harness writes comes near (a decompression bomb); refused before it was "
            "read. Use an intact copy of the run (its original store, or a bundle exported from it).")


@contextlib.contextmanager
def opened(source: Path | bytes, what: str) -> Iterator[Any]:
    """numpy's NpzFile of `source` (a file or its bytes), after `check`; no pickled object is loaded."""
    import numpy as np

    with (io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb")) as stream:
        check(stream, what)
        with np.load(stream, allow_pickle=False) as npz:
            yield npz
