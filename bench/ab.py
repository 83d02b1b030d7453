#!/usr/bin/env python3
"""A/B of two builds from mad-bench CSV files of one session (see BENCHMARKS.md).

    bench/ab.py BASE.csv... -- NEW.csv...

For every (bench, impl, size) present in both sets, each file's cost is the implementation's
median over the same file's raw baseline median (the VM switches between fast and slow modes,
so only ratios inside one run compare); the script prints median(new cost) / median(base cost):
above 1, the new build is slower. Rows without a baseline compare the raw medians.
"""
import csv
import statistics
import sys
from collections import defaultdict


def costs(files):
    out = defaultdict(list)
    for f in files:
        for r in csv.DictReader(open(f)):
            try:
                med = float(r["median"])
                base = float(r["baseline_median"])
            except ValueError:
                continue
            if r["impl"].startswith("raw-") or r["impl"] == "memcpy":
                continue
            key = (r["bench"], r["impl"], int(r["size"]))
            cost = med / base if base == base and base > 0 else med
            # A bandwidth is better when higher: its cost is the inverse.
            out[key].append(1.0 / cost if r["unit"] == "MB/s" and cost > 0 else cost)
    return out


def main():
    args = sys.argv[1:]
    if "--" not in args:
        sys.exit(__doc__)
    i = args.index("--")
    base, new = costs(args[:i]), costs(args[i + 1:])
    print(f"{'bench':8} {'impl':24} {'size':>9}  new/base  (runs {len(args[:i])} + {len(args[i + 1:])})")
    for key in sorted(set(base) & set(new)):
        b, n = statistics.median(base[key]), statistics.median(new[key])
        print(f"{key[0]:8} {key[1]:24} {key[2]:>9}  {n / b:8.3f}")


if __name__ == "__main__":
    main()
