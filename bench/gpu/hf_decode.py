#!/usr/bin/env python3
"""Pass-Q decode inside transformers' generate, on the default deployment, beside local sdpa in the same run.

  python3 bench/gpu/hf_decode.py --bin .gpu [--deployment default|before] [--configs 1x1x32K,4x1x32K,...]
                                 [--budget SECONDS] [--detach | --ab-detach]

Llama-3-8B shapes (32 layers, 32 q / 8 kv heads, d128; random weights). For each configuration
SHARDSxBATCHxCONTEXT: the decode tokens/s of model.generate with kvring.hf.PassQSession (the KV on GPU
daemons, the engine holding none) against generate with a DynamicCache and sdpa (the KV in the engine);
both timed between the first and the last token (no prefill). Inside the same pass-Q generate, the
per-layer step at the engine (PassQSession(timing=True).device_step_seconds(): the step's span on the
engine's CUDA stream, inputs ready -> output ready, p50) beside the node's kernel for that step, with the
engine thread's time in the step broken down as Python / device staging / client + transport / daemon /
kernel; and sdpa's own attention per layer inside a local generate, timed the same way (CUDA events).

--deployment default: what deploy/local-cluster.sh --gpu starts (CUDA MPS, the daemons' default UCX
progress: adaptive spin) and the client's defaults (adaptive spin; the prepared step). before: the
settings before issue 32, for the ratio: no MPS, --ucx_spin_us=20 --ucx_spin_max_us=0 on the daemons,
ucx_spin_max_us=0 in the client, and the unprepared per-call path (prepared=False). MPS is joined when a
process first touches CUDA, so this script starts (or stops) it before its own first CUDA call. The
daemons' and the engine's CPU use (cores busy) during decode and idle afterwards is recorded for the
progress mode's cost.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))


def log(*a):
    print(*a, flush=True)


def parse_config(s):
    shards, batch, ctx = s.lower().split("x")
    n = int(ctx[:-1]) * 1024 if ctx.endswith("k") else int(ctx)
    return int(shards), int(batch), n


def cpu_seconds(pid):
    """utime + stime of a process (all its threads), in seconds."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """Cores busy (CPU seconds per wall second) of a set of processes over an interval."""

    def __init__(self, pids):
        self.pids = pids

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), sum(cpu_seconds(p) for p in self.pids)
        return self

    def __exit__(self, *exc):
        self.cores = (sum(cpu_seconds(p) for p in self.pids) - self.c0) / max(1e-9, time.perf_counter() - self.t0)


from transformers import LogitsProcessor  # noqa: E402  (no CUDA call)


class Stamps(LogitsProcessor):
    """A logits processor that stamps the time of each token (after a sync): decode tokens/s without prefill."""

    def __init__(self):
        self.t = []

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize()
        self.t.append(time.perf_counter())
        return scores

    def rate(self):
        return (len(self.t) - 1) / max(1e-9, self.t[-1] - self.t[0])


def generate_timed(model, ids, n_new, cache):
    from transformers import LogitsProcessorList
    st = Stamps()
    model.generate(ids, max_new_tokens=n_new, do_sample=False, past_key_values=cache, pad_token_id=0,
                   logits_processor=LogitsProcessorList([st]))
    return st.rate()


def sdpa_layer_times(model, ids, n_new):
    """sdpa's attention per layer inside a local generate's decode steps, on the stream (CUDA events around the
    attention call: inputs ready -> output ready, as PassQSession(timing=True) times a pass-Q step), seconds."""
    from transformers import AttentionInterface, DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    events = []

    def timed(module, query, *a, **k):
        if query.shape[2] != 1:
            return sdpa_attention_forward(module, query, *a, **k)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = sdpa_attention_forward(module, query, *a, **k)
        e1.record()
        events.append((e0, e1))
        return out

    AttentionInterface.register("sdpa_timed", timed)
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionMaskInterface.register("sdpa_timed", sdpa_mask)
    import kvring.hf as khf
    khf._set_attention(model, "sdpa_timed")
    try:
        model.generate(ids, max_new_tokens=n_new, do_sample=False, past_key_values=DynamicCache(), pad_token_id=0)
    finally:
        khf._set_attention(model, "sdpa")
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e-3 for a, b in events]


def p50(xs):
    return statistics.median(xs) if xs else float("nan")


def run_config(c, cl, model, shards, batch, ctx, n_new, before, label):
    import kvring.hf as khf
    from transformers import DynamicCache
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, model.config.vocab_size, (batch, ctx), generator=g).cuda()
    daemons = [int(p.read_text()) for p in (cl.dir / "pids").glob("node*")]
    me = [os.getpid()]
    r = {"shards": shards, "batch": batch, "context": ctx, "new_tokens": n_new}

    torch.cuda.synchronize()
    # The local peer, twice, its better run kept: a DynamicCache grows by
    # concatenation, and one run's rate varies with what the allocator has
    # cached (on the H100 the first run at 32K gave 12.6-45 tok/s between
    # configs of one run, the second is steadier).
    rates = []
    for _ in range(2):
        with CpuMeter(me) as eng_local:
            rates.append(generate_timed(model, ids, n_new, DynamicCache()))
        torch.cuda.empty_cache()
    r["sdpa_runs_tokens_per_s"] = rates
    r["sdpa_tokens_per_s"] = max(rates)
    try:
        r["sdpa_layer_p50_us"] = p50(sdpa_layer_times(model, ids, 4)) * 1e6
    except Exception as e:  # noqa: BLE001  (the per-layer peer only; the rates stand without it)
        log(f"  sdpa per-layer timing failed: {e!r}")
        r["sdpa_layer_p50_us"] = float("nan")
    torch.cuda.empty_cache()

    sess = khf.PassQSession(c, model, [f"{label}-{shards}x{batch}x{ctx}-{b}" for b in range(batch)],
                            prepared=not before, timing=not before)
    try:
        with sess:
            with CpuMeter(daemons) as dm, CpuMeter(me) as eng:
                r["passq_tokens_per_s"] = generate_timed(model, ids, n_new, sess.cache())
            time.sleep(0.5)
            with CpuMeter(daemons) as idle:
                time.sleep(2.0)
            steps = list(sess.decode_steps)
            on_stream = sess.device_step_seconds()
    finally:
        khf._set_attention(model, "sdpa")
    if steps:
        # The step at the engine: its span on the stream where it is timed
        # (stream-ordered steps, inputs ready -> output ready); the engine
        # thread's time in the call otherwise (it waited for the device).
        r["engine_thread_p50_us"] = p50([s[0] for s in steps]) * 1e6
        r["step_p50_us"] = p50(on_stream) * 1e6 if on_stream else r["engine_thread_p50_us"]
        r["step_timed_on"] = "stream" if on_stream else "engine thread"
        r["client_p50_us"] = p50([s[1] for s in steps]) * 1e6
        r["node_p50_us"] = p50([s[2] for s in steps]) * 1e6
        r["kernel_p50_us"] = p50([s[3] for s in steps]) * 1e6
        r["call_p50_us"] = p50([s[4] for s in steps if s[4] == s[4]]) * 1e6
        # The client's split (AttendReport): plan, stage, round trip, transport (of the round trip), merge.
        for i, name in enumerate(("plan", "stage", "round_trip", "transport", "merge")):
            r[f"{name}_p50_us"] = p50([s[5 + i] for s in steps]) * 1e6
        r["over_kernel_us"] = r["step_p50_us"] - r["kernel_p50_us"]
        # Shards that answered with their work still queued (the node's time
        # then holds no kernel, and kernel_p50 is of earlier steps).
        r["replied_queued"] = sum(s[10] for s in steps if len(s) > 10) / len(steps)
        # engine glue = Python (kvring.hf + StepPlan around the C call) + the
        # client's device staging (its copies and waits around the routed step).
        # The engine thread's time in the step: Python (kvring.hf + StepPlan
        # around the C call), the client's device work around the routed
        # step (its gather, event, merge: queued, not waited for, when the
        # step is on the stream), the client + transport, the daemon, the
        # kernel (the node's, on its own stream).
        t = r["engine_thread_p50_us"]
        # (with replies once queued the node's time holds no kernel: its kernel runs on the device after the reply)
        queued = r["replied_queued"] > 0.5
        r["breakdown_us"] = {"engine glue": t - r["client_p50_us"],
                             "of which python": t - r["call_p50_us"],
                             "of which device staging": r["call_p50_us"] - r["client_p50_us"],
                             "client + transport": r["client_p50_us"] - r["node_p50_us"],
                             "of which plan": r["plan_p50_us"], "of which stage": r["stage_p50_us"],
                             "of which transport": r["transport_p50_us"], "of which merge": r["merge_p50_us"],
                             "daemon": r["node_p50_us"] - (0 if queued else r["kernel_p50_us"]),
                             "kernel" + (" (after the reply)" if queued else ""): r["kernel_p50_us"]}
    r["ratio"] = r["passq_tokens_per_s"] / r["sdpa_tokens_per_s"]
    # A token's time either way, and how much more a layer pass-Q's costs than
    # the step's own excess over sdpa's attention explains: the rest is the
    # overlap the engine lost (its thread waits for each layer's reply, so
    # its CPU cannot run ahead of its GPU).
    layers = model.config.num_hidden_layers
    r["token_ms"] = {"passq": 1e3 / r["passq_tokens_per_s"], "sdpa": 1e3 / r["sdpa_tokens_per_s"]}
    per_layer_us = (r["token_ms"]["passq"] - r["token_ms"]["sdpa"]) * 1e3 / layers
    r["token_excess_per_layer_us"] = per_layer_us
    if "step_p50_us" in r and r["sdpa_layer_p50_us"] == r["sdpa_layer_p50_us"]:
        r["lost_overlap_per_layer_us"] = per_layer_us - (r["step_p50_us"] - r["sdpa_layer_p50_us"])
    r["cores_busy"] = {"daemons_decode": dm.cores, "daemons_idle": idle.cores, "engine_decode_passq": eng.cores,
                       "engine_decode_sdpa": eng_local.cores}
    torch.cuda.empty_cache()
    log(f"  {shards} shard(s), batch {batch}, {ctx // 1024}K: pass-Q {r['passq_tokens_per_s']:.1f} tok/s vs sdpa "
        f"{r['sdpa_tokens_per_s']:.1f} = {r['ratio']:.2f}x; step p50 {r.get('step_p50_us', float('nan')):.0f} us "
        f"on the {r.get('step_timed_on', '?')} (engine thread {r.get('engine_thread_p50_us', float('nan')):.0f}) "
        f"(kernel {r.get('kernel_p50_us', float('nan')):.0f}, +{r.get('over_kernel_us', float('nan')):.0f}; "
        f"sdpa's attention {r['sdpa_layer_p50_us']:.0f} us; replied queued {r.get('replied_queued', 0):.2f}); "
        f"breakdown "
        + ", ".join(f"{k} {v:.0f}" for k, v in r.get("breakdown_us", {}).items())
        + f"; cores busy: daemons {dm.cores:.2f} decoding, {idle.cores:.2f} idle; engine {eng.cores:.2f} "
          f"(sdpa {eng_local.cores:.2f}); a token {r['token_ms']['passq']:.1f} ms against sdpa's "
          f"{r['token_ms']['sdpa']:.1f}: +{r['token_excess_per_layer_us']:.0f} us a layer, of which the step's "
          f"excess over sdpa's attention explains all but {r.get('lost_overlap_per_layer_us', float('nan')):.0f}")
    return r


def profile_decode(c, model, shards, out):
    """Where the engine thread's time in a decode step goes: cProfile (Python functions) and torch.profiler (aten
    ops and launches, CPU side) over a short generate on pass-Q; tables to the log and $OUT."""
    import cProfile
    import io
    import pstats
    import kvring.hf as khf
    from torch.profiler import ProfilerActivity, profile
    ids = torch.randint(1, 1000, (1, 1024)).cuda()
    text = ""
    for tool in ("cProfile", "torch.profiler"):
        with khf.PassQSession(c, model, [f"profile-{shards}-{tool}"]) as sess:
            # (the prompt's prefill and the first token outside the profile: 8 decode tokens inside)
            gen = dict(max_new_tokens=9, do_sample=False, past_key_values=sess.cache(), pad_token_id=0)
            if tool == "cProfile":
                pr = cProfile.Profile()
                pr.enable()
                model.generate(ids, **gen)
                pr.disable()
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
                text += buf.getvalue()
            else:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    model.generate(ids, **gen)
                text += "\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    khf._set_attention(model, "sdpa")
    (Path(out) / f"hf_decode_profile_{shards}.txt").write_text(text)
    log(f"== profile, {shards} shard(s) (a 1024-token prompt, 8 decode tokens, 32 layers)\n" + text)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin", default=str(ROOT / ".gpu"))
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    p.add_argument("--deployment", choices=["default", "before"], default="default")
    p.add_argument("--configs", default="1x1x32K,4x1x32K,1x8x32K,4x8x32K,1x1x128K,4x1x128K",
                   help="SHARDSxBATCHxCONTEXT, comma-separated, run in this order")
    p.add_argument("--new", type=int, default=33, help="tokens generated per run (decode rate over the last n-1)")
    p.add_argument("--budget", type=float, default=480, help="start no configuration after this many seconds")
    p.add_argument("--exchange-min-bytes", type=int, default=-1,
                   help="the client's device_exchange_min_bytes (-1: its default; 0: every step through the "
                        "device exchange, for comparison)")
    p.add_argument("--reply-when-done", action="store_true",
                   help="the client's node_reply_when_queued=False: GPU nodes answer once their work is done, not "
                        "once it is queued (for comparison with the default)")
    p.add_argument("--detach", action="store_true",
                   help="the client's detach_device_steps=True: decode steps return without waiting for the nodes' "
                        "replies (collected on the client's thread; a failure comes back on a later call)")
    p.add_argument("--ab-detach", action="store_true",
                   help="each configuration twice in this process, one after the other: waited steps, then detached "
                        "(detach_device_steps=True), each beside its own sdpa runs: an A/B that no drift between "
                        "processes separates")
    p.add_argument("--tag", default="",
                   help="a name for this run's binaries (e.g. base: an earlier build beside the current one, same "
                        "call); it names the output file and moves the cluster to its own ports")
    p.add_argument("--profile", action="store_true",
                   help="also profile the engine thread's decode step (cProfile, torch.profiler) per shard count")
    args = p.parse_args()
    t_start = time.time()
    from kvring.local_cluster import LocalCluster, start_mps, stop_mps
    before = args.deployment == "before"
    # Before this process's first CUDA call: it joins MPS (or not) there.
    log("[mps] " + (stop_mps(ROOT) if before else start_mps(ROOT)))
    import kvring
    from hf_e2e import build_model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0),
               "deployment": args.deployment, "tag": args.tag, "configs": []}
    import transformers
    results["transformers"], results["torch"] = transformers.__version__, torch.__version__
    log(f"== pass-Q decode in generate, {args.deployment} deployment, Llama-3-8B shapes (random weights)")
    model = build_model(32, 32, 8, 4096, 14336, seed=1)
    # Warm-up (kernels' first-call setup and autotuning are no part of a decode rate).
    from transformers import DynamicCache
    warm = torch.randint(1, 1000, (1, 512)).cuda()
    model.generate(warm, max_new_tokens=4, do_sample=False, past_key_values=DynamicCache(), pad_token_id=0)
    page = str(2 << 20)
    configs = [parse_config(s) for s in args.configs.split(",")]
    dflags = "--ucx_spin_us=20 --ucx_spin_max_us=0" if before else ""
    copts = {"ucx_spin_max_us": 0} if before else {}
    copts["device_exchange_min_bytes"] = args.exchange_min_bytes
    if args.reply_when_done:
        copts["node_reply_when_queued"] = False
    if args.detach:
        copts["detach_device_steps"] = True
    results["detach_device_steps"] = args.detach
    results["device_exchange_min_bytes"] = args.exchange_min_bytes
    path = out / (f"hf_decode_{args.deployment}{'' if args.exchange_min_bytes < 0 else '_x%d' % args.exchange_min_bytes}"
                  f"{'_' + args.tag if args.tag else ''}.json")
    for shards in sorted({s for s, _, _ in configs}):
        mine = [(b, n) for s, b, n in configs if s == shards]
        need = max(b * n for b, n in mine) * 32 * 8 * 128 * 2 * 2  # the largest configuration's KV, all layers
        hbm = f"{int(need * 1.15 / shards / 2**30) + 2}G"
        if time.time() - t_start > args.budget:
            log(f"  (budget spent: {shards}-shard configurations skipped)")
            break
        # (Each deployment on its own ports: run one after the other, the second never meets the first's sockets.)
        with LocalCluster(nodes=shards, port=(8900 if before else 9200 if args.tag else 8600) + 10 * shards, replication=1, host_bytes="4G", page_bytes=page,
                          gpu=0, hbm_bytes=hbm, chunk_blocks=256, bin=args.bin, root=ROOT, daemon_flags=dflags,
                          mps=not before) as cl:
            c = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=120, **copts)
            modes = [(c, bool(copts.get("detach_device_steps")))]
            if args.ab_detach:
                modes = [(c, False), (kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=120,
                                                    **dict(copts, detach_device_steps=True)), True)]
            import kvring.hf as khf
            with khf.PassQSession(c, model, [f"warm-{shards}"], prepared=not before) as sess:
                model.generate(warm, max_new_tokens=4, do_sample=False, past_key_values=sess.cache(), pad_token_id=0)
            khf._set_attention(model, "sdpa")
            for b, n in mine:
                if time.time() - t_start > args.budget:
                    log(f"  (budget spent: {shards}x{b}x{n // 1024}K skipped)")
                    continue
                for cm, detached in modes:
                    try:
                        if len(modes) > 1:
                            log(f"  ({'detached' if detached else 'waited'} steps)")
                        r = run_config(cm, cl, model, shards, b, n, args.new, before,
                                       args.deployment + ("-detached" if detached else ""))
                        r["detached"] = detached
                        results["configs"].append(r)
                    except Exception as e:  # noqa: BLE001
                        import traceback
                        traceback.print_exc()
                        results.setdefault("errors", []).append(f"{shards}x{b}x{n}: {e!r}")
                # (a failed configuration's tensors go before the next one's cluster wants the memory)
                gc.collect()
                torch.cuda.empty_cache()
                path.write_text(json.dumps(results, indent=1))
            if args.profile:
                try:
                    profile_decode(c, model, shards, out)
                except Exception as e:  # noqa: BLE001  (a diagnostic: the figures stand without it)
                    log(f"  profile failed: {e!r}")
            for cm, _ in modes[1:]:
                cm.close()
            c.close()
    path.write_text(json.dumps(results, indent=1))
    log(f"hf_decode: {len(results['configs'])} configuration(s) measured in {time.time() - t_start:.0f} s -> {path}")
    sys.exit(1 if results.get("errors") else 0)


if __name__ == "__main__":
    main()
