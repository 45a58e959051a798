#!/usr/bin/env python3
"""What read pattern a disk serves fastest: O_DIRECT reads of one file by N threads at once,
each read `size` bytes, at offsets in order or shuffled (as missed experts are), for a grid of
thread counts and read sizes. Prints GB/s for each, best last. The file should be larger than
what is read, and written before (unwritten extents read as zeros without touching the disk).

    python3 scripts/gpu/disk-probe.py FILE [--bytes GIB] [--threads 1,4,16,32] [--sizes 0.25,1,4]
"""
import argparse
import mmap
import os
import random
import threading
import time


def run(path, threads, size, total, shuffled):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    file_len = os.fstat(fd).st_size
    n = min(total, file_len) // size
    offsets = [i * size for i in range(n)]
    if shuffled:
        random.shuffle(offsets)
    lock = threading.Lock()
    it = iter(offsets)

    def worker():
        buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT wants
        while True:
            with lock:
                off = next(it, None)
            if off is None:
                return
            got = os.preadv(fd, [buf], off)
            assert got == size, (got, size)

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    start = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    secs = time.perf_counter() - start
    os.close(fd)
    return n * size / secs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--bytes", type=float, default=2.0, help="GiB read per configuration")
    ap.add_argument("--threads", default="1,2,4,8,16,32")
    ap.add_argument("--sizes", default="0.25,1,4", help="MiB per read")
    a = ap.parse_args()
    total = int(a.bytes * (1 << 30))
    results = []
    for shuffled in (False, True):
        for size_mib in [float(s) for s in a.sizes.split(",")]:
            size = int(size_mib * (1 << 20))
            for threads in [int(t) for t in a.threads.split(",")]:
                bw = run(a.file, threads, size, total, shuffled)
                results.append((bw, threads, size_mib, shuffled))
                print(f"{'shuffled' if shuffled else 'in order':8} {size_mib:5} MiB x {threads:2} threads: "
                      f"{bw / 1e9:.2f} GB/s", flush=True)
    bw, threads, size_mib, shuffled = max(results)
    print(f"best: {bw / 1e9:.2f} GB/s, {size_mib} MiB reads, {threads} threads, "
          f"{'shuffled' if shuffled else 'in order'}")


if __name__ == "__main__":
    main()
