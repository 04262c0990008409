#!/usr/bin/env python3
"""GPU nodes end to end: kvringd daemons with --gpu sharing one GPU, driven
through the client library (C ABI, kvring.torch), every answer checked
against attention computed by torch on the same K/V.

  python3 bench/gpu/e2e.py --bin .gpu --out $OUT [--quick]
  python3 bench/gpu/e2e.py --device cpu --bin build --quick   # a dry run with CPU daemons and small sizes

1. correctness: 4 GPU daemons; sequences of 8K-512K tokens with Llama-3-8B
   (32 q / 8 kv heads) and Llama-3-70B (64 q / 8 kv heads) head shapes,
   stored with PutSequence from CUDA tensors; decode steps with append
   (crossing block boundaries) and a chunked prefill step, against a float32
   torch reference (bf16 tolerance).
2. latency: per-layer decode step (append + attend) at batch 1/8/32 on 1 and
   4 shards, p50/p99, its breakdown (transfer, copies, kernel, merge), beside
   the local kernel (kvring's paged decode on the same K/V in this process)
   and torch SDPA; bytes moved per step against pulling the KV.
3. GetInto into device memory against pinned host-to-device copies.
4. faults: kill -9 of a GPU daemon under append + attend load with R=2;
   oversize requests and HBM exhaustion.
Results: printed tables and $OUT/e2e.json.
"""
import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
HKV, D, BT = 8, 128, 16
SHAPES = {"llama3-8b": 32, "llama3-70b": 64}  # q heads (8 kv heads, head_dim 128)


def log(*a):
    print(*a, flush=True)


