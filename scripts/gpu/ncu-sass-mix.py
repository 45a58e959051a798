#!/usr/bin/env python3
"""Where a kernel's instructions and stalls go, from Nsight Compute's SASS source page.

Reads the CSV that `ncu -i REPORT --page source --print-source sass --csv` writes (one block a
profiled launch, each opening with a "Kernel Name" line) and prints, for each launch: the
instructions executed and the warp-stall samples, the opcodes (without their modifiers) by
instructions executed with their share of the samples, and the stall reasons by share of the
samples (ncu repeats each launch's block; one of two equal neighbours is kept). The report
needs the source counters (`--set full`, or `--section SourceCounters` and `--section
WarpStateStats`).

    python3 scripts/gpu/ncu-sass-mix.py skinny-sass.csv [--top 20] [--kernel REGEX]
"""

import argparse
import collections
import csv
import io
import re
import sys

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"


def launches(text):
    """(kernel name, rows) for each launch block of the CSV."""
    blocks = []
    for line in text.splitlines():
        if line.startswith('"Kernel Name"'):
            blocks.append((next(csv.reader([line]))[1], []))
        elif blocks:
            blocks[-1][1].append(line)
    # ncu writes each launch's page twice over; keep one of two equal neighbours.
    unique = [b for i, b in enumerate(blocks) if i == 0 or b != blocks[i - 1]]
    return [(name, list(csv.DictReader(io.StringIO("\n".join(lines))))) for name, lines in unique]


def count(value):
    value = (value or "").replace(",", "").strip()
    return int(float(value)) if value else 0


def opcode(source):
    """The opcode of a SASS line, without its predicate and modifiers."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0].rstrip(";") if words else ""


def report(name, rows, top, out):
    executed = sum(count(r.get(EXECUTED)) for r in rows)
    samples = sum(count(r.get(SAMPLES)) for r in rows)
    ops_executed, ops_samples, stalls = collections.Counter(), collections.Counter(), collections.Counter()
    for r in rows:
        op = opcode(r.get("Source", ""))
        if not op:
            continue
        ops_executed[op] += count(r.get(EXECUTED))
        ops_samples[op] += count(r.get(SAMPLES))
        for key, value in r.items():
            if key and key.startswith("stall_") and "(Not Issued)" not in key:
                stalls[key[len("stall_"):]] += count(value)
    print(f"{name}: {executed:,} instructions executed, {samples:,} stall samples", file=out)
    for op, n in ops_executed.most_common(top):
        share = 100 * n / executed if executed else 0.0
        sampled = 100 * ops_samples[op] / samples if samples else 0.0
        print(f"  {op:<10} {n:>12,} executed ({share:4.1f}%), {sampled:4.1f}% of samples", file=out)
    total = sum(stalls.values())
    if total:
        print("  stalls: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in stalls.most_common(10)), file=out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="the CSV of ncu's SASS source page")
    parser.add_argument("--top", type=int, default=20, help="opcodes listed a launch")
    parser.add_argument("--kernel", default="", help="only launches whose kernel name matches")
    args = parser.parse_args()
    try:
        with open(args.csv, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        sys.exit(f"ncu-sass-mix: cannot read {args.csv}: {e.strerror}")
    found = launches(text)
    if not found:
        sys.exit(f"ncu-sass-mix: no \"Kernel Name\" block in {args.csv} (not ncu's SASS source page?)")
    pattern = re.compile(args.kernel)
    for name, rows in found:
        if pattern.search(name):
            report(name, rows, args.top, sys.stdout)


if __name__ == "__main__":
    main()
