#!/usr/bin/env python3
"""Sequence lifecycle on GPU daemons (issue 31's H200 checks).

  python3 bench/gpu/seq_lifecycle.py --bin .gpu [--only forks,sessions] [--sessions 1000]

forks:    one 64K-token context appended on 4 kvringd --gpu daemons (R=1), then 64 forks of it
          (ForkSequence); each fork appends a token of its own and attends; every answer is checked
          against torch (float32 attention over the context's first 64K tokens + the fork's own token).
          Stats before and after: store blocks, host pages, HBM pages used and shared: the context is
          kept once.
sessions: chat sessions of 4K-16K tokens opened (appended), decoded (8 tokens each, one row a step),
          and ended (DeleteSequence), 16 at a time; every node's store blocks, host pages, HBM pages,
          open blocks and sequences before and after.
Results into $OUT/seq_lifecycle.json.
"""
import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent


def log(msg):
    print(msg, flush=True)


def totals(c):
    st = c.stats()
    keys = ("blocks", "host_blocks", "cold_blocks", "sequences", "open_blocks", "hbm_shared_pages")
    t = {k: sum(s[k] for s in st) for k in keys}
    t["host_pages_used"] = sum(s["num_pages"] - s["free_pages"] for s in st)
    t["hbm_pages_used"] = sum(s["hbm_pages"] - s["hbm_free_pages"] for s in st)
    return t


