#!/usr/bin/env python3
"""Where a decode launch's time goes, CTA by CTA (device machine).

Needs a diagnostic build of the C API whose decode kernel stamps
%globaltimer at its phases (-DKVRING_DECODE_TRACE; see
paged_decode_cuda.cu):

  cmake -S . -B build-trace -G Ninja -DKVRING_GPU_ONLY=ON \\
        -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_FLAGS=-DKVRING_DECODE_TRACE
  ninja -C build-trace kvring_cuda_capi
  python3 bench/gpu/decode_trace.py --lib build-trace/.../libkvring_cuda_capi.so \\
        --shapes 1:32768,8:32768 [--splits N] [--out DIR]

For each shape: the launch's span against the graph-timed call, and per
CTA: start, prologue (until the producer's first copy), first-data latency,
streaming time and rate, finish, store and split-merge; the aggregate read
rate over time (each CTA's bytes spread evenly over its streaming window);
the per-SM streaming rates. Raw stamps go to DIR/decode_trace_B_L_flagsF.json.
Same inputs as attention_bench.py (bf16, 32 q heads, 8 kv heads, d 128,
16-token pages at shuffled ids, one query a sequence).
"""
import argparse, ctypes, json, os, statistics

from kvbench import D, HKV, HQ, Paged, load_lib

p = argparse.ArgumentParser()
p.add_argument("--lib", default="")
p.add_argument("--shapes", default="1:32768,1:131072,8:32768")
p.add_argument("--splits", type=int, default=0, help="split count (default: the library's choice)")
p.add_argument("--flags", type=int, default=1, help="kvring_cuda_decode flags (1: stable tables, read before the "
               "grid-dependency wait; 0: after it)")
p.add_argument("--out", default=".")
p.add_argument("--from-json", default="", help="report on a saved trace (decode_trace_B_L_flagsF.json) instead of running")
args = p.parse_args()

BT = 16


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def summary(name, xs):
    print(f"  {name:34s} min {min(xs):7.2f}  p10 {pct(xs, .1):7.2f}  median {statistics.median(xs):7.2f}  "
          f"p90 {pct(xs, .9):7.2f}  max {max(xs):7.2f}")


