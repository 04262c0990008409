#!/usr/bin/env python3
"""Workloads of a real engine on kvring GPU nodes: transformers' Llama
(Llama-3-8B shapes, seeded random weights, bf16) on the H200, with kvring
daemons (kvringd --gpu) sharing the GPU.

  python3 bench/gpu/hf_workloads.py --bin .gpu --out $OUT [--only chat,agent,batch] [--agent-tokens N]
                                    [--agent-quantize int8|fp8|...] [--agent-prefill N] [--agent-check N]

  chat   multi-tenant chat: tenants with a system prompt shared by their
         sessions, multi-turn sessions (Zipf popularity) whose context grows
         every turn; kvring is the prefix cache (kvring.hf.PrefixCache).
         Reports the prefix hit rate, prefill tokens saved, turn latency
         against recompute, and checks the first turns' tokens against it.
  agent  one context that grows to --agent-tokens (default 128K; 1M: 1048576, stored int8 with
         --agent-quantize int8) through
         pass-Q attention (kvring.hf.PassQSession, 4 shards): the engine
         holds no KV. At each milestone: decode tokens/s, the engine's peak
         GPU memory, bytes moved; at the end the same against local sdpa
         with the KV of its first min(N, 128K) tokens in the engine (bf16).
         --agent-prefill N: past N tokens the context is stored by
         PutSequence from K/V the engine computes chunk by chunk (each
         chunk alone), for a 1M context whose prefill outlasts the device
         time. With --agent-quantize, first the teacher-forced logits of
         pass-Q over a context stored in that encoding against sdpa.
  batch  a cache-backend batch job: requests over a few long shared
         documents, each with its own question; wall time and tokens/s with
         kvring against recompute, hit rate, bytes loaded.

Results: $OUT/hf_workloads.json and the log.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_e2e import Sections, build_model, log  # noqa: E402


def rand_tokens(g, n, vocab):
    return torch.randint(1, vocab, (1, n), generator=g)


def chat(c_for_tenant, model, results, tenants=2, sessions=3, turns=12, system_tokens=2048, verify=2):
    import kvring.hf as khf
    g = torch.Generator().manual_seed(42)
    rng = np.random.default_rng(42)
    V = model.config.vocab_size
    caches = [khf.PrefixCache(c_for_tenant(t), model, "chat-llama3-8b") for t in range(tenants)]
    systems = [rand_tokens(g, system_tokens, V) for _ in range(tenants)]
    sess = [{"tenant": t, "history": torch.zeros((1, 0), dtype=torch.long)} for t in range(tenants) for _ in range(sessions)]
    zipf = 1.0 / np.arange(1, len(sess) + 1) ** 0.9
    zipf /= zipf.sum()
    rows, held_tokens, context_tokens, same, checked = [], 0, 0, 0, 0
    for turn in range(turns):
        s = sess[int(rng.choice(len(sess), p=zipf))]
        user = rand_tokens(g, int(rng.integers(64, 256)), V)
        ctx = torch.cat([systems[s["tenant"]], s["history"], user], 1).cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out, info = caches[s["tenant"]].generate(ctx, max_new_tokens=16, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        reply = out[0, ctx.shape[1]:] if not hasattr(out, "sequences") else out.sequences[0, ctx.shape[1]:]
        rec_dt = None
        if turn < verify or turn % 4 == 3:  # recompute beside it: the same tokens, and its latency
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ref = model.generate(ctx, max_new_tokens=16, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            rec_dt = time.perf_counter() - t0
            checked += 1
            same += int(torch.equal(ref[0, ctx.shape[1]:], reply))
        held = info["held_blocks"] * 16
        held_tokens += held
        context_tokens += ctx.shape[1]
        rows.append({"turn": turn, "tenant": s["tenant"], "context": ctx.shape[1], "held_tokens": held,
                     "turn_s": dt, "recompute_turn_s": rec_dt, "load_s": info["load_s"],
                     "generate_s": info["generate_s"], "save_s": info["save_s"], "saved_blocks": info["saved_blocks"]})
        log(f"  chat turn {turn:2d}: tenant {s['tenant']}, context {ctx.shape[1]:5d} tokens, {held:5d} from kvring, "
            f"{dt * 1e3:6.0f} ms (load {info['load_s'] * 1e3:.0f}, generate {info['generate_s'] * 1e3:.0f}, save "
            f"{info['saved_blocks']} blocks {info['save_s'] * 1e3:.0f})" +
            (f"; recompute {rec_dt * 1e3:.0f} ms" if rec_dt else ""))
        s["history"] = torch.cat([s["history"], user, reply.view(1, -1).cpu()], 1)
    kv = [r["turn_s"] for r in rows if r["recompute_turn_s"]]
    rc = [r["recompute_turn_s"] for r in rows if r["recompute_turn_s"]]
    res = {"tenants": tenants, "sessions": tenants * sessions, "turns": turns, "system_tokens": system_tokens,
           "hit_rate": held_tokens / context_tokens, "prefill_tokens_saved": held_tokens,
           "turns_checked": checked, "turns_same_tokens": same,
           "mean_turn_s_kvring": float(np.mean(kv)), "mean_turn_s_recompute": float(np.mean(rc)), "rows": rows}
    results["chat"] = res
    log(f"  chat: hit rate {res['hit_rate']:.1%} of context tokens, {held_tokens} prefill tokens saved; on the "
        f"{checked} turns run both ways: {same} same tokens, mean turn {np.mean(kv) * 1e3:.0f} ms with kvring vs "
        f"{np.mean(rc) * 1e3:.0f} ms recompute")


def cache_check(model, results, context=2048, new=16, reps=3):
    """generate's time with the cache it makes itself, with a DynamicCache() passed in, and with
    DynamicCache(config=...) passed in (what kvring.hf.PrefixCache passes): no kvring involved."""
    from transformers import DynamicCache
    g = torch.Generator().manual_seed(3)
    variants = {"own": lambda: None, "DynamicCache()": lambda: DynamicCache(),
                "DynamicCache(config)": lambda: DynamicCache(config=model.config)}
    res = {}
    for name, make in variants.items():
        best, first = float("inf"), None
        for _ in range(reps):
            ids = rand_tokens(g, context, model.config.vocab_size).cuda()
            kw = {} if make() is None else {"past_key_values": make()}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0, **kw)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            first = dt if first is None else first
            best = min(best, dt)
        res[name] = {"best_s": best, "first_s": first}
        log(f"  generate {context} + {new} tokens, cache {name}: {best * 1e3:.0f} ms (first call {first * 1e3:.0f} ms)")
        context += 64  # the next variant meets new lengths only
    results["cache_check"] = res


def decode_tps(model, cache, n, first_token):
    """Tokens/s of n greedy steps from `cache` (after one warm-up step)."""
    tok = first_token
    with torch.no_grad():
        lg = model(tok, past_key_values=cache, use_cache=True).logits[:, -1]
        tok = lg.argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            lg = model(tok, past_key_values=cache, use_cache=True).logits[:, -1]
            tok = lg.argmax(-1, keepdim=True)
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def fill_chunk(c, model, sid, ids, done, n, layout):
    """Stores tokens [done, done + n) of sequence `sid` (which holds exactly `done` tokens, block-aligned) by
    PutSequence, from K/V the engine computes over this chunk alone (local sdpa, positions done.., no attention to
    the tokens before it). Not the K/V a full prefill gives past the first layer: a stand-in for contexts whose
    prefill does not fit the device time (hf_workloads --agent-prefill); decode over them costs the same."""
    import kvring.hf as khf
    from kvring import torch as kt
    cache = khf._dynamic_cache(model)
    pos = torch.arange(done, done + n, device=ids.device).unsqueeze(0)
    model(ids[:, done:done + n], position_ids=pos, past_key_values=cache, use_cache=True)
    bt = layout.block_tokens
    blocks = khf.blocks_from_cache(cache, layout, 0, n // bt)
    del cache
    b0 = done // bt
    keys = np.zeros((n // bt, 2), np.uint64)
    keys[:, 0] = np.arange(b0 + 1, b0 + n // bt + 1, dtype=np.uint64)
    keys[:, 1] = np.uint64(0xA6E47F111ED00000)  # the fill's blocks: keys no chain or other sequence uses
    for i in range(0, n // bt, 2048):
        j = min(n // bt, i + 2048)
        kt.put_sequence(c, sid, b0 + i, keys[i:j], blocks[i:j], layout)
    return blocks.numel() * blocks.element_size()


def agent(c, model, results, total, chunk=8192, milestones=(32768, 65536, 131072, 262144, 524288, 1048576),
          quantize="", prefill=None):
    """prefill: tokens past this many are stored by fill_chunk instead of pass-Q prefill (None: all prefilled)."""
    import kvring.hf as khf
    from transformers import DynamicCache
    g = torch.Generator().manual_seed(7)
    V = model.config.vocab_size
    ids = rand_tokens(g, total, V).cuda()
    weights = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    prefill = total if prefill is None else max(0, min(total, prefill // chunk * chunk))
    sid = "agent-0"
    sess = khf.PassQSession(c, model, [sid])
    rows = []
    t_prefill = t_fill = 0.0
    fill_bytes = 0
    try:
        cache = sess.cache()
        done = 0
        with torch.no_grad():
            while done < total:
                n = min(chunk, total - done)
                filling = done >= prefill
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if not filling:
                    model(ids[:, done:done + n], past_key_values=cache, use_cache=True)
                else:
                    n = n // sess.layout.block_tokens * sess.layout.block_tokens  # (whole blocks only)
                    if n == 0:
                        break
                    # The context cut back to its blocks (the tokens decoded at milestones), the session's
                    # attention off for the local computation, then a session over the longer sequence (keep=True:
                    # the same sequence, not a new one).
                    if min(sess.tokens[0]) != done:
                        sess.truncate(done)
                    sess.detach()
                    fill_bytes += fill_chunk(c, model, sid, ids, done, n, sess.layout)
                    sess = khf.PassQSession(c, model, [sid], keep=True, start_tokens=done + n)
                    cache = sess.cache()
                torch.cuda.synchronize()
                if filling:
                    t_fill += time.perf_counter() - t0
                else:
                    t_prefill += time.perf_counter() - t0
                done += n
                if done in milestones or done == total:
                    tps = decode_tps(model, cache, 8, ids[:, :1])
                    # (the 9 decoded tokens extend the context: a prefill continues after them, a fill first cuts
                    # them off)
                    peak = torch.cuda.max_memory_allocated() - weights
                    rows.append({"context": done, "passq_decode_tokens_per_s": tps, "prefill_s_so_far": t_prefill,
                                 "filled_tokens": max(0, done - prefill), "fill_s_so_far": t_fill,
                                 "engine_peak_bytes_above_weights": peak, "bytes_sent": sess.bytes_sent,
                                 "bytes_received": sess.bytes_received, "shard_steps": sess.shard_steps,
                                 "shard_steps_in_place": sess.shard_steps_in_place})
                    filled = f", {(done - prefill) // 1024}K filled in {t_fill:.1f} s" if done > prefill else ""
                    log(f"  agent: context {done // 1024}K tokens on kvring (prefill so far {t_prefill:.1f} s"
                        f"{filled}): decode {tps:.1f} tok/s, engine peak {peak / 1e9:.2f} GB above the weights, "
                        f"{sess.bytes_sent / 1e9:.1f} GB sent / {sess.bytes_received / 1e9:.1f} GB received "
                        f"(this session); {sess.shard_steps_in_place} of {sess.shard_steps} shard steps in this "
                        f"GPU's memory")
    finally:
        sess.detach()
    res = {"tokens": total, "shards": 4, "rows": rows, "stored_as": quantize or "bf16", "prefilled_tokens": prefill,
           "filled_tokens": max(0, total - prefill), "fill_s": t_fill, "fill_bytes_put": fill_bytes,
           "prefill_s": t_prefill}
    # Its first min(total, 128K) tokens with their KV in the engine (local sdpa, bf16), where they fit: the peer of
    # the pass-Q rows at that length.
    local_n = min(total, 131072)
    kv_bytes = local_n * model.config.num_hidden_layers * 2 * model.config.num_key_value_heads * 128 * 2
    free = torch.cuda.mem_get_info()[0]
    if kv_bytes * 1.5 < free:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        local = DynamicCache()
        with torch.no_grad():
            for s0 in range(0, local_n, chunk):
                model(ids[:, s0:min(local_n, s0 + chunk)], past_key_values=local, use_cache=True)
        tps = decode_tps(model, local, 8, ids[:, :1])
        peak = torch.cuda.max_memory_allocated() - weights
        res["local_sdpa"] = {"context": local_n, "decode_tokens_per_s": tps, "engine_peak_bytes_above_weights": peak}
        log(f"  agent: {local_n // 1024}K tokens of that context with local sdpa: decode {tps:.1f} tok/s, engine "
            f"peak {peak / 1e9:.2f} GB above the weights")
        del local
        torch.cuda.empty_cache()
    else:
        log(f"  agent: {local_n // 1024}K tokens of KV ({kv_bytes / 1e9:.0f} GB) do not fit beside the engine: "
            f"no local run")
    results["agent"] = res


def batch(c, model, results, docs=2, doc_tokens=8192, requests=8, question=256, new_tokens=8):
    import kvring.hf as khf
    g = torch.Generator().manual_seed(9)
    V = model.config.vocab_size
    documents = [rand_tokens(g, doc_tokens, V) for _ in range(docs)]
    reqs = [torch.cat([documents[i % docs], rand_tokens(g, question, V)], 1).cuda() for i in range(requests)]
    pc = khf.PrefixCache(c, model, "batch-llama3-8b")
    model.generate(reqs[0][:, :512], max_new_tokens=1, do_sample=False, pad_token_id=0)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    held, loaded_bytes, outs = 0, 0, []
    for r in reqs:
        out, info = pc.generate(r, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        held += info["held_blocks"] * 16
        loaded_bytes += info["held_blocks"] * pc.layout.bytes
        outs.append(out[0, r.shape[1]:])
    torch.cuda.synchronize()
    kv_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    same = 0
    for r, o in zip(reqs, outs):
        ref = model.generate(r, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        same += int(torch.equal(ref[0, r.shape[1]:], o))
    torch.cuda.synchronize()
    rec_s = time.perf_counter() - t0
    total_prompt = sum(r.shape[1] for r in reqs)
    res = {"requests": requests, "documents": docs, "doc_tokens": doc_tokens, "wall_s_kvring": kv_s,
           "wall_s_recompute": rec_s, "speedup": rec_s / kv_s, "hit_rate": held / total_prompt,
           "loaded_bytes": loaded_bytes, "requests_same_tokens": same,
           "prompt_tokens_per_s_kvring": total_prompt / kv_s, "prompt_tokens_per_s_recompute": total_prompt / rec_s}
    results["batch"] = res
    log(f"  batch: {requests} requests over {docs} shared {doc_tokens // 1024}K documents: {kv_s:.2f} s with kvring "
        f"({res['hit_rate']:.0%} of prompt tokens loaded, {loaded_bytes / 1e9:.1f} GB) vs {rec_s:.2f} s recompute "
        f"({res['speedup']:.1f}x); {same}/{requests} requests give recompute's tokens")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin", default=str(ROOT / ".gpu"))
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    p.add_argument("--only", default="chat,agent,batch")
    p.add_argument("--agent-tokens", type=int, default=131072)
    p.add_argument("--agent-quantize", default="",
                   help="the agent's sequence stored in this encoding (int8, fp8, ...: ClientOptions::quantize); "
                        "its open blocks stay bf16")
    p.add_argument("--agent-prefill", type=int, default=None,
                   help="the agent's tokens past this many are stored by PutSequence from K/V the engine computes "
                        "chunk by chunk (each chunk alone: a stand-in where the whole prefill does not fit the "
                        "device time); default: all of them through pass-Q prefill")
    p.add_argument("--agent-check", type=int, default=4096,
                   help="with --agent-quantize: teacher-forced logits of pass-Q over a context of this many tokens "
                        "stored in that encoding against local sdpa (0: no check)")
    p.add_argument("--chat-turns", type=int, default=12)
    p.add_argument("--cudnn-sdpa", action="store_true", help="leave SDPA's cuDNN backend on (see main)")
    args = p.parse_args()
    from kvring.local_cluster import start_mps
    print("[mps] " + start_mps(), flush=True)  # before this process's first CUDA call: the default deployment (docs/MPS.md)
    import kvring
    from kvring.local_cluster import LocalCluster
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = args.only.split(",")

    section = Sections(results, out / "hf_workloads.json")

    # cuDNN's SDPA builds an execution plan for each new sequence length (tens of ms each, once per process):
    # a turn's first generate meets 16 new lengths, the same turn's recompute right after meets none, which
    # charged kvring for warming recompute's plans (first run: 1.1-2.3 s against 0.6 s). The flash and
    # memory-efficient backends plan nothing: every figure below uses them, on both sides.
    if not args.cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    log("== Llama-3-8B shapes (random weights), kvringd --gpu daemons on this GPU"
        + ("" if args.cudnn_sdpa else "; SDPA without the cuDNN backend"))
    model = build_model(32, 32, 8, 4096, 14336, seed=1)
    page = str(2 << 20)
    # HBM: 4 daemons x 12 GB hold a 128K context 3x over (16 GiB of KV).
    # Beyond 256K (64 GiB of KV at 512K: 16 GiB a daemon), 20 GB of HBM and of host tier a daemon (1M tokens
    # stored int8 or fp8: ~69 GB with their scales, 17 GB a daemon).
    hbm = host = "12G" if args.agent_tokens <= 262144 else "20G"
    if args.agent_tokens <= 262144:
        host = "8G"
    with LocalCluster(nodes=4, port=8600, replication=1, host_bytes=host, page_bytes=page, gpu=0, hbm_bytes=hbm,
                      chunk_blocks=256, bin=args.bin, root=ROOT) as cl:
        c = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=300)
        if "cachecheck" in parts:
            section("cachecheck", lambda: cache_check(model, results))
        if "chat" in parts:
            tokens = [kvring.create_tenant(cl.coordinator, cl.admin_token, f"chat-{t}") for t in range(2)]
            clients = [kvring.Client(cl.coordinator, tk, rpc_timeout=120) for tk in tokens]
            section("chat", lambda: chat(lambda t: clients[t], model, results, turns=args.chat_turns))
            for x in clients:
                x.close()
        if "batch" in parts:
            section("batch", lambda: batch(c, model, results))
        if "agent" in parts:
            ca = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=300, quantize=args.agent_quantize) \
                if args.agent_quantize else c
            if args.agent_quantize and args.agent_check:
                from hf_e2e import passq_check
                section("agent-check", lambda: passq_check(ca, model, f"agent-{args.agent_quantize}",
                                                           args.agent_check, 32, results))
            section("agent", lambda: agent(ca, model, results, args.agent_tokens, quantize=args.agent_quantize,
                                           prefill=args.agent_prefill))
            if ca is not c:
                ca.close()
        c.close()
    log("hf_workloads: " + ("done" if section.ok else "SOME SECTIONS FAILED"))
    section.save()
    sys.exit(0 if section.ok else 1)


if __name__ == "__main__":
    main()
