#!/usr/bin/env python3
"""Where a Put's time goes: the CPU each thread of the client process and of
the daemons uses while kvring puts 2 MiB blocks, sampled from /proc (for
hosts without perf).

  python3 bench/put_probe.py [--bin build] [--nodes 1] [--blocks 512] [--gpu -1]

Starts a local cluster (deploy/local-cluster.sh), puts --blocks new blocks
from host memory three times, and prints the rate and, per process, the
threads that were busiest: CPU seconds over wall seconds (1.0 = a core the
whole time). A thread near 1.0 bounds the Put.
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def thread_cpu(pid):
    """{(tid, name): CPU seconds} of a process's threads."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[(tid, name)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin", default=str(ROOT / "build"))
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--gpu", type=int, default=-1)
    p.add_argument("--port", type=int, default=7750)
    args = p.parse_args()
    sys.path.insert(0, str(Path(args.bin) / "python"))
    import kvring
    from kvring.local_cluster import LocalCluster
    layout = kvring.Layout(16, 32, 8, 128, "bf16")  # 2 MiB blocks
    n = args.blocks
    host_bytes = f"{max(2, (4 * n * layout.bytes) // args.nodes // (1 << 30) + 1)}G"
    with LocalCluster(nodes=args.nodes, port=args.port, replication=1, host_bytes=host_bytes, page_bytes="2M",
                      gpu=args.gpu, hbm_bytes="256M" if args.gpu >= 0 else "0", bin=args.bin, root=ROOT) as cl:
        c = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=120)
        src = np.random.default_rng(1).integers(0, 1 << 14, (n, layout.bytes // 2), dtype=np.int16)
        daemons = [int(x) for x in subprocess.run(["pgrep", "-f", f"kvringd.*{cl.dir}"], capture_output=True,
                                                  text=True).stdout.split()]
        procs = {"client": os.getpid(), **{f"daemon{i}": pid for i, pid in enumerate(daemons)}}

        rng = np.random.default_rng(2)

        def put(rep):
            # Random keys, as chain hashes are: placement reads the key's high half.
            k = rng.integers(0, np.iinfo(np.uint64).max, (n, 2), dtype=np.uint64, endpoint=True)
            t0 = time.perf_counter()
            c.put(k, src, layout)
            return time.perf_counter() - t0

        put(0)  # warm: buffers, connections
        before = {name: thread_cpu(pid) for name, pid in procs.items()}
        t0 = time.perf_counter()
        times = [put(rep) for rep in range(1, 4)]
        wall = time.perf_counter() - t0
        after = {name: thread_cpu(pid) for name, pid in procs.items()}
        print(f"put {n} x 2 MiB to {args.nodes} daemon(s): {n * layout.bytes / min(times) / 1e9:.2f} GB/s (best of 3; "
              f"{wall:.2f} s for all three)")
        for name in procs:
            busy = sorted(((after[name][t] - before[name].get(t, 0.0)) / wall, t[1]) for t in after[name])[::-1]
            total = sum(b for b, _ in busy)
            print(f"  {name}: {total:.2f} cores in all; busiest threads: " +
                  ", ".join(f"{tname} {b:.2f}" for b, tname in busy[:6] if b > 0.005))
        c.close()


if __name__ == "__main__":
    main()