def reference(q, k, v, q_pos, scale=None):
    """Float32 attention of q [T, HQ, D] at positions q_pos over k, v [S, HKV, D] at positions 0..S-1,
    causal; returns (out [T, HQ, D], lse [T, HQ])."""
    T, HQ, _ = q.shape
    S = k.shape[0]
    G = HQ // HKV
    scale = scale or 1.0 / math.sqrt(D)
    out = torch.empty((T, HQ, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((T, HQ), dtype=torch.float32, device=q.device)
    kpos = torch.arange(S, device=q.device)
    for h in range(HKV):
        kh = k[:, h, :].float()
        vh = v[:, h, :].float()
        for r0 in range(0, T, 16):
            r1 = min(T, r0 + 16)
            qg = q[r0:r1, h * G:(h + 1) * G, :].float()  # [t, G, D]
            s = torch.einsum("tgd,sd->tgs", qg, kh) * scale
            mask = kpos[None, None, :] > q_pos[r0:r1, None, None]
            s.masked_fill_(mask, float("-inf"))
            l = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - l[..., None])
            out[r0:r1, h * G:(h + 1) * G] = torch.einsum("tgs,sd->tgd", p, vh)
            lse[r0:r1, h * G:(h + 1) * G] = l
    return out, lse


def rel_l2(a, b):
    return (torch.linalg.vector_norm((a - b).double()) / torch.linalg.vector_norm(b.double())).item()


class Seq:
    """One sequence: its K/V per layer (kept here only to check against), and its length."""

    def __init__(self, sid, layers, tokens, dev):
        self.id, self.layers = sid, layers
        self.k = [torch.randn(tokens, HKV, D, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
        self.v = [torch.randn(tokens, HKV, D, dtype=torch.bfloat16, device=dev) for _ in range(layers)]

    @property
    def tokens(self):
        return self.k[-1].shape[0]

    def blocks(self, b0, b1):
        """Blocks [b0, b1) in kvring's layout [n, layers, 2, kv_heads, bt, D] (a CUDA tensor)."""
        parts = []
        for l in range(self.layers):
            kk = self.k[l][b0 * BT:b1 * BT].view(b1 - b0, BT, HKV, D).permute(0, 2, 1, 3)
            vv = self.v[l][b0 * BT:b1 * BT].view(b1 - b0, BT, HKV, D).permute(0, 2, 1, 3)
            parts.append(torch.stack([kk, vv], dim=1))
        return torch.stack(parts, dim=1).contiguous()


def put_sequence(client, kt, layout, seq, chunk_blocks=2048):
    """The sequence's full blocks by PutSequence (from CUDA tensors), the rest by an append-only step."""
    n = seq.tokens // BT
    keys = np.zeros((n, 2), np.uint64)
    keys[:, 0] = np.arange(1, n + 1, dtype=np.uint64)
    keys[:, 1] = np.uint64(abs(hash(seq.id)) & 0xFFFFFFFF) + np.uint64(1 << 40)
    for b0 in range(0, n, chunk_blocks):
        b1 = min(n, b0 + chunk_blocks)
        kt.put_sequence(client, seq.id, b0, keys[b0:b1], seq.blocks(b0, b1), layout)
    rem = seq.tokens - n * BT
    if rem:
        dev = seq.k[0].device
        for l in range(seq.layers):
            kt.step(client, layout, [(seq.id, n * BT, 0, rem)], torch.empty(0, 8, D, dtype=torch.bfloat16, device=dev),
                    torch.empty(0, dtype=torch.int64), seq.k[l][n * BT:], seq.v[l][n * BT:], layer=l)


def decode_step(client, kt, layout, seqs, layer, hq, dev, rows=1, check=True):
    """One step on `layer`: each sequence appends `rows` tokens and attends with `rows` queries at them."""
    qs, ks, vs, pos, spec = [], [], [], [], []
    for s in seqs:
        ctx = s.k[layer].shape[0]
        qs.append(torch.randn(rows, hq, D, dtype=torch.bfloat16, device=dev))
        ks.append(torch.randn(rows, HKV, D, dtype=torch.bfloat16, device=dev))
        vs.append(torch.randn(rows, HKV, D, dtype=torch.bfloat16, device=dev))
        pos += list(range(ctx, ctx + rows))
        spec.append((s.id, ctx, rows, rows))
    q, nk, nv = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    out, lse, rep = kt.step(client, layout, spec, q, torch.tensor(pos), nk, nv, layer=layer, report=True)
    errs = []
    for i, s in enumerate(seqs):
        s.k[layer] = torch.cat([s.k[layer], ks[i]])
        s.v[layer] = torch.cat([s.v[layer], vs[i]])
        if check:
            qp = torch.tensor(pos[i * rows:(i + 1) * rows], device=dev)
            ro, rl = reference(qs[i], s.k[layer], s.v[layer], qp)
            o = out[i * rows:(i + 1) * rows]
            l = lse[i * rows:(i + 1) * rows]
            errs.append((rel_l2(o, ro), (l - rl).abs().max().item()))
    return errs, rep


def correctness(args, kvring, kt, dev, results):
    from kvring.local_cluster import LocalCluster
    layers = 2
    layout = kvring.Layout(BT, layers, HKV, D, "bf16")
    lens = [8192, 32768, 131072] + ([] if args.quick else [524288])
    if dev.type == "cpu":
        lens = [1000, 3000]
    chunk = 2048  # blocks: 32K tokens a chunk, so long sequences span the four daemons
    rows_out = []
    if dev.type == "cpu":
        chunk = 64
    with LocalCluster(nodes=4, port=7700, replication=1, host_bytes="6G" if args.gpu >= 0 else "512M",
                      page_bytes=str(layout.bytes), gpu=args.gpu, hbm_bytes="12G", chunk_blocks=chunk, bin=args.bin,
                      root=ROOT, gpus=args.gpu_list) as cl:
        c = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=60)
        for shape, hq in SHAPES.items():
            for n in lens:
                s = Seq(f"{shape}-{n}", layers, n, dev)
                t0 = time.time()
                put_sequence(c, kt, layout, s)
                put_s = time.time() - t0
                worst, worst_lse = 0.0, 0.0
                # decode with append: 20 steps (crossing a block boundary), both layers
                for step in range(20 if n <= 32768 and dev.type == "cuda" else 4):
                    for l in range(layers):
                        errs, rep = decode_step(c, kt, layout, [s], l, hq, dev)
                        worst = max(worst, max(e[0] for e in errs))
                        worst_lse = max(worst_lse, max(e[1] for e in errs))
                # a chunked prefill step: 128 new tokens, 128 causal rows
                for l in range(layers):
                    errs, rep = decode_step(c, kt, layout, [s], l, hq, dev, rows=128)
                    worst = max(worst, max(e[0] for e in errs))
                    worst_lse = max(worst_lse, max(e[1] for e in errs))
                ok = worst < 1e-2 and worst_lse < 1e-2
                rows_out.append({"shape": shape, "tokens": n, "put_s": put_s, "max_rel_l2": worst,
                                 "max_lse_err": worst_lse, "shards": rep["shards"], "ok": ok})
                log(f"  {shape:11s} {n:7d} tokens: put {put_s:6.2f} s, decode+prefill max rel L2 {worst:.2e}, "
                    f"max |dLSE| {worst_lse:.2e}, {rep['shards']} shards  {'OK' if ok else 'FAIL'}")
            # A batch in one step: three sequences of other lengths (tails not block-aligned), 24 decode steps.
            base = 40000 if dev.type == "cuda" else 900
            b = [Seq(f"{shape}-batch-{i}", layers, base + 99 * i + 7, dev) for i in range(3)]
            for s in b:
                put_sequence(c, kt, layout, s)
            worst = 0.0
            for step in range(24):
                for l in range(layers):
                    errs, rep = decode_step(c, kt, layout, b, l, hq, dev)
                    worst = max([worst] + [e[0] for e in errs] + [e[1] for e in errs])
            ok = worst < 1e-2
            rows_out.append({"shape": shape, "tokens": [s.tokens for s in b], "batch": 3, "max_err": worst, "ok": ok})
            log(f"  {shape:11s} batch of 3 (40K-48K, unaligned tails), 24 steps: max error {worst:.2e}  {'OK' if ok else 'FAIL'}")
        stats = c.stats()
        results["correctness"] = rows_out
        results["correctness_nodes"] = stats
        log("  nodes: " + ", ".join(f"{x['node_id']} {x['backend']} hbm {x['hbm_blocks']} blocks "
                                    f"({x['hbm_pages'] - x['hbm_free_pages']}/{x['hbm_pages']} pages)" for x in stats))
        c.close()
    return all(r["ok"] for r in rows_out)


def local_kernel_ms(seqs_kv, hq, dev, iters=100):
    """kvring's paged decode kernel, in this process, on the same K/V (the local baseline), and torch SDPA."""
    import ctypes
    sys.path.insert(0, str(ROOT / "bench/gpu"))
    import kvbench
    lib = kvbench.load_lib(str(Path(ARGS.bin) / "lib/libkvring_cuda_capi.so"))
    B = len(seqs_kv)
    L = seqs_kv[0][0].shape[0]
    npg = (L + BT - 1) // BT
    pool = torch.zeros(B * npg, 2, HKV, BT, D, dtype=torch.bfloat16, device=dev)
    for i, (k, v) in enumerate(seqs_kv):
        kk = torch.zeros(npg * BT, HKV, D, dtype=torch.bfloat16, device=dev)
        vv = torch.zeros_like(kk)
        kk[:L], vv[:L] = k, v
        pool[i * npg:(i + 1) * npg, 0] = kk.view(npg, BT, HKV, D).permute(0, 2, 1, 3)
        pool[i * npg:(i + 1) * npg, 1] = vv.view(npg, BT, HKV, D).permute(0, 2, 1, 3)
    ids = torch.arange(B * npg, dtype=torch.int32, device=dev)
    ppos = (torch.arange(npg, device=dev, dtype=torch.int32) * BT).repeat(B)
    spb = torch.arange(B + 1, dtype=torch.int32, device=dev) * npg
    stok = torch.full((B,), L, dtype=torch.int32, device=dev)
    q = torch.randn(B, hq, D, dtype=torch.bfloat16, device=dev)
    qpos = torch.full((B,), L - 1, dtype=torch.int32, device=dev)
    srb = torch.arange(B + 1, dtype=torch.int32, device=dev)
    out = torch.empty(B, hq, D, dtype=torch.float32, device=dev)
    lse = torch.empty(B, hq, dtype=torch.float32, device=dev)
    sm = torch.cuda.get_device_properties(dev).multi_processor_count
    splits = lib.kvring_cuda_decode_splits(B, HKV, hq, 1, npg, BT, sm)
    ws = torch.zeros(max(1, lib.kvring_cuda_decode_workspace(B, hq, splits, D)), dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream().cuda_stream

    def run():
        e = lib.kvring_cuda_decode(pool.data_ptr(), 2 * HKV * BT * D * 2, BT, 1, HKV, D, 0, 0, ids.data_ptr(), ppos.data_ptr(),
                                   spb.data_ptr(), stok.data_ptr(), B, q.data_ptr(), qpos.data_ptr(), srb.data_ptr(), B, hq,
                                   1, ctypes.c_float(0.0), 1, 0, splits, ws.data_ptr(), ws.numel(), out.data_ptr(),
                                   lse.data_ptr(), ctypes.c_void_p(stream), 0)
        assert e == 0, e

    def timed(f):
        for _ in range(10):
            f()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(iters):
            s.record()
            f()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        return statistics.median(ts)

    kernel = timed(run)
    kd = torch.stack([k for k, _ in seqs_kv]).transpose(1, 2).repeat_interleave(hq // HKV, dim=1)
    vd = torch.stack([v for _, v in seqs_kv]).transpose(1, 2).repeat_interleave(hq // HKV, dim=1)
    qd = q.view(B, hq, 1, D)
    sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd))
    return kernel, sdpa


def latency(args, kvring, kt, dev, results):
    from kvring.local_cluster import LocalCluster
    layout = kvring.Layout(BT, 1, HKV, D, "bf16")
    hq = SHAPES["llama3-8b"]
    ctx = 32768 if dev.type == "cuda" else 2048
    rows_out = []
    steps = 60 if args.quick else 200
    # (shards, batches, UCX progress: spin microseconds of daemons and client, busy poll, and the rows up to
    # which the daemons serve a step on their UCX thread: --ucx_inline_attend_rows)
    # (-1: the daemon's default, 64 rows on a GPU node, 0 on a CPU node)
    configs = [(int(n), (1, 8, 32), -1, False, -1) for n in args.shards.split(",")]
    if args.inline_compare:  # steps on the daemons' UCX thread against the handler pool, one process each
        configs = [(1, (1, 8), -1, False, 0), (1, (1, 8), -1, False, 64), (1, (1,), 200, False, 0),
                   (1, (1,), 200, False, 64), (4, (1,), -1, False, 0), (4, (1,), -1, False, 64)]
    elif dev.type == "cuda" and args.shards == "1,4":  # the UCX progress settings compared (bench/RESULTS.md)
        configs += [(1, (1,), 200, False, -1), (1, (1,), 0, True, -1), (4, (1,), 0, True, -1)]
    else:
        configs = [(1, (1, 4), -1, False, -1), (4, (1,), -1, False, -1), (1, (1,), -1, False, 64)]
    for shards, batches, spin, busy, inline in configs:
        chunk = max(1, (ctx // BT + shards - 1) // shards)
        dflags = ((f"--ucx_spin_us={spin}" if spin >= 0 else "") + (" --ucx_busy_poll" if busy else "") +
                  (f" --ucx_inline_attend_rows={inline}" if inline >= 0 else ""))
        with LocalCluster(nodes=shards, port=7800, replication=1, host_bytes="8G" if args.gpu >= 0 else "512M",
                          page_bytes=str(layout.bytes), gpu=args.gpu, hbm_bytes="10G", chunk_blocks=chunk, bin=args.bin,
                          root=ROOT, daemon_flags=dflags, gpus=args.gpu_list) as cl:
            c = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=60, ucx_spin_us=spin, ucx_busy_poll=busy)
            cx = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=60, ucx_spin_us=spin, ucx_busy_poll=busy,
                               device_exchange_min_bytes=0)
            for batch in batches:
                seqs = [Seq(f"lat-{shards}-{batch}-{i}", 1, ctx - 5, dev) for i in range(batch)]
                for s in seqs:
                    put_sequence(c, kt, layout, s)
                # host buffers (the C++ client path): q, new K/V
                q = np.random.standard_normal((batch, hq, D)).astype(np.float32)
                nk = torch.randn(batch, HKV, D, dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
                nv = torch.randn(batch, HKV, D, dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
                lengths = [s.tokens for s in seqs]
                walls, reps = [], []
                for it in range(steps + 10):
                    spec = [(s.id, lengths[i], 1, 1) for i, s in enumerate(seqs)]
                    pos = np.array(lengths, np.int64)
                    t0 = time.perf_counter()
                    out, lse, rep = c.step(layout, spec, q, pos, nk, nv, layer=0, report=True)
                    wall = time.perf_counter() - t0
                    lengths = [x + 1 for x in lengths]
                    if it >= 10:
                        walls.append(wall)
                        reps.append(rep)
                # The engine's tensors on the GPU (kvring.torch): a GPU node on this host reads the queries
                # and K/V and writes its partial in the client's exchange buffer (CUDA IPC), merged there.
                # Both ways: staged (the client's default for steps this small) and forced through the exchange.
                dreps, xreps = [], []
                if dev.type == "cuda":
                    qd = torch.randn(batch, hq, D, dtype=torch.bfloat16, device=dev)
                    nkd = torch.randn(batch, HKV, D, dtype=torch.bfloat16, device=dev)
                    nvd = torch.randn(batch, HKV, D, dtype=torch.bfloat16, device=dev)
                    for client, reps_out in ((c, dreps), (cx, xreps)):
                        for it in range(steps + 10):
                            spec = [(s.id, lengths[i], 1, 1) for i, s in enumerate(seqs)]
                            _, _, rep = kt.step(client, layout, spec, qd, np.array(lengths, np.int64), nkd, nvd,
                                                layer=0, report=True)
                            lengths = [x + 1 for x in lengths]
                            if it >= 10:
                                reps_out.append(rep)
                kernel_ms = sdpa_ms = float("nan")
                if dev.type == "cuda":
                    kv_local = [(torch.randn(lengths[i], HKV, D, dtype=torch.bfloat16, device=dev),
                                 torch.randn(lengths[i], HKV, D, dtype=torch.bfloat16, device=dev)) for i in range(batch)]
                    kernel_ms, sdpa_ms = local_kernel_ms(kv_local, hq, dev)
                    del kv_local

                def pct(xs, p):
                    return sorted(xs)[min(len(xs) - 1, int(p / 100 * len(xs)))]

                rt = [r["seconds"] for r in reps]
                row = {
                    "shards": shards, "batch": batch, "context": ctx, "ucx_spin_us": spin, "ucx_busy_poll": busy,
                    "inline_attend_rows": inline,
                    "round_trip_p50_us": pct(rt, 50) * 1e6, "round_trip_p99_us": pct(rt, 99) * 1e6,
                    "python_wall_p50_us": pct(walls, 50) * 1e6,
                    "node_p50_us": pct([r["node_seconds"] for r in reps], 50) * 1e6,
                    "kernel_p50_us": pct([r["kernel_seconds"] for r in reps], 50) * 1e6,
                    "copies_p50_us": pct([r["copy_seconds"] for r in reps], 50) * 1e6,
                    "merge_p50_us": pct([r["merge_seconds"] for r in reps], 50) * 1e6,
                    "local_kernel_us": kernel_ms * 1e3, "local_sdpa_us": sdpa_ms * 1e3,
                    "bytes_per_step": reps[-1]["bytes_sent"] + reps[-1]["bytes_received"],
                    "pull_bytes_per_step": sum(lengths) * HKV * D * 2 * 2,
                }
                for name, rs in (("device", dreps), ("exchange", xreps)):
                    if not rs:
                        continue
                    drt = [r["seconds"] for r in rs]
                    row.update({f"{name}_round_trip_p50_us": pct(drt, 50) * 1e6,
                                f"{name}_round_trip_p99_us": pct(drt, 99) * 1e6,
                                f"{name}_node_p50_us": pct([r["node_seconds"] for r in rs], 50) * 1e6,
                                f"{name}_kernel_p50_us": pct([r["kernel_seconds"] for r in rs], 50) * 1e6,
                                f"{name}_copies_p50_us": pct([r["copy_seconds"] for r in rs], 50) * 1e6,
                                f"{name}_merge_p50_us": pct([r["merge_seconds"] for r in rs], 50) * 1e6,
                                f"{name}_shards_in_place": rs[-1]["shards_in_place"],
                                f"{name}_bytes_per_step": rs[-1]["bytes_sent"] + rs[-1]["bytes_received"]})
                row["transfer_p50_us"] = row["round_trip_p50_us"] - row["node_p50_us"] - row["merge_p50_us"]
                row["over_local_us"] = row["round_trip_p50_us"] - row["local_kernel_us"]
                rows_out.append(row)
                log(f"  {shards} shard(s), batch {batch:2d}, {ctx // 1024}K, UCX {'busy-poll' if busy else f'spin {spin}'}"
                    f"{', steps on the UCX thread' if inline > 0 else ', steps on the pool' if inline == 0 else ''}: "
                    f"round trip p50 {row['round_trip_p50_us']:7.1f} us p99 {row['round_trip_p99_us']:7.1f} "
                    f"(python {row['python_wall_p50_us']:.0f}); node {row['node_p50_us']:.1f} = kernel {row['kernel_p50_us']:.1f} "
                    f"+ copies {row['copies_p50_us']:.1f}; merge {row['merge_p50_us']:.1f}; local kernel "
                    f"{row['local_kernel_us']:.1f}, SDPA {row['local_sdpa_us']:.1f}; {row['bytes_per_step'] / 1e3:.0f} KB/step "
                    f"vs pull {row['pull_bytes_per_step'] / 1e6:.0f} MB")
                for name, what in (("device", "device tensors, staged"), ("exchange", "device tensors, exchange")):
                    if f"{name}_round_trip_p50_us" in row:
                        log(f"    {what}: round trip p50 {row[f'{name}_round_trip_p50_us']:7.1f} us p99 "
                            f"{row[f'{name}_round_trip_p99_us']:7.1f}; node {row[f'{name}_node_p50_us']:.1f} = kernel "
                            f"{row[f'{name}_kernel_p50_us']:.1f} + copies {row[f'{name}_copies_p50_us']:.1f}; merge "
                            f"{row[f'{name}_merge_p50_us']:.1f}; {row[f'{name}_shards_in_place']} of {shards} shard(s) "
                            f"in place; {row[f'{name}_bytes_per_step'] / 1e3:.1f} KB/step")
            c.close()
            cx.close()
    results["latency"] = rows_out


def getinto(args, kvring, kt, dev, results):
    from kvring.local_cluster import LocalCluster
    layout = kvring.Layout(BT, 32, HKV, D, "bf16")  # 2 MiB blocks (Llama-3-8B, all layers)
    n = 256 if args.quick else 1024
    rows = []
    runs = [(int(x), False) for x in args.getinto_nodes.split(",")]
    if args.getinto_checksum:
        runs.append((runs[0][0], True))
    for nodes, checksum in runs:
        with LocalCluster(nodes=nodes, port=7900, replication=1, host_bytes=f"{16 // nodes}G", page_bytes="2M", gpu=0,
                          hbm_bytes="256M", bin=args.bin, root=ROOT,
                          daemon_flags="--delivery_checksum=true" if checksum else "") as cl:
            rows.append(getinto_one(args, kvring, kt, dev, cl, layout, n, nodes))
            rows[-1]["delivery_checksum"] = checksum
            if checksum:
                log("    (the run above: --delivery_checksum=true, each block checked again before its copy)")
    results["getinto"] = rows


def getinto_one(args, kvring, kt, dev, cl, layout, n, nodes):
    c = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=60)
    src = torch.randint(0, 1 << 14, (n, layout.bytes // 2), dtype=torch.int16, device=dev)
    # Random keys, as chain hashes are (placement reads the key's high half: keys 1..n would all land on
    # one daemon).
    rng = np.random.default_rng(77)
    keys = rng.integers(0, np.iinfo(np.uint64).max, (n, 2), dtype=np.uint64, endpoint=True)
    kt.put(c, keys, src, layout)

    def best(f, reps=4):
        ts = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    delivered0 = sum(s["device_delivered_bytes"] for s in c.stats())
    dst = torch.empty_like(src)
    t_dev = best(lambda: kt.get_into(c, keys, layout, dst))
    dst.zero_()
    found = kt.get_into(c, keys, layout, dst)
    assert found.all() and torch.equal(dst, src), "GetInto returned other bytes"
    in_place = sum(s["device_delivered_bytes"] for s in c.stats()) - delivered0
    assert in_place == 5 * n * layout.bytes, f"the daemons delivered {in_place} bytes in place, not every block"
    # The same through pinned staging in this process (what a caller on
    # another host gets, less the network).
    cs = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=60, device_delivery=False)
    dst.zero_()
    t_staged = best(lambda: kt.get_into(cs, keys, layout, dst))
    assert torch.equal(dst, src), "GetInto through staging returned other bytes"
    cs.close()
    host = torch.empty(src.shape, dtype=torch.int16).pin_memory()
    t_host = best(lambda: kt.get_into(c, keys, layout, host))
    pinned = torch.empty(n * layout.bytes // 2, dtype=torch.int16).pin_memory()
    h2d = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        src.view(-1).copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        h2d.append(time.perf_counter() - t0)
    gb = n * layout.bytes / 1e9
    r = {"daemons": nodes, "blocks": n, "block_bytes": layout.bytes, "getinto_gbps": gb / t_dev,
         "h2d_gbps": gb / min(h2d), "getinto_staged_gbps": gb / t_staged, "getinto_pinned_host_gbps": gb / t_host}
    r["ratio"] = r["getinto_gbps"] / r["h2d_gbps"]
    log(f"  GetInto {n} x 2 MiB from {nodes} daemon(s) into device memory: {r['getinto_gbps']:.1f} GB/s delivered in "
        f"place by the daemons (staged through this process: {r['getinto_staged_gbps']:.1f}); into pinned host memory "
        f"{r['getinto_pinned_host_gbps']:.1f}; pinned H2D {r['h2d_gbps']:.1f} GB/s; device/H2D {r['ratio']:.2f}")

    # Put of new blocks (fresh keys each time) from the same bytes in device memory and in pinned host memory:
    # what the client's staging of device payloads costs against the rest of the path.
    def put_gbps(tensor, base):
        ts = []
        for rep in range(3):
            k = rng.integers(0, np.iinfo(np.uint64).max, (n, 2), dtype=np.uint64, endpoint=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            kt.put(c, k, tensor, layout)
            ts.append(time.perf_counter() - t0)
        return gb / min(ts)

    host_src = src.cpu().pin_memory()
    r["put_device_gbps"] = put_gbps(src, 1 << 32)
    r["put_pinned_host_gbps"] = put_gbps(host_src, 2 << 32)
    log(f"  Put {n} x 2 MiB new blocks to {nodes} daemon(s): from device memory {r['put_device_gbps']:.1f} GB/s, "
        f"from pinned host memory {r['put_pinned_host_gbps']:.1f} GB/s")
    c.close()
    return r


def faults(args, kvring, kt, dev, results):
    from kvring.local_cluster import LocalCluster
    layout = kvring.Layout(BT, 2, HKV, D, "bf16")
    hq = SHAPES["llama3-8b"]
    r = {}
    with LocalCluster(nodes=4, port=8000, replication=2, host_bytes="2G" if args.gpu >= 0 else "512M",
                      page_bytes=str(layout.bytes), gpu=args.gpu, hbm_bytes="2G", chunk_blocks=64, write_quorum=1,
                      bin=args.bin, root=ROOT) as cl:
        c = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=5)
        seqs = [Seq(f"f{i}", 2, (3000 if dev.type == "cuda" else 300) + 100 * i, dev) for i in range(4)]
        for s in seqs:
            put_sequence(c, kt, layout, s)
        stop = threading.Event()
        stats = {"ok": 0, "retried": 0, "wrong": 0}

        def engine():
            while not stop.is_set():
                for l in range(2):
                    for attempt in range(40):
                        try:
                            errs, _ = decode_step(c, kt, layout, seqs, l, hq, dev)
                            break
                        except kvring.Error:
                            stats["retried"] += 1
                            time.sleep(0.05)
                    else:
                        raise RuntimeError("a step failed 40 times")
                    stats["ok"] += 1
                    stats["wrong"] += sum(1 for e in errs if e[0] > 1e-2)

        th = threading.Thread(target=engine)
        th.start()
        time.sleep(2)
        ok_before = stats["ok"]
        cl.kill9(1)
        time.sleep(4)
        stop.set()
        th.join()
        r["steps_ok"], r["steps_before_kill"], r["retried"], r["wrong"] = stats["ok"], ok_before, stats["retried"], stats["wrong"]
        # every acknowledged token, attended over by the survivors
        final = []
        for l in range(2):
            for s in seqs:
                ctx = s.k[l].shape[0]
                q = torch.randn(1, hq, D, dtype=torch.bfloat16, device=dev)
                out, lse = kt.step(c, layout, [(s.id, ctx, 1, 0)], q, torch.tensor([ctx - 1]), layer=l)
                ro, rl = reference(q, s.k[l], s.v[l], torch.tensor([ctx - 1], device=dev))
                final.append(rel_l2(out, ro))
        r["final_max_rel_l2"] = max(final)
        # oversize / malformed: clear errors
        try:
            kt.step(c, layout, [(seqs[0].id, seqs[0].k[0].shape[0], 1, 0)], torch.randn(1, 12, D, dtype=torch.bfloat16,
                                                                                          device=dev), torch.tensor([5]))
            r["bad_heads"] = "accepted"
        except kvring.InvalidArgumentError as e:
            r["bad_heads"] = f"InvalidArgumentError: {e}"
        c.close()
    if args.gpu < 0:
        r["hbm_exhaustion"] = "ResourceExhausted: (no GPU in this run)"
        results["faults"] = r
        log(f"  kill -9 under load (R=2, W=1): {r['steps_ok']} steps ok ({r['steps_before_kill']} before the kill), "
            f"{r['retried']} retried, {r['wrong']} wrong; after: max rel L2 {r['final_max_rel_l2']:.2e}; {r['bad_heads']}")
        return r["wrong"] == 0 and r["final_max_rel_l2"] < 1e-2 and r["steps_ok"] > r["steps_before_kill"]
    # HBM exhaustion: 64 MiB of HBM a daemon, a sequence twice that.
    with LocalCluster(nodes=1, port=8100, replication=1, host_bytes="2G", page_bytes=str(layout.bytes), gpu=0,
                      hbm_bytes="64M", bin=args.bin, root=ROOT) as cl:
        c = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=30)
        big = Seq("big", 2, 2 * 64 * 1024 * 1024 // layout.bytes * BT, dev)
        put_sequence(c, kt, layout, big)
        try:
            kt.step(c, layout, [(big.id, big.tokens, 1, 0)], torch.randn(1, hq, D, dtype=torch.bfloat16, device=dev),
                    torch.tensor([big.tokens - 1]))
            r["hbm_exhaustion"] = "accepted"
        except kvring.Error as e:
            r["hbm_exhaustion"] = f"{type(e).__name__}: {e}"
        c.close()
    results["faults"] = r
    log(f"  kill -9 under load (R=2, W=1): {r['steps_ok']} steps ok ({r['steps_before_kill']} before the kill), "
        f"{r['retried']} retried, {r['wrong']} wrong; every acknowledged token after: max rel L2 {r['final_max_rel_l2']:.2e}")
    log(f"  bad head count: {r['bad_heads']}")
    log(f"  HBM exhaustion: {r['hbm_exhaustion']}")
    return r["wrong"] == 0 and r["final_max_rel_l2"] < 1e-2 and r["steps_ok"] > r["steps_before_kill"] and \
        r["bad_heads"].startswith("InvalidArgument") and r["hbm_exhaustion"].startswith("ResourceExhausted")


def main():
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin", default=str(ROOT / ".gpu"), help="directory with control/kvringd, control/kvring-coordinator, clients/kvring")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    p.add_argument("--quick", action="store_true", help="fewer lengths and steps")
    p.add_argument("--only", default="correctness,latency,getinto,faults")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run on CPU daemons")
    p.add_argument("--gpus", default="0", help="devices of the daemons (daemon i on the i-th mod n): 0,1,2,3 on a "
                   "4-GPU host; the default shares GPU 0")
    p.add_argument("--inline-compare", action="store_true",
                   help="latency: decode steps on the daemons' UCX thread (--ucx_inline_attend_rows) against the pool")
    p.add_argument("--getinto-nodes", default="1,4", help="daemon counts of the GetInto part (sharing the GPU)")
    p.add_argument("--getinto-checksum", action="store_true",
                   help="also run the first daemon count with --delivery_checksum=true")
    p.add_argument("--shards", default="1,4", help="shard counts of the latency part (e.g. 1,2,4,8 on 8 GPUs)")
    ARGS = args = p.parse_args()
    from kvring.local_cluster import start_mps
    if args.device == "cuda":  # before this process's first CUDA call: the default deployment (docs/MPS.md)
        print("[mps] " + start_mps(), flush=True)
    import kvring
    import kvring.torch as kt
    dev = torch.device(args.device)
    args.gpu = 0 if args.device == "cuda" else -1
    args.gpu_list = [int(x) for x in args.gpus.split(",")] if args.device == "cuda" else None
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(0) if args.gpu >= 0 else "cpu", "date": time.strftime("%Y-%m-%d")}
    ok = True
    for part in args.only.split(","):
        log(f"== {part}")
        t0 = time.time()
        try:
            r = {"correctness": correctness, "latency": latency, "getinto": getinto, "faults": faults}[part](args, kvring, kt, dev,
                                                                                                            results)
        except Exception as e:  # noqa: BLE001 (a failed part is reported; the others still run)
            import traceback
            traceback.print_exc()
            results.setdefault("errors", {})[part] = repr(e)
            r = False
        ok &= r is not False
        log(f"   ({time.time() - t0:.0f} s)")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "e2e.json").write_text(json.dumps(results, indent=1, default=str))
    log("e2e: " + ("all checks passed" if ok else "SOME CHECKS FAILED"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
