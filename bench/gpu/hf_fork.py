#!/usr/bin/env python3
"""transformers sessions forked from one shared context on kvring (kvring.hf.PassQSession(fork_of=...)).

  python3 bench/gpu/hf_fork.py --bin .gpu [--prompt 4096 --forks 4]

A shared prompt is prefilled once into a kept sequence ("ctx"); each session then starts as a fork of it
(ForkSequence: the prompt's blocks shared, not copied), feeds its own 8-token suffix and generates 8 tokens
greedily. Checks each session's logits against transformers' own sdpa on the whole input (prompt + suffix) in the
same run, and that the forks hold the prompt once (shared blocks in ListSequences). Then a session started from
the prefix cache (PassQSession(prefix_of=...)) over the prompt that kvring.hf.PrefixCache stored: the same checks.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from hf_e2e import build_model, compare_logits, greedy, log  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin", default=str(ROOT.parents[1] / ".gpu"))
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--forks", type=int, default=4)
    args = p.parse_args()
    from kvring.local_cluster import start_mps
    print("[mps] " + start_mps(), flush=True)  # before this process's first CUDA call: the default deployment (docs/MPS.md)
    import kvring
    import kvring.hf as khf
    from kvring.local_cluster import LocalCluster
    model = build_model(args.layers, 32, 8, 4096, 14336, seed=1)
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(1, model.config.vocab_size, (1, args.prompt), generator=g).cuda()
    suffixes = [torch.randint(1, model.config.vocab_size, (1, 8), generator=g).cuda() for _ in range(args.forks)]
    res = {"date": time.strftime("%Y-%m-%d"), "layers": args.layers, "prompt": args.prompt, "forks": []}
    refs = [greedy(model, torch.cat([prompt, s], 1), 8) for s in suffixes]  # sdpa, the KV in the engine
    with LocalCluster(nodes=1, port=8700, replication=1, host_bytes="8G", page_bytes=str(1 << 20), gpu=0,
                      hbm_bytes="8G", chunk_blocks=256, bin=args.bin, root=ROOT.parents[1]) as cl:
        c = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=60)
        with khf.PassQSession(c, model, ["ctx"], keep=True) as sess:  # prefilled once, kept
            with torch.no_grad():
                model(prompt, past_key_values=sess.cache(), use_cache=True)
        ok = True
        for i, s in enumerate(suffixes):
            with khf.PassQSession(c, model, [f"fork{i}"], fork_of=("ctx", args.prompt), keep=True) as fs:
                tokens, logits = greedy(model, torch.cat([prompt, s], 1), 8, cache=fs.cache())
            max_rel, ties = compare_logits(refs[i][1], logits)
            first_diff = next((j for j, (a, b) in enumerate(zip(tokens, refs[i][0])) if a != b), None)
            good = max_rel < 5e-2 and (first_diff is None or first_diff in ties)
            ok &= good
            res["forks"].append({"max_rel_logit_diff": max_rel, "tokens_equal": tokens == refs[i][0],
                                 "first_difference": first_diff, "tie_steps": ties, "ok": good})
        # A session started from the prefix cache: the prompt stored once by kvring.hf.PrefixCache (hash-placed
        # blocks, as an engine's prefix store saves them), then PassQSession(prefix_of=...) starts its sequence
        # from that chain (the node's blocks shared, not copied) and generate computes only the suffix.
        pc = khf.PrefixCache(c, model, "fork-bench-model")
        _, info = pc.generate(prompt, max_new_tokens=1, do_sample=False, pad_token_id=0)
        blocks_before = sum(s["blocks"] for s in c.stats())
        with khf.PassQSession(c, model, ["pfx0"], prefix_of=("fork-bench-model", torch.cat([prompt, suffixes[0]], 1)),
                              keep=True) as ps:
            hit = ps.prefix_tokens
            tokens, logits = greedy(model, torch.cat([prompt, suffixes[0]], 1), 8, cache=ps.cache())
        max_rel, ties = compare_logits(refs[0][1], logits)
        first_diff = next((j for j, (a, b) in enumerate(zip(tokens, refs[0][0])) if a != b), None)
        good = hit == args.prompt and max_rel < 5e-2 and (first_diff is None or first_diff in ties)
        ok &= good
        res["from_prefix_cache"] = {"saved_blocks": info["saved_blocks"], "prefix_tokens": hit,
                                    "max_rel_logit_diff": max_rel, "tokens_equal": tokens == refs[0][0],
                                    "first_difference": first_diff, "tie_steps": ties, "ok": good}
        # One node holds the whole chain: the sequence records its blocks by key, no copy of the prompt.
        res["from_prefix_cache"]["store_blocks_added"] = sum(s["blocks"] for s in c.stats()) - blocks_before
        ok &= res["from_prefix_cache"]["store_blocks_added"] < 2
        res["from_prefix_cache"]["ok"] = good and res["from_prefix_cache"]["store_blocks_added"] < 2
        c.delete_sequence("pfx0")
        listed = {x["sequence_id"]: x for x in c.list_sequences()}
        res["ctx_blocks"] = listed["ctx"]["full_blocks"]
        res["fork_shared_blocks"] = [listed[f"fork{i}"]["shared_blocks"] for i in range(args.forks)]
        # (the prefix cache's chain of the prompt is stored beside: hash-placed blocks, not the sequences')
        res["store_blocks"] = sum(s["blocks"] for s in c.stats()) - info["saved_blocks"]
        ok &= all(x >= args.prompt // 16 for x in res["fork_shared_blocks"])
        ok &= res["store_blocks"] < res["ctx_blocks"] + args.forks * 4  # the prompt once, plus each fork's tail
        for sid in ["ctx"] + [f"fork{i}" for i in range(args.forks)]:
            c.delete_sequence(sid)
        res["store_blocks_after_delete"] = sum(s["blocks"] for s in c.stats())
        ok &= res["store_blocks_after_delete"] == info["saved_blocks"]  # the prefix cache's blocks stay
        c.close()
    res["ok"] = ok
    log(json.dumps(res, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "hf_fork.json").write_text(json.dumps(res, indent=1))
    log("hf_fork: " + ("passed" if ok else "FAILED"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
