#!/usr/bin/python3
"""Workload 3, kvring as an engine's cache backend: batches of requests as a
serving engine's scheduler issues them. For each batch: hash every prompt's
blocks, look up the cached prefixes (one lookup per request), read the hit
blocks straight into the engine's preallocated paged KV pool (get_into, one
call for the batch), "compute" the missed blocks (random data: this
workload measures the cache, not a model) and write them back (one put for
the batch). Prompts share prefixes the way production traffic does: a few
long system prompts, few-shot templates, and repeated documents.

Layout: 16 tokens x 4 layers x 8 kv heads x 128 (bf16) = 256 KiB blocks, a
Llama-3-8B block cut to 4 layers so a laptop-sized cluster holds enough.
Reports blocks and GB/s moved, hit rate, and per-batch latency of lookup,
get and put (p50/p99).

  /usr/bin/python3 clients/examples/cache_backend.py [--quick] [--batches 24 --batch 16]
"""
import time

import numpy as np

import kvring
import workload_common as wc


def main():
    p = wc.parser(__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=24)
    p.add_argument("--batch", type=int, default=16, help="requests per batch")
    p.add_argument("--host_bytes", default="2G", help="host-DRAM tier per daemon of the local cluster")
    a = p.parse_args()
    if a.quick:
        a.batches, a.batch = 6, 8
    rng = np.random.default_rng(a.seed)
    layout = kvring.Layout(16, 4, 8, 128, "bf16")
    bt = layout.block_tokens
    with wc.cluster(a, page_bytes="256K", host_bytes=a.host_bytes) as (coord, admin, _):
        client = kvring.Client(coord, wc.tenant(coord, admin, "engine"))
        model = "llama-3-8b-4l"
        prefixes = [rng.integers(0, 128000, int(n)) for n in rng.integers(256, 2048, 6)]  # system prompts / templates
        docs = [rng.integers(0, 128000, 1024) for _ in range(20)]                         # repeated documents
        pool = np.empty((4096,) + tuple(layout.block_shape), np.uint16)                   # the engine's paged KV pool
        rows, t0 = [], time.time()
        for b in range(a.batches):
            prompts = []
            for _ in range(a.batch):
                parts = [prefixes[int(rng.integers(len(prefixes)))]]
                if rng.random() < 0.5:
                    parts.append(docs[int(rng.zipf(1.5)) % len(docs)])
                parts.append(rng.integers(0, 128000, int(rng.integers(32, 512))))  # the user's own tokens
                prompts.append(np.concatenate(parts))
            chains = [client.chain(model, layout, pr) for pr in prompts]
            tl = time.time()
            hits = [client.lookup(k) for k in chains]
            lookup_s = time.time() - tl
            hit_keys = np.concatenate([k[:h] for k, h in zip(chains, hits)] + [np.zeros((0, 2), np.uint64)])
            # One block may be hit by several requests of the batch: read each once.
            hit_keys = np.unique(hit_keys, axis=0) if len(hit_keys) else hit_keys
            n_hit = min(len(hit_keys), len(pool))
            tg = time.time()
            found = client.get_into(hit_keys[:n_hit], layout, pool[:n_hit]) if n_hit else np.zeros(0, bool)
            get_s = time.time() - tg
            # The misses: computed by the engine (random here), then saved in one batch.
            put_keys, parents, seen = [], [], set()
            for k, h in zip(chains, hits):
                for i in range(h, len(k)):
                    kk = (int(k[i, 0]), int(k[i, 1]))
                    if kk in seen:
                        continue
                    seen.add(kk)
                    put_keys.append(k[i])
            # Blocks of one request are chained; a put per request keeps each
            # chain's parent links. (The "computed" KV is made before timing.)
            todo = [(k[h:], k[h - 1] if h else None) for k, h in zip(chains, hits) if h < len(k)]
            computed = rng.integers(0, 0x3f00, (sum(len(t[0]) for t in todo),) + tuple(layout.block_shape), dtype=np.uint16)
            tp, at = time.time(), 0
            for keys, parent in todo:
                client.put(keys, computed[at:at + len(keys)], layout, parent=parent)
                at += len(keys)
            put_s = time.time() - tp
            total = sum(len(k) for k in chains)
            rows.append(dict(batch=b, blocks=total, hit_blocks=sum(hits), read_blocks=int(found.sum()),
                             written_blocks=len(put_keys), lookup_s=lookup_s, get_s=get_s, put_s=put_s))
            if (b + 1) % max(1, a.batches // 8) == 0:
                print(f"[cache] batch {b + 1}/{a.batches}: hit {sum(hits)}/{total} blocks, lookup {lookup_s * 1e3:.1f} ms, "
                      f"get {int(found.sum())} blocks {get_s * 1e3:.1f} ms, put {len(put_keys)} blocks {put_s * 1e3:.1f} ms",
                      flush=True)
        B = layout.bytes
        read = sum(r["read_blocks"] for r in rows)
        written = sum(r["written_blocks"] for r in rows)
        res = dict(batches=a.batches, batch=a.batch, block_bytes=B,
                   hit_rate=sum(r["hit_blocks"] for r in rows) / sum(r["blocks"] for r in rows),
                   read_gb=read * B / 1e9, written_gb=written * B / 1e9,
                   get_gbps=read * B / 1e9 / max(1e-9, sum(r["get_s"] for r in rows)),
                   put_gbps=written * B / 1e9 / max(1e-9, sum(r["put_s"] for r in rows)),
                   lookup_p50_ms=wc.pct([r["lookup_s"] for r in rows], 50) * 1e3,
                   lookup_p99_ms=wc.pct([r["lookup_s"] for r in rows], 99) * 1e3,
                   get_p50_ms=wc.pct([r["get_s"] for r in rows], 50) * 1e3,
                   get_p99_ms=wc.pct([r["get_s"] for r in rows], 99) * 1e3,
                   put_p50_ms=wc.pct([r["put_s"] for r in rows], 50) * 1e3,
                   put_p99_ms=wc.pct([r["put_s"] for r in rows], 99) * 1e3, seconds=time.time() - t0)
        print(f"\ncache backend: {a.batches} batches of {a.batch} requests, {B // 1024} KiB blocks")
        print(f"  block hit rate   {res['hit_rate']:.3f}")
        print(f"  read  {res['read_gb']:.2f} GB at {res['get_gbps']:.2f} GB/s   (get p50 {res['get_p50_ms']:.1f} ms, p99 {res['get_p99_ms']:.1f} ms per batch)")
        print(f"  wrote {res['written_gb']:.2f} GB at {res['put_gbps']:.2f} GB/s   (put p50 {res['put_p50_ms']:.1f} ms, p99 {res['put_p99_ms']:.1f} ms per batch)")
        print(f"  lookup per batch p50 {res['lookup_p50_ms']:.1f} ms, p99 {res['lookup_p99_ms']:.1f} ms ({a.batch} requests)")
        st = [n for n in client.stats() if n["ok"]]
        res["host_blocks"] = sum(n["host_blocks"] for n in st)
        res["cold_blocks"] = sum(n["cold_blocks"] for n in st)
        res["evictions"] = sum(n["evictions"] for n in st)
        print(f"  cluster          {res['host_blocks']} blocks in host DRAM, {res['cold_blocks']} only on SSD (RocksDB), "
              f"{res['evictions']} evictions")
        wc.write_json(a.out_dir, "cache_backend.json", dict(result=res, batches=rows))
        return res


if __name__ == "__main__":
    main()