def report(B, L, splits, call_us, tr):
    """Prints the phases of one traced launch (times from the grid-dependency release)."""
    split_of = {id(t): i % splits for i, t in enumerate(tr)}  # grid (splits, kv heads, sequences): x fastest
    tr = [t for t in tr if t[3] and t[5]]  # CTAs that streamed (a split past the end has no tokens)
    t0 = min(t[1] for t in tr)
    us = lambda x: (x - t0) / 1e3  # noqa: E731
    kv_bytes = B * L * HKV * D * 2 * 2
    span = max(us(t[9]) for t in tr)
    print(f"\n== B={B} L={L}: {splits} splits, {len(tr)} CTAs with work on {SMS} SMs; {span:.1f} us from the "
          f"grid-dependency release to the last CTA's end; graph-timed call {call_us:.1f} us; "
          f"{kv_bytes / 4.26e12 * 1e6:.1f} us at 4.26 TB/s")
    summary("entry (us; < 0: before the release)", [us(t[0]) for t in tr])
    summary("first copy issued (us)", [us(t[2]) for t in tr])
    summary("first stage landed (us)", [us(t[3]) for t in tr])
    summary("last copy issued (us)", [us(t[4]) for t in tr])
    summary("all consumed (us)", [us(t[5]) for t in tr])
    merged = [t for t in tr if t[15] >> 32]
    if splits > 1:
        summary("consumed to warps' partials in smem (us)", [(t[13] - t[5]) / 1e3 for t in tr])
        summary("warps' partials to split partial stored (us)", [(t[6] - t[13]) / 1e3 for t in tr])
        summary("stored to arrival counted (us)", [(t[7] - t[6]) / 1e3 for t in tr])
    if merged:
        summary("merger: arrival to loads issued (us)", [(t[10] - t[7]) / 1e3 for t in merged])
        if all(t[12] and t[14] for t in merged):  # (stamps since 2026-12-03, session 18)
            summary("merger: loads issued to proxy fence passed (us)", [(t[12] - t[10]) / 1e3 for t in merged])
            summary("merger: loads issued to bulk copies issued (us)", [(t[14] - t[10]) / 1e3 for t in merged])
        summary("merger: loads issued to LSEs in (us)", [(t[11] - t[10]) / 1e3 for t in merged])
        summary("merger: LSEs to partials in (us)", [(t[8] - t[11]) / 1e3 for t in merged])
        summary("merger: loads in to done (us)", [(t[9] - t[8]) / 1e3 for t in merged])
        print(f"  last consumed at {max(us(t[5]) for t in tr):.2f} us; last merge done at {span:.2f} us")
    # Aggregate read rate over time, 1-us bins: each CTA's bytes spread over
    # its streaming window (first stage landed .. all consumed).
    tokens_per_split = -(-((L + BT - 1) // BT) // splits) * BT
    ppseq_tok = ((L + BT - 1) // BT) * BT
    bins = [0.0] * (int(span) + 2)
    rates = {}
    for t in tr:
        sp = split_of[id(t)]
        nb = (min(ppseq_tok, min(L, (sp + 1) * tokens_per_split)) - min(L, sp * tokens_per_split)) * D * 4
        b0, b1 = us(t[3]), us(t[5])
        if b1 <= b0:
            continue
        rates.setdefault(t[15] & 0xffffffff, []).append(nb / ((t[5] - t[3])))
        for k in range(max(0, int(b0)), int(b1) + 1):
            ov = min(b1, k + 1) - max(b0, k)
            if ov > 0:
                bins[k] += nb * ov / (b1 - b0)
    print("  read rate by microsecond (TB/s): " + " ".join(f"{x / 1e6:.1f}" for x in bins))
    ids = sorted(rates)
    print("  per-SM streaming rate (GB/s, mean of its CTAs), SM id order:")
    for k in range(0, len(ids), 16):
        print("   " + " ".join(f"{j:3d}:{sum(rates[j]) / len(rates[j]):4.1f}" for j in ids[k:k + 16]))


if args.from_json:
    with open(args.from_json) as f:
        d = json.load(f)
    SMS = d.get("sms", 132)
    report(d["B"], d["L"], d["splits"], d["call_us"], d["trace"])
    raise SystemExit(0)

import torch  # noqa: E402

lib = load_lib(args.lib)
dev = torch.device("cuda")
SMS = torch.cuda.get_device_properties(0).multi_processor_count
torch.manual_seed(0)
os.makedirs(args.out, exist_ok=True)

for shape in args.shapes.split(","):
    B, L = (int(x) for x in shape.split(":"))
    kv = Paged(B, L, BT)
    ppseq = kv.pages_per_seq
    q = torch.randn(B, HQ, D, dtype=torch.bfloat16, device=dev)
    pos = torch.full((B,), L - 1, dtype=torch.int32, device=dev)
    rows = torch.arange(B + 1, dtype=torch.int32, device=dev)
    out = torch.empty(B, HQ, D, dtype=torch.float32, device=dev)
    lse = torch.empty(B, HQ, dtype=torch.float32, device=dev)
    splits = args.splits or lib.kvring_cuda_decode_splits(B, HKV, HQ, 1, ppseq, BT, SMS)
    wsb = lib.kvring_cuda_decode_workspace(B, HQ, splits, D)
    ws = torch.zeros(max(1, wsb), dtype=torch.uint8, device=dev)

    def call():
        e = lib.kvring_cuda_decode(*kv.kv_args(), q.data_ptr(), pos.data_ptr(), rows.data_ptr(), B, HQ, 1, 0.0, 1, 0,
                                   splits, ws.data_ptr(), wsb, out.data_ptr(), lse.data_ptr(),
                                   torch.cuda.current_stream().cuda_stream, args.flags)
        assert e == 0, f"decode error {e}"

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    # Graph-timed per call, as attention_bench.py times it (back-to-back calls).
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        for _ in range(20):
            call()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        g.replay()
    b.record()
    b.synchronize()
    call_us = a.elapsed_time(b) / 200 * 1e3
    g.replay()  # the traced launch: the last of a back-to-back run
    torch.cuda.synchronize()
    nctas = splits * HKV * B
    buf = (ctypes.c_uint64 * (nctas * 16))()
    assert lib.kvring_cuda_decode_trace(buf, nctas) == 0
    tr = [list(buf[i * 16:(i + 1) * 16]) for i in range(nctas)]
    with open(os.path.join(args.out, f"decode_trace_{B}_{L}_flags{args.flags}.json"), "w") as f:
        json.dump({"B": B, "L": L, "sms": SMS, "splits": splits, "call_us": call_us, "trace": tr,
                   "slots": ["entry", "griddep released", "first copy", "first data", "producer done", "consumed",
                             "stored", "arrived", "merge partials in", "done", "merge loads issued", "merge LSEs in",
                             "merge proxy fence passed", "warps' partials in smem", "merge bulk copies issued",
                             "smid | merged << 32"]}, f)
    report(B, L, splits, call_us, tr)
