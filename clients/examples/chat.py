#!/usr/bin/python3
"""Workload 1, multi-tenant chat: several tenants, each with a system prompt
shared by all its sessions, many multi-turn sessions (Zipf popularity) whose
context grows every turn. Each turn is what a serving engine does with
kvring as its prefix cache (kvring.connector): look the context up, load the
cached prefix, prefill only the rest with the model (the numpy reference
engine, random weights), generate a reply, save the new full blocks.

Reports the prefix hit rate over time and the prefill tokens saved; with
--verify, also checks on the first turns that the logits equal a full
recompute (the cache changes nothing but the work).

  /usr/bin/python3 clients/examples/chat.py [--quick] [--coordinator H:P --admin_token_file F]
"""
import time

import numpy as np

import kvring
from kvring import connector, engine
import workload_common as wc


def main():
    p = wc.parser(__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--sessions", type=int, default=24, help="sessions per tenant")
    p.add_argument("--turns", type=int, default=240, help="turns in all")
    p.add_argument("--reply_tokens", type=int, default=6)
    p.add_argument("--verify", type=int, default=3, help="turns checked against a full recompute")
    a = p.parse_args()
    if a.quick:
        a.tenants, a.sessions, a.turns = 2, 4, 24
    rng = np.random.default_rng(a.seed)
    cfg = engine.Config()
    model = engine.Model(cfg, seed=a.seed)
    layout = kvring.Layout(cfg.block_tokens, cfg.layers, cfg.kv_heads, cfg.head_dim, "f16")
    with wc.cluster(a, page_bytes="16K", host_bytes="256M") as (coord, admin, _):
        conns, systems, sessions = [], [], []
        for t in range(a.tenants):
            token = wc.tenant(coord, admin, f"chat-t{t}")
            conns.append(connector.Connector(kvring.Client(coord, token), f"tiny-chat-{a.seed}", layout))
            systems.append(rng.integers(0, cfg.vocab, int(rng.integers(200, 600))))  # 200-600-token system prompt
            for s in range(a.sessions):
                sessions.append(dict(tenant=t, history=np.zeros(0, np.int64)))
        zipf = 1.0 / np.arange(1, len(sessions) + 1) ** 0.9
        zipf /= zipf.sum()
        log, verified = [], 0
        t0 = time.time()
        for turn in range(a.turns):
            s = sessions[int(rng.choice(len(sessions), p=zipf))]
            conn = conns[s["tenant"]]
            user = rng.integers(0, cfg.vocab, int(rng.integers(20, 80)))
            context = np.concatenate([systems[s["tenant"]], s["history"], user])
            ts = time.time()
            hit = conn.lookup(context)
            cache = engine.LocalAttention(cfg)
            if hit:
                try:
                    cache.k, cache.v = conn.load(context, hit)
                except kvring.NotFoundError:  # evicted between lookup and load: recompute
                    hit = 0
            logits = model.forward(context[hit:], hit, cache)[-1]
            if verified < a.verify and hit:
                full = model.forward(context, 0, engine.LocalAttention(cfg))[-1]
                err = float(np.max(np.abs(full - logits)) / np.max(np.abs(full)))
                if err > 1e-4:
                    raise SystemExit(f"turn {turn}: cached-prefix logits differ from a full recompute by {err}")
                verified += 1
            reply = []
            for _ in range(a.reply_tokens):
                tok = int(np.argmax(logits))
                reply.append(tok)
                logits = model.forward([tok], len(context) + len(reply) - 1, cache)[0]
            full_ctx = np.concatenate([context, reply])
            conn.save(full_ctx, cache.k, cache.v, first_token=hit)
            s["history"] = np.concatenate([s["history"], user, reply])
            log.append(dict(turn=turn, tenant=s["tenant"], context=len(context), hit=hit, seconds=time.time() - ts))
            if (turn + 1) % max(1, a.turns // 8) == 0:
                w = log[-max(1, a.turns // 8):]
                print(f"[chat] turn {turn + 1}/{a.turns}: window hit rate "
                      f"{sum(x['hit'] for x in w) / sum(x['context'] for x in w):.3f}, {time.time() - t0:.1f} s", flush=True)
        ctx = sum(x["context"] for x in log)
        hits = sum(x["hit"] for x in log)
        first_turn_hits = [x for x in log if x["hit"] == 0]
        result = dict(tenants=a.tenants, sessions=len(sessions), turns=a.turns, context_tokens=ctx, hit_tokens=hits,
                      hit_rate=hits / ctx, prefill_tokens_saved=hits, prefill_tokens_computed=ctx - hits,
                      turns_without_hit=len(first_turn_hits), verified_turns=verified,
                      bytes_loaded=sum(c.bytes_loaded for c in conns), bytes_saved=sum(c.bytes_saved for c in conns),
                      p50_turn_s=wc.pct([x["seconds"] for x in log], 50), p99_turn_s=wc.pct([x["seconds"] for x in log], 99))
        print(f"\nchat: {a.tenants} tenants, {len(sessions)} sessions, {a.turns} turns")
        print(f"  prefix hit rate        {result['hit_rate']:.3f}  ({hits} of {ctx} context tokens came from kvring)")
        print(f"  prefill tokens saved   {hits}  (computed {ctx - hits})")
        print(f"  KV loaded / saved      {result['bytes_loaded'] / 1e6:.1f} MB / {result['bytes_saved'] / 1e6:.1f} MB")
        print(f"  turn latency           p50 {result['p50_turn_s'] * 1e3:.1f} ms, p99 {result['p99_turn_s'] * 1e3:.1f} ms")
        print(f"  verified vs recompute  {verified} turns: identical logits (rel. err < 1e-4)")
        wc.write_json(a.out_dir, "chat.json", dict(result=result, log=log))
        window = max(1, a.turns // 20)

        def draw(plt):
            hr = [sum(x["hit"] for x in log[i:i + window]) / sum(x["context"] for x in log[i:i + window])
                  for i in range(0, len(log) - window + 1)]
            plt.plot(range(window, len(log) + 1), hr)
            plt.xlabel("turn")
            plt.ylabel(f"prefix hit rate (last {window} turns)")
            plt.title(f"chat: {a.tenants} tenants, {len(sessions)} sessions")
            plt.ylim(0, 1)
            plt.grid(alpha=0.3)
        path = wc.plot(a.out_dir, "chat_hit_rate.png", draw)
        print(f"  results in {a.out_dir}/chat.json" + (f", plot {path}" if path else ""))
        return result


if __name__ == "__main__":
    main()