def reference(q, k, v):
    """q [rows, hq, d], k/v [t, hkv, d] on the GPU: float32 attention of every row over all of k/v."""
    hq, hkv = q.shape[1], k.shape[1]
    kk = k.float().repeat_interleave(hq // hkv, 1).transpose(0, 1)  # [hq, t, d]
    vv = v.float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
    s = torch.einsum("rhd,htd->hrt", q.float(), kk) / math.sqrt(q.shape[2])
    return torch.einsum("hrt,htd->rhd", torch.softmax(s, -1), vv)


def append(c, L, sid, have, k, v, chunk=4096):
    import kvring.torch as kt
    for layer in range(L.layers):
        for a in range(0, k.shape[0], chunk):
            kk, vv = k[a:a + chunk, layer], v[a:a + chunk, layer]
            kt.step(c, L, [(sid, have + a, 0, kk.shape[0])], torch.empty((0, 32, L.head_dim), dtype=torch.bfloat16,
                    device="cuda"), [], kk.contiguous(), vv.contiguous(), layer=layer)


def forks(c, L, args, res):
    import kvring.torch as kt
    T, n = args.context, args.forks
    g = torch.Generator(device="cuda").manual_seed(3)
    k = torch.randn(T, L.layers, L.kv_heads, L.head_dim, generator=g, device="cuda").bfloat16()
    v = torch.randn(T, L.layers, L.kv_heads, L.head_dim, generator=g, device="cuda").bfloat16()
    t0 = time.time()
    append(c, L, "ctx", 0, k, v)
    res["context_append_s"] = time.time() - t0
    q = torch.randn(1, 32, L.head_dim, generator=g, device="cuda").bfloat16()
    kt.step(c, L, [("ctx", T, 1, 0)], q, [T - 1], layer=0)  # the context's pages into HBM
    before = totals(c)
    t0 = time.time()
    rep = [c.fork_sequence("ctx", f"fork{i}", T) for i in range(n)]
    res["fork_seconds_each"] = (time.time() - t0) / n
    res["fork_blocks_shared_each"] = rep[0]["blocks_shared"]
    res["fork_blocks_copied_each"] = rep[0]["blocks_copied"]
    worst = 0.0
    t0 = time.time()
    for i in range(n):
        nk = torch.randn(1, L.layers, L.kv_heads, L.head_dim, generator=g, device="cuda").bfloat16()
        nv = torch.randn(1, L.layers, L.kv_heads, L.head_dim, generator=g, device="cuda").bfloat16()
        qi = torch.randn(1, 32, L.head_dim, generator=g, device="cuda").bfloat16()
        for layer in range(L.layers):
            out, _ = kt.step(c, L, [(f"fork{i}", T, 1, 1)], qi, [T], nk[:, layer].contiguous(), nv[:, layer].contiguous(),
                             layer=layer)
            if layer == 0 or i % 8 == 0:
                ref = reference(qi, torch.cat([k[:, layer], nk[:, layer]]), torch.cat([v[:, layer], nv[:, layer]]))
                worst = max(worst, ((out - ref).norm() / ref.norm()).item())
    res["fork_decode_seconds"] = time.time() - t0
    after = totals(c)
    res["forks_before"], res["forks_after"] = before, after
    res["forks_max_rel_l2"] = worst
    ctx_blocks = T // L.block_tokens
    res["forks_ok"] = (worst < 2e-2 and after["blocks"] - before["blocks"] < ctx_blocks // 4 and
                       after["hbm_pages_used"] - before["hbm_pages_used"] < ctx_blocks // 2 and
                       after["hbm_shared_pages"] >= ctx_blocks // 2)
    for i in range(n):
        c.delete_sequence(f"fork{i}")
    c.delete_sequence("ctx")
    res["forks_end"] = totals(c)
    log(f"forks: {n} forks of a {T}-token context: {res['fork_blocks_shared_each']} blocks shared and "
        f"{res['fork_blocks_copied_each']} copied each; store blocks {before['blocks']} -> {after['blocks']}, "
        f"HBM pages {before['hbm_pages_used']} -> {after['hbm_pages_used']} ({after['hbm_shared_pages']} shared); "
        f"max rel L2 {worst:.2e}")


def sessions(c, L, args, res):
    import kvring.torch as kt
    g = torch.Generator(device="cuda").manual_seed(4)
    lengths = torch.randint(4096, 16385, (args.sessions,), generator=g, device="cuda").tolist()
    base = totals(c)
    t0 = time.time()
    peak = dict(base)
    for b in range(0, args.sessions, 16):
        ids = [f"chat{i}" for i in range(b, min(args.sessions, b + 16))]
        for i, sid in enumerate(ids):
            n = lengths[b + i]
            k = torch.randn(n, L.layers, L.kv_heads, L.head_dim, generator=g, device="cuda").bfloat16()
            append(c, L, sid, 0, k, k)
        for step in range(8):
            for layer in range(L.layers):
                seqs = [(sid, lengths[b + i] + step, 1, 1) for i, sid in enumerate(ids)]
                nk = torch.randn(len(ids), L.kv_heads, L.head_dim, generator=g, device="cuda").bfloat16()
                q = torch.randn(len(ids), 32, L.head_dim, generator=g, device="cuda").bfloat16()
                kt.step(c, L, seqs, q, [s[1] for s in seqs], nk, nk, layer=layer)
        if b == 0:
            peak = totals(c)
        for sid in ids:
            c.delete_sequence(sid)
        if (b // 16) % 10 == 0:
            log(f"sessions: {b + len(ids)}/{args.sessions} ended ({time.time() - t0:.0f} s)")
    end = totals(c)
    res["sessions"] = args.sessions
    res["sessions_tokens"] = sum(lengths) + 8 * args.sessions
    res["sessions_seconds"] = time.time() - t0
    res["sessions_before"], res["sessions_peak_16"], res["sessions_after"] = base, peak, end
    same = {k: (base[k], end[k]) for k in base if base[k] != end[k]}
    res["sessions_differences"] = same
    res["sessions_ok"] = not same
    log(f"sessions: {args.sessions} sessions, {res['sessions_tokens']} tokens, {res['sessions_seconds']:.0f} s; "
        f"before {base}; after {end}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin", default=str(ROOT.parents[1] / ".gpu"))
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    p.add_argument("--only", default="forks,sessions")
    p.add_argument("--context", type=int, default=65536)
    p.add_argument("--forks", type=int, default=64)
    p.add_argument("--sessions", type=int, default=1000)
    args = p.parse_args()
    from kvring.local_cluster import start_mps
    print("[mps] " + start_mps(), flush=True)  # before this process's first CUDA call: the default deployment (docs/MPS.md)
    import kvring
    from kvring.local_cluster import LocalCluster
    L = kvring.Layout(block_tokens=16, layers=2, kv_heads=8, head_dim=128, dtype="bf16")
    res = {"date": time.strftime("%Y-%m-%d"), "layout": "16 tokens x 2 layers x 8 kv heads x d128 bf16 (128 KiB)"}
    with LocalCluster(nodes=4, port=8600, replication=1, host_bytes="16G", page_bytes=str(128 << 10), gpu=0,
                      hbm_bytes="16G", chunk_blocks=64, bin=args.bin, root=ROOT.parents[1]) as cl:
        c = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=120)
        if "forks" in args.only:
            forks(c, L, args, res)
        if "sessions" in args.only:
            sessions(c, L, args, res)
        c.close()
    ok = res.get("forks_ok", True) and res.get("sessions_ok", True)
    res["ok"] = ok
    log(json.dumps(res, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "seq_lifecycle.json").write_text(json.dumps(res, indent=1))
    log("seq_lifecycle: " + ("passed" if ok else "FAILED"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
