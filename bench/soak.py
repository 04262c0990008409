#!/usr/bin/python3
"""Bounded soak: a local cluster (coordinator + 4 daemons, R=2, loopback)
under many client threads mixing put / get / lookup / attend for a fixed
time, over a bounded key space (so it reaches a steady state: evictions,
demotions to RocksDB and promotions back go on all the time). Every second
it records throughput and latency per operation (timed around the call
only); every
5 s the resident memory of each daemon (/proc/<pid>/status VmRSS). At the
end: errors (must be 0), data checked (every get compares the bytes with
what was put), throughput, p50/p99 latency, and memory over time (growth
after warm-up must stay small). Writes bench/out/soak.json and bench/out/soak.png (generated, not tracked;
the plot bench/RESULTS.md shows is bench/soak.png, copied from a run).

  /usr/bin/python3 bench/soak.py [--seconds 300] [--threads 8]
"""
import argparse
import json
import os
import random
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

import kvring
from kvring.local_cluster import LocalCluster


def rss_mb(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=int, default=300)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--chains", type=int, default=600, help="distinct 4-block chains per thread (the key space)")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--out", default="bench/out/soak", help="path prefix of the JSON and PNG written (bench/out/ is not tracked)")
    a = p.parse_args()
    layout = kvring.Layout(16, 2, 4, 128, "bf16")  # 64 KiB blocks
    with LocalCluster(nodes=4, port=a.port, replication=2, host_bytes="512M", page_bytes="64K") as cl:
        pids = {n: int((cl.dir / "pids" / n).read_text()) for n in [f"node{i}" for i in range(4)]}
        client = kvring.Client(cl.coordinator, cl.tenant_token)
        rng = np.random.default_rng(1)
        # A stored sequence for attend, and its reference answer through the same client.
        seq_blocks = 64
        blocks = rng.integers(0, 0x3f00, (seq_blocks,) + tuple(layout.block_shape), dtype=np.uint16)
        skeys = client.chain("soak-seq", layout, np.arange(seq_blocks * 16, dtype=np.uint32))
        client.put_sequence("soak", 0, skeys, blocks, layout)
        q = rng.standard_normal((2, 16, 128)).astype(np.float32)
        qpos = np.array([seq_blocks * 16, seq_blocks * 16], np.int64)
        ref_out, _ = client.attend("soak", layout, seq_blocks * 16, q, qpos)
        per_sec = defaultdict(lambda: defaultdict(list))  # second -> op -> latencies
        errors, mismatches = defaultdict(int), [0]
        stop = threading.Event()
        t0 = time.time()

        chains = a.chains  # per thread: a bounded key space, so the run reaches a steady state

        def chain(seed, n):
            """Keys and payload of chain n of thread `seed` (deterministic: gets can check the bytes)."""
            g = np.random.default_rng([seed, n])
            keys = client.chain(f"soak-{seed}-{n}", layout, g.integers(0, 32000, 4 * 16).astype(np.uint32))
            return keys, g.integers(0, 0x3f00, (4,) + tuple(layout.block_shape), dtype=np.uint16)

        def worker(seed):
            r = random.Random(seed)
            n, seen = 0, 0  # next chain to write; chains written at least once
            while not stop.is_set():
                op = r.choices(["put", "get", "lookup", "attend"], [4, 3, 2, 1])[0]
                if op != "attend" and op != "put" and seen == 0:
                    op = "put"
                try:
                    if op == "put":
                        keys, data = chain(seed, n)
                        ts = time.time()
                        client.put(keys, data, layout)
                        n = (n + 1) % chains
                        seen = min(chains, seen + 1)
                    elif op == "get":
                        keys, data = chain(seed, r.randrange(seen))
                        out = np.empty_like(data)
                        ts = time.time()
                        found = client.get_into(keys, layout, out)
                        # Evicted from every tier is allowed (bounded memory); wrong bytes never are.
                        if found.any() and not np.array_equal(out[found], data[found]):
                            mismatches[0] += 1
                    elif op == "lookup":
                        keys, _ = chain(seed, r.randrange(seen))
                        ts = time.time()
                        client.lookup(keys)
                    else:
                        ts = time.time()
                        out, _ = client.attend("soak", layout, seq_blocks * 16, q, qpos)
                        if np.max(np.abs(out - ref_out)) > 1e-5:
                            mismatches[0] += 1
                except kvring.Error as e:
                    errors[f"{op}: {type(e).__name__}"] += 1
                    continue
                per_sec[int(ts - t0)][op].append(time.time() - ts)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(a.threads)]
        for t in threads:
            t.start()
        memory = []
        last_print = 0
        while time.time() - t0 < a.seconds:
            time.sleep(5)
            el = time.time() - t0
            memory.append(dict(t=el, **{n: rss_mb(pid) for n, pid in pids.items()}))
            if el - last_print >= 30:
                last_print = el
                recent = [per_sec[s] for s in range(max(0, int(el) - 10), int(el))]
                ops = sum(len(v) for d in recent for v in d.values()) / 10
                print(f"[soak] {el:5.0f} s: {ops:7.0f} ops/s, daemon RSS "
                      f"{', '.join(f'{memory[-1][n]:.0f}' for n in pids)} MB, errors {sum(errors.values())}", flush=True)
        stop.set()
        for t in threads:
            t.join()
        secs = sorted(s for s in per_sec if s < a.seconds)
        timeline = []
        for s in secs:
            lat = [x for v in per_sec[s].values() for x in v]
            timeline.append(dict(t=s, ops=len(lat), p99_ms=float(np.percentile(lat, 99) * 1e3) if lat else 0,
                                 **{f"{op}_ops": len(per_sec[s][op]) for op in ("put", "get", "lookup", "attend")}))
        all_lat = defaultdict(list)
        for s in secs:
            for op, v in per_sec[s].items():
                all_lat[op] += v
        warm = [m for m in memory if m["t"] >= 60] or memory
        growth = {n: warm[-1][n] - warm[0][n] for n in pids}
        res = dict(seconds=a.seconds, threads=a.threads, block_bytes=layout.bytes,
                   ops=sum(len(v) for v in all_lat.values()),
                   ops_per_s=sum(len(v) for v in all_lat.values()) / a.seconds,
                   per_op={op: dict(count=len(v), p50_ms=float(np.percentile(v, 50) * 1e3),
                                    p99_ms=float(np.percentile(v, 99) * 1e3)) for op, v in all_lat.items()},
                   errors=dict(errors), mismatches=mismatches[0], rss_growth_after_warmup_mb=growth,
                   rss_end_mb={n: memory[-1][n] for n in pids})
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out + ".json").write_text(json.dumps(dict(result=res, timeline=timeline, memory=memory), indent=1))
        print(f"\nsoak: {a.seconds} s, {a.threads} threads, 4 daemons (R=2), {layout.bytes // 1024} KiB blocks, "
              f"{a.threads * a.chains * 4} distinct blocks ({a.threads * a.chains * 4 * layout.bytes * 2 / 4 / 2**20:.0f} MiB "
              f"per daemon with R=2, against 512 MiB of host DRAM each: the rest lives in RocksDB)")
        print(f"  operations     {res['ops']} ({res['ops_per_s']:.0f}/s); errors {sum(errors.values())}; "
              f"wrong answers {mismatches[0]}")
        for op, d in sorted(res["per_op"].items()):
            print(f"  {op:7s} {d['count']:8d}   p50 {d['p50_ms']:7.2f} ms   p99 {d['p99_ms']:7.2f} ms")
        print("  daemon RSS growth after 60 s warm-up: " + ", ".join(f"{n} {g:+.1f} MB" for n, g in growth.items()))
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(1, 3, figsize=(15, 3.8))
            ax[0].plot([x["t"] for x in timeline], [x["ops"] for x in timeline])
            ax[0].set(xlabel="s", ylabel="operations / s", title="throughput")
            ax[1].plot([x["t"] for x in timeline], [x["p99_ms"] for x in timeline])
            ax[1].set(xlabel="s", ylabel="ms", title="p99 latency (all operations)")
            for n in pids:
                ax[2].plot([m["t"] for m in memory], [m[n] for m in memory], label=n)
            ax[2].set(xlabel="s", ylabel="MB", title="daemon resident memory")
            ax[2].legend()
            for x in ax:
                x.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(a.out + ".png", dpi=100)
            print(f"  wrote {a.out}.json and {a.out}.png")
        except ImportError:
            print(f"  wrote {a.out}.json (no matplotlib: no plot)")
        return 0 if not errors and not mismatches[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
