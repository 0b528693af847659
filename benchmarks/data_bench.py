"""Hashing declared data: harness vs `sha256sum` on the same 1 GiB of files, and the cached re-check of 10,000 files.

Both sides read from the page cache: every file is read once before the first round (and 1 GiB fits
in memory), so the table compares hashing, not the disk. Rounds are interleaved, medians reported.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from harness.record import data as D  # noqa: E402

FILES, FILE_MIB = 64, 16  # 1 GiB
SMALL_FILES = 10_000
ROUNDS = 5


def make_big(folder: Path) -> list[Path]:
    folder.mkdir()
    block = os.urandom(1 << 20)
    paths = []
    for i in range(FILES):
        path = folder / f"shard-{i:03d}.bin"
        with open(path, "wb") as fh:
            for j in range(FILE_MIB):
                fh.write(bytes([i, j]) + block[2:])  # every MiB differs
        paths.append(path)
    return paths


def warm(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as fh:
            while fh.read(1 << 24):
                pass


def time_sha256sum(paths: list[Path]) -> float:
    start = time.perf_counter()
    subprocess.run(["sha256sum", *map(str, paths)], check=True, stdout=subprocess.DEVNULL, timeout=600)
    return time.perf_counter() - start


def time_openssl(paths: list[Path]) -> float:
    start = time.perf_counter()
    subprocess.run(["openssl", "dgst", "-sha256", *map(str, paths)], check=True, stdout=subprocess.DEVNULL, timeout=600)
    return time.perf_counter() - start


def time_harness(folder: Path, workers: int | None = None) -> float:
    original = D._workers
    if workers is not None:
        D._workers = lambda: workers  # type: ignore[assignment]
    try:
        start = time.perf_counter()
        D.build_manifest(D.resolve({"big": str(folder)}, folder), D.HashCache(None))  # no cache: read everything
        return time.perf_counter() - start
    finally:
        D._workers = original  # type: ignore[assignment]


def time_chunk(paths: list[Path], chunk: int) -> float:
    start = time.perf_counter()
    for path in paths:
        D.sha256_file(path, chunk)
    return time.perf_counter() - start


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="harness-data-bench-"))
    try:
        big = tmp / "big"
        paths = make_big(big)
        warm(paths)
        gib = FILES * FILE_MIB / 1024
        rows: dict[str, list[float]] = {"sha256sum (baseline)": [], "openssl dgst -sha256": [], "harness, 1 thread": [],
                                        f"harness, {D._workers()} threads (default)": []}
        for _ in range(ROUNDS):
            rows["sha256sum (baseline)"].append(time_sha256sum(paths))
            rows["openssl dgst -sha256"].append(time_openssl(paths))
            rows["harness, 1 thread"].append(time_harness(big, 1))
            rows[f"harness, {D._workers()} threads (default)"].append(time_harness(big))
        base = statistics.median(rows["sha256sum (baseline)"])
        print(f"Hashing {FILES} files x {FILE_MIB} MiB = {gib:.0f} GiB from the page cache, {ROUNDS} interleaved rounds,"
              f" {os.cpu_count()} CPUs\n")
        print("| hasher | median s | GiB/s | throughput vs sha256sum |")
        print("| --- | --- | --- | --- |")
        for name, times in rows.items():
            med = statistics.median(times)
            print(f"| {name} | {med:.2f} | {gib / med:.2f} | {base / med:.2f}x |")

        print("\nRead size (one thread, 16 files x 16 MiB, median of 3):\n")
        print("| chunk | median s |")
        print("| --- | --- |")
        for chunk in (1 << 16, 1 << 18, 1 << 20, 1 << 22):
            t = statistics.median(time_chunk(paths[:16], chunk) for _ in range(3))
            print(f"| {chunk >> 10} KiB | {t:.3f} |")

        small = tmp / "small"
        small.mkdir()
        for i in range(SMALL_FILES):
            sub = small / f"d{i // 1000:02d}"
            sub.mkdir(exist_ok=True)
            (sub / f"f{i:05d}.txt").write_bytes(f"sample {i}\n".encode() * 10)
        os.environ[D.ENV_CACHE_DIR] = str(tmp / "cache")
        time.sleep(D.RACY_S * 2)  # files written this instant are not cached (data.RACY_S)
        start = time.perf_counter()
        D.resolve_and_hash({"small": str(small)}, tmp, None)
        cold = time.perf_counter() - start
        times = []
        for _ in range(ROUNDS):
            stats = D.HashStats()
            start = time.perf_counter()
            D.resolve_and_hash({"small": str(small)}, tmp, None, stats)  # opens the cache as a run does
            times.append(time.perf_counter() - start)
            assert stats.hashed == 0 and stats.files == SMALL_FILES
        print(f"\nA folder of {SMALL_FILES} small files, cache in {D.CACHE_FILE}:\n")
        print("| check | median s |")
        print("| --- | --- |")
        print(f"| first hash (cache empty) | {cold:.2f} |")
        print(f"| re-check, unchanged (cache hits, {ROUNDS} rounds) | {statistics.median(times):.2f} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
