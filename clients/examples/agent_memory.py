#!/usr/bin/python3
"""Workload 2, agent memory: one agent's long context (128K tokens by
default) lives in the cluster, spread over the shards by sequence, and the
agent works on it for many steps. Each step appends an observation
(prefilled by pass-Q: its queries travel to the shards that hold the
context) and decodes a few tokens by pass-Q; only queries and (out, LSE)
partials cross the network, never the context's KV.

For comparison the step also reports what pulling the KV would move: the
bytes of the stored context, once per step (what an engine without
attention offload must bring to itself at every step when it cannot keep
the agent's KV resident between steps), and every few steps it times a real pull of the original
context (a copy of it placed by key, read back with get_into).

The model is the numpy reference engine (random weights). **The first
context's KV is synthetic** (random float16 blocks written with
put_sequence): computing 128K tokens of prefill in numpy on two cores is
out of reach; every token after it is the model's own computation.

  /usr/bin/python3 clients/examples/agent_memory.py [--quick] [--context_tokens 131072]
"""
import time

import numpy as np

import kvring
from kvring import connector, engine
import workload_common as wc


def main():
    p = wc.parser(__doc__.split("\n\n")[0])
    p.add_argument("--context_tokens", type=int, default=131072)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--observation_tokens", type=int, default=48)
    p.add_argument("--decode_tokens", type=int, default=4)
    p.add_argument("--pull_every", type=int, default=4, help="measure a real pull every N steps")
    a = p.parse_args()
    if a.quick:
        a.context_tokens, a.steps = 16384, 4
    rng = np.random.default_rng(a.seed)
    cfg = engine.Config()
    model = engine.Model(cfg, seed=a.seed)
    layout = kvring.Layout(cfg.block_tokens, cfg.layers, cfg.kv_heads, cfg.head_dim, "f16")
    bt = cfg.block_tokens
    with wc.cluster(a, page_bytes="16K", host_bytes="1G", replication=1) as (coord, admin, _):
        client = kvring.Client(coord, wc.tenant(coord, admin, "agent"))
        seq = f"agent-{a.seed}-{int(time.time())}"
        n_blocks = a.context_tokens // bt
        t0 = time.time()
        chunk, pull_keys = 512, []
        for first in range(0, n_blocks, chunk):
            n = min(chunk, n_blocks - first)
            blocks = (rng.standard_normal((n,) + tuple(layout.block_shape)) * 0.5).astype(np.float16)
            keys = client.chain("seq:" + seq, layout, np.arange(first * bt, (first + n) * bt, dtype=np.uint32))
            client.put_sequence(seq, first, keys, blocks, layout)
            # The same KV once more, placed by key, to time real pulls of it.
            pkeys = client.chain("pull:" + seq, layout, np.arange(first * bt, (first + n) * bt, dtype=np.uint32))
            client.put(pkeys, blocks, layout)
            pull_keys.append(pkeys)
        pull_keys = np.concatenate(pull_keys)
        load_s = time.time() - t0
        print(f"[agent] stored a {a.context_tokens}-token context ({n_blocks} blocks, "
              f"{n_blocks * layout.bytes / 1e6:.0f} MB) in {load_s:.1f} s", flush=True)
        session = connector.PassQSession(client, layout, seq, stored_blocks=n_blocks)
        steps = []
        for step in range(a.steps):
            sent0, recv0 = session.bytes_sent, session.bytes_received
            ts = time.time()
            obs = rng.integers(0, cfg.vocab, a.observation_tokens)
            logits = model.forward(obs, session.tokens, session)[-1]
            for _ in range(a.decode_tokens):
                tok = int(np.argmax(logits))
                logits = model.forward([tok], session.tokens, session)[0]
            step_s = time.time() - ts
            passq = (session.bytes_sent - sent0) + (session.bytes_received - recv0)
            pull = session.pull_bytes_per_step()  # pulled once, kept for the step's forward passes
            rec = dict(step=step, context_tokens=session.tokens, passq_bytes=passq, pull_bytes=pull, step_s=step_s)
            if step % a.pull_every == 0:  # time one real pull of the original context
                buf = np.empty((n_blocks,) + tuple(layout.block_shape), np.float16)
                tp = time.time()
                found = client.get_into(pull_keys, layout, buf)
                rec["pull_once_s"] = time.time() - tp
                if not found.all():
                    raise SystemExit(f"pull: {int((~found).sum())} of {n_blocks} blocks missing")
                rec["pull_once_bytes"] = int(found.sum()) * layout.bytes
            steps.append(rec)
            print(f"[agent] step {step + 1}/{a.steps}: context {session.tokens} tokens, pass-Q moved "
                  f"{passq / 1e3:.1f} KB vs pull {pull / 1e6:.0f} MB ({pull / max(1, passq):.0f}x), {step_s:.2f} s",
                  flush=True)
        tot_q = sum(s["passq_bytes"] for s in steps)
        tot_p = sum(s["pull_bytes"] for s in steps)
        result = dict(context_tokens=a.context_tokens, steps=a.steps, forwards_per_step=1 + a.decode_tokens,
                      passq_bytes_per_step=tot_q / a.steps, pull_bytes_per_step=tot_p / a.steps,
                      ratio=tot_p / max(1, tot_q), p50_step_s=wc.pct([s["step_s"] for s in steps], 50),
                      store_context_s=load_s)
        pulls = [s for s in steps if "pull_once_s" in s]
        result["pull_once_s"] = wc.pct([s["pull_once_s"] for s in pulls], 50)
        result["pull_once_gbps"] = pulls[0]["pull_once_bytes"] / result["pull_once_s"] / 1e9
        print(f"\nagent memory: {a.context_tokens}-token context, {a.steps} steps of {a.observation_tokens} "
              f"observed + {a.decode_tokens} decoded tokens")
        print(f"  bytes moved per step   pass-Q {result['passq_bytes_per_step'] / 1e3:.1f} KB, "
              f"pull {result['pull_bytes_per_step'] / 1e6:.0f} MB  ({result['ratio']:.0f}x less with pass-Q)")
        print(f"  step latency (p50)     {result['p50_step_s']:.2f} s (attention on the shards, 2 cores)")
        print(f"  one real pull          {result['pull_once_s']:.2f} s for the {a.context_tokens}-token context "
              f"({result['pull_once_gbps']:.2f} GB/s over loopback)")
        wc.write_json(a.out_dir, "agent_memory.json", dict(result=result, steps=steps))

        def draw(plt):
            x = [s["context_tokens"] / 1024 for s in steps]
            plt.semilogy(x, [s["pull_bytes"] for s in steps], marker="o", label="pull the KV")
            plt.semilogy(x, [s["passq_bytes"] for s in steps], marker="o", label="pass-Q (queries + partials)")
            plt.xlabel("context (K tokens)")
            plt.ylabel("bytes moved per step")
            plt.title("agent memory: bytes per step")
            plt.legend()
            plt.grid(alpha=0.3, which="both")
        path = wc.plot(a.out_dir, "agent_bytes.png", draw)
        print(f"  results in {a.out_dir}/agent_memory.json" + (f", plot {path}" if path else ""))
        return result


if __name__ == "__main__":
    main()
