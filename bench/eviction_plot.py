#!/usr/bin/python3
"""Plots bench/out/eviction.csv (written by build/bench/eviction_sim): hit rate per
policy against cache size, one panel per trace.

  /usr/bin/python3 bench/eviction_plot.py [bench/out/eviction.csv] [bench/out/eviction.png]
"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    src = sys.argv[1] if len(sys.argv) > 1 else "bench/out/eviction.csv"
    dst = sys.argv[2] if len(sys.argv) > 2 else "bench/out/eviction.png"
    series = defaultdict(lambda: defaultdict(list))  # trace -> policy -> [(fraction, hit)]
    with open(src) as f:
        for row in csv.DictReader(f):
            series[row["trace"]][row["policy"]].append((float(row["fraction"]), float(row["hit_rate"])))
    if not series:
        print(f"{src}: no rows", file=sys.stderr)
        return 1
    fig, axes = plt.subplots(1, len(series), figsize=(5.5 * len(series), 4), squeeze=False)
    for ax, (trace, policies) in zip(axes[0], sorted(series.items())):
        for policy, pts in sorted(policies.items()):
            pts.sort()
            ax.plot([100 * p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
        ax.set_title(f"{trace} trace")
        ax.set_xlabel("cache size (% of distinct blocks)")
        ax.set_ylabel("block hit rate")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
