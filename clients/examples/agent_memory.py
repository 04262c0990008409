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

The run sweeps the context length (8K to 128K tokens by default, a fresh
agent sequence for each) so the plot shows how each cost grows with it.

  /usr/bin/python3 clients/examples/agent_memory.py [--quick] [--contexts 8192,...,131072]
"""
import time

import numpy as np

import kvring
from kvring import connector, engine
import workload_common as wc


def store_context(client, rng, layout, seq, n_blocks):
    """Writes n_blocks synthetic blocks as sequence `seq` (placed by sequence)
    and again by key (to time a real pull); returns the pull keys."""
    bt = layout.block_tokens
    chunk, pull_keys = 512, []
    for first in range(0, n_blocks, chunk):
        n = min(chunk, n_blocks - first)
        blocks = (rng.standard_normal((n,) + tuple(layout.block_shape)) * 0.5).astype(np.float16)
        keys = client.chain("seq:" + seq, layout, np.arange(first * bt, (first + n) * bt, dtype=np.uint32))
        client.put_sequence(seq, first, keys, blocks, layout)
        pkeys = client.chain("pull:" + seq, layout, np.arange(first * bt, (first + n) * bt, dtype=np.uint32))
        client.put(pkeys, blocks, layout)
        pull_keys.append(pkeys)
    return np.concatenate(pull_keys)


def main():
    p = wc.parser(__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="8192,16384,32768,65536,131072", help="context lengths (tokens) to sweep")
    p.add_argument("--steps", type=int, default=3, help="agent steps per context length")
    p.add_argument("--observation_tokens", type=int, default=48)
    p.add_argument("--decode_tokens", type=int, default=4)
    a = p.parse_args()
    if a.quick:
        a.contexts, a.steps = "16384,65536", 2
    contexts = [int(x) for x in a.contexts.split(",")]
    rng = np.random.default_rng(a.seed)
    cfg = engine.Config()
    model = engine.Model(cfg, seed=a.seed)
    layout = kvring.Layout(cfg.block_tokens, cfg.layers, cfg.kv_heads, cfg.head_dim, "f16")
    bt = cfg.block_tokens
    with wc.cluster(a, page_bytes="16K", host_bytes="1G", replication=1) as (coord, admin, _):
        client = kvring.Client(coord, wc.tenant(coord, admin, "agent"))
        steps, per_context = [], []
        for ctx in contexts:
            seq = f"agent-{a.seed}-{ctx}-{int(time.time())}"
            n_blocks = ctx // bt
            t0 = time.time()
            pull_keys = store_context(client, rng, layout, seq, n_blocks)
            print(f"[agent] stored a {ctx}-token context ({n_blocks} blocks, {n_blocks * layout.bytes / 1e6:.0f} MB) "
                  f"in {time.time() - t0:.1f} s", flush=True)
            # One real pull of the whole context (what an engine without offload does each step).
            buf = np.empty((n_blocks,) + tuple(layout.block_shape), np.float16)
            tp = time.time()
            found = client.get_into(pull_keys, layout, buf)
            pull_s = time.time() - tp
            if not found.all():
                raise SystemExit(f"pull: {int((~found).sum())} of {n_blocks} blocks missing")
            session = connector.TailPassQ(client, layout, seq, stored_blocks=n_blocks)
            mine = []
            for step in range(a.steps):
                sent0, recv0 = session.bytes_sent, session.bytes_received
                ts = time.time()
                obs = rng.integers(0, cfg.vocab, a.observation_tokens)
                logits = model.forward(obs, session.tokens, session)[-1]
                for _ in range(a.decode_tokens):
                    tok = int(np.argmax(logits))
                    logits = model.forward([tok], session.tokens, session)[0]
                rec = dict(context_tokens=session.tokens, step=step, step_s=time.time() - ts,
                           passq_bytes=(session.bytes_sent - sent0) + (session.bytes_received - recv0),
                           pull_bytes=session.pull_bytes_per_step())  # pulled once, kept for the step
                mine.append(rec)
                print(f"[agent] {ctx // 1024}K step {step + 1}/{a.steps}: pass-Q moved {rec['passq_bytes'] / 1e3:.0f} KB "
                      f"vs pull {rec['pull_bytes'] / 1e6:.0f} MB ({rec['pull_bytes'] / max(1, rec['passq_bytes']):.0f}x), "
                      f"{rec['step_s']:.2f} s", flush=True)
            steps += mine
            per_context.append(dict(context_tokens=ctx, passq_bytes=float(np.mean([r["passq_bytes"] for r in mine])),
                                    pull_bytes=float(np.mean([r["pull_bytes"] for r in mine])),
                                    ratio=float(np.mean([r["pull_bytes"] / max(1, r["passq_bytes"]) for r in mine])),
                                    step_s=wc.pct([r["step_s"] for r in mine], 50), pull_once_s=pull_s,
                                    pull_gbps=n_blocks * layout.bytes / pull_s / 1e9))
        print(f"\nagent memory: steps of {a.observation_tokens} observed + {a.decode_tokens} decoded tokens "
              f"(the reference model: 4 layers, 8 q / 2 kv heads x 32)")
        print("  | context | pass-Q bytes/step | pull bytes/step | pull / pass-Q | pass-Q step (s) | one pull (s) |")
        print("  |---|---|---|---|---|---|")
        for c in per_context:
            print(f"  | {c['context_tokens'] // 1024}K | {c['passq_bytes'] / 1e6:.2f} MB | {c['pull_bytes'] / 1e6:.0f} MB | "
                  f"{c['ratio']:.0f}x | {c['step_s']:.2f} | {c['pull_once_s']:.3f} |")
        result = dict(per_context=per_context, ratio=per_context[-1]["ratio"], context_tokens=contexts[-1],
                      pull_once_gbps=per_context[-1]["pull_gbps"])
        wc.write_json(a.out_dir, "agent_memory.json", dict(result=result, steps=steps))

        def draw(plt):
            x = [c["context_tokens"] / 1024 for c in per_context]
            plt.loglog(x, [c["pull_bytes"] for c in per_context], marker="o", base=2, label="pull the KV (once per step)")
            plt.loglog(x, [c["passq_bytes"] for c in per_context], marker="o", base=2, label="pass-Q (queries + partials)")
            plt.xlabel("context (K tokens)")
            plt.ylabel("bytes moved per agent step")
            plt.title("agent memory: bytes per step, pass-Q vs pull")
            plt.legend()
            plt.grid(alpha=0.3, which="both")
        path = wc.plot(a.out_dir, "agent_bytes.png", draw)
        print(f"  results in {a.out_dir}/agent_memory.json" + (f", plot {path}" if path else ""))
        return result


if __name__ == "__main__":
    main()
