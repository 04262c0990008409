#!/usr/bin/env python3
"""A real engine on kvring: Hugging Face transformers' Llama model code and
generate loop on GPU daemons, as pass-Q attention and as a prefix cache.

  python3 bench/gpu/hf_e2e.py --bin .gpu --out $OUT [--quick]

No weights can be downloaded: the models are built from configs with
seeded random weights (Llama-3-8B shapes: 32 layers, 32 q / 8 kv heads,
head_dim 128, bf16; and a held-out 40-layer, 40 q / 8 kv head shape). The
output projection is scaled up (x8) so that greedy choices are decisive
rather than near-ties of an untrained model's flat logits.

Checks (results in $OUT/hf_e2e.json). The tolerance is stated against a peer
measured in the same run: teacher-forced logits may differ from sdpa's by at
most max(5e-2, 1.5 x what transformers' own eager attention differs from
sdpa by), relative to the step's largest logit:
 1. pass-Q greedy: 32 tokens from a 4K prompt with kvring attention equal
    transformers' sdpa; teacher-forced logits on the reference tokens agree
    (max relative difference reported; steps whose reference top-2 gap is
    within that tolerance are reported as ties, not hidden);
 2. prefix cache: a second request sharing an 8K prefix, loaded from kvring
    into a DynamicCache on the GPU, gives recompute's tokens;
 3. the held-out shape: 1 and 2 again;
 4. faults: blocks evicted between lookup and load are recomputed (same
    tokens); a shard killed mid-generation with R=2 changes no token;
 5. figures: TTFT with a kvring hit against recompute (8K/32K/128K
    prefixes); decode tokens/s with pass-Q on 1 and 4 shards against local
    sdpa decode; the engine's peak GPU memory with and without offload;
    bytes moved.
"""
import argparse
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]


def log(*a):
    print(*a, flush=True)


def build_model(layers, heads, kv_heads, hidden, inter, seed, vocab=32000):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128, vocab_size=vocab,
                      max_position_embeddings=262144, rope_theta=500000.0, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.eval()
    set_attention(model, "sdpa")
    return model


def greedy(model, ids, n, cache=None):
    out = model.generate(ids, max_new_tokens=n, do_sample=False, past_key_values=cache, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, ids.shape[1]:].tolist(), torch.stack([x[0].float() for x in out.logits])


def teacher_forced(model, ids, ref_tokens, cache):
    """Logits at each step given the reference tokens (kvring path)."""
    logits = []
    with torch.no_grad():
        lg = model(ids, past_key_values=cache, use_cache=True).logits[0, -1].float()
        logits.append(lg)
        for t in ref_tokens[:-1]:
            lg = model(torch.tensor([[t]], device=ids.device), past_key_values=cache, use_cache=True).logits[0, -1].float()
            logits.append(lg)
    return torch.stack(logits)


TOL = 5e-2  # teacher-forced logits: max |difference| / max |logit| a step (bf16 through every layer)
PEER_FACTOR = 1.5  # kvring may differ from sdpa at most 1.5x as much as transformers' eager attention does


def set_attention(model, name):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def eager_floor(model, ids, ref_tokens, ref_logits):
    """How far transformers' own eager attention is from sdpa on the same steps (teacher-forced): the bf16
    noise floor of this model, measured in the same run."""
    from transformers import DynamicCache
    torch.cuda.empty_cache()  # (eager attention holds a layer's scores at once: 11 GB at 8K on the 40-layer shape)
    set_attention(model, "eager")
    try:
        tf = teacher_forced(model, ids, ref_tokens, DynamicCache())
    finally:
        set_attention(model, "sdpa")
    return compare_logits(ref_logits, tf)[0]


def compare_logits(ref, got, tol=TOL):
    """(max relative difference over steps, steps where the reference's top-2 gap is within tolerance)."""
    rel = ((got - ref).abs().amax(dim=-1) / ref.abs().amax(dim=-1)).tolist()
    top2 = ref.topk(2, dim=-1).values
    gap = ((top2[:, 0] - top2[:, 1]) / ref.abs().amax(dim=-1)).tolist()
    ties = [i for i, g in enumerate(gap) if g <= tol]  # a greedy step the tolerance cannot decide
    return max(rel), ties


def passq_check(c, model, name, prompt_len, n_new, results, kill=None):
    import kvring.hf as khf
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, model.config.vocab_size, (1, prompt_len), generator=g).cuda()
    ref_tokens, ref_logits = greedy(model, ids, n_new)
    sess = khf.PassQSession(c, model, [f"{name}-gen-{prompt_len}"])
    try:
        return _passq_run(c, model, name, prompt_len, n_new, results, kill, ids, ref_tokens, ref_logits, sess)
    finally:
        sess.detach()


def _passq_run(c, model, name, prompt_len, n_new, results, kill, ids, ref_tokens, ref_logits, sess):
    import kvring.hf as khf
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    killer = None
    if kill is not None:
        # Kill a shard once the prefill and some decode steps went through.
        def kill_later():
            while sess.steps < kill[1]:
                time.sleep(0.001)
            kill[0]()
        killer = threading.Thread(target=kill_later, daemon=True)
        killer.start()
    tokens, logits = greedy(model, ids, n_new, cache=sess.cache())
    gen_s = time.time() - t0
    if killer:
        killer.join(timeout=1)
    sess.detach()
    with khf.PassQSession(c, model, [f"{name}-tf-{prompt_len}"]) as sess_tf:
        tf = teacher_forced(model, ids, ref_tokens, sess_tf.cache())
    max_rel, ties = compare_logits(ref_logits, tf)
    floor = eager_floor(model, ids, ref_tokens, ref_logits)
    tol = max(TOL, PEER_FACTOR * floor)
    _, ties = compare_logits(ref_logits, tf, tol)
    same = tokens == ref_tokens
    first_diff = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
    r = {"model": name, "prompt": prompt_len, "new_tokens": n_new, "same_tokens": same, "first_difference": first_diff,
         "teacher_forced_max_rel_logit_diff": max_rel, "eager_vs_sdpa_max_rel_logit_diff": floor, "tolerance": tol,
         "tie_steps": ties, "generate_s": gen_s,
         "attend_steps": sess.steps, "bytes_sent": sess.bytes_sent, "bytes_received": sess.bytes_received,
         "killed_a_shard": kill is not None}
    ok = same or (first_diff is not None and first_diff in ties)
    r["ok"] = ok and max_rel < tol
    results.setdefault("passq", []).append(r)
    log(f"  pass-Q {name} {prompt_len} + {n_new}{' (a shard killed mid-generation)' if kill else ''}: "
        f"tokens {'equal' if same else f'differ from step {first_diff}'} to sdpa; teacher-forced logits max rel diff "
        f"{max_rel:.2e} (eager vs sdpa {floor:.2e}; tolerance {tol:.2e}); tie steps {ties[:8]}{'...' if len(ties) > 8 else ''}; {sess.steps} attend calls, "
        f"{sess.bytes_sent / 1e6:.1f} MB sent  {'OK' if r['ok'] else 'FAIL'}")
    return r["ok"]


def prefix_check(c, model, name, prefix_len, results, evict=False):
    import kvring.hf as khf
    g = torch.Generator().manual_seed(23 + prefix_len)
    prefix = torch.randint(1, model.config.vocab_size, (1, prefix_len), generator=g)
    req1 = torch.cat([prefix, torch.randint(1, model.config.vocab_size, (1, 200), generator=g)], 1).cuda()
    req2 = torch.cat([prefix, torch.randint(1, model.config.vocab_size, (1, 300), generator=g)], 1).cuda()
    pc = khf.PrefixCache(c, model, f"{name}-rand")
    pc.generate(req1, max_new_tokens=8, do_sample=False, pad_token_id=0)
    if evict:
        # Blocks evicted between the lookup and the load: the lookup claims
        # 20 blocks beyond what is held (a FaultyClient-style wrapper).
        real = c.lookup
        c.lookup = lambda keys: min(len(keys), real(keys) + 20)
    try:
        out, info = pc.generate(req2, max_new_tokens=16, do_sample=False, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
    finally:
        if evict:
            del c.lookup
    tokens = out.sequences[0, req2.shape[1]:].tolist()
    ref_tokens, ref_logits = greedy(model, req2, 16)
    got_logits = torch.stack([x[0].float() for x in out.logits])
    same = tokens == ref_tokens
    first_diff = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
    # Logits are comparable up to the first differing token (the inputs are the same until then).
    n = min(len(got_logits), len(ref_logits), len(tokens) if first_diff is None else first_diff + 1)
    floor = eager_floor(model, req2, ref_tokens, ref_logits)
    tol = max(TOL, PEER_FACTOR * floor)
    max_rel, ties = compare_logits(ref_logits[:n], got_logits[:n], tol)
    r = {"model": name, "prefix": prefix_len, "held_blocks": info["held_blocks"], "same_tokens": same,
         "first_difference": first_diff, "max_rel_logit_diff": max_rel, "eager_vs_sdpa_max_rel_logit_diff": floor,
         "tolerance": tol, "tie_steps": ties, "evicted": evict}
    r["ok"] = (same or (first_diff is not None and first_diff in ties)) and info["held_blocks"] > 0 and max_rel < tol
    results.setdefault("prefix", []).append(r)
    log(f"  prefix cache {name}, {prefix_len}-token prefix{' (20 blocks evicted before the load)' if evict else ''}: "
        f"{info['held_blocks']} blocks loaded; tokens {'equal' if same else f'differ from step {first_diff}'} to recompute; "
        f"logits max rel diff {max_rel:.2e} (eager vs sdpa {floor:.2e}; tolerance {tol:.2e})  {'OK' if r['ok'] else 'FAIL'}")
    return r["ok"]


def ttft(c, model, name, lens, results):
    import kvring.hf as khf
    rows = []
    for n in lens:
        g = torch.Generator().manual_seed(101 + n)
        prefix = torch.randint(1, model.config.vocab_size, (1, n), generator=g)
        warm = torch.cat([prefix, torch.randint(1, model.config.vocab_size, (1, 64), generator=g)], 1).cuda()
        req = torch.cat([prefix, torch.randint(1, model.config.vocab_size, (1, 64), generator=g)], 1).cuda()
        pc = khf.PrefixCache(c, model, f"{name}-ttft")
        pc.generate(warm, max_new_tokens=1, do_sample=False, pad_token_id=0)  # stores the prefix
        hit = rec = float("inf")
        info = None
        for _ in range(2):  # the first of each also warms its kernels up
            torch.cuda.synchronize()
            t0 = time.time()
            _, got = pc.generate(req, max_new_tokens=1, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            if time.time() - t0 < hit:
                hit, info = time.time() - t0, got
            t0 = time.time()
            model.generate(req, max_new_tokens=1, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            rec = min(rec, time.time() - t0)
        kv_bytes = info["held_blocks"] * pc.layout.bytes
        rows.append({"prefix": n, "ttft_hit_s": hit, "ttft_recompute_s": rec, "load_s": info["load_s"],
                     "load_split_s": info.get("load_split_s", {}), "generate_s": info["generate_s"],
                     "save_s": info["save_s"], "loaded_bytes": kv_bytes, "speedup": rec / hit})
        split = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in info.get("load_split_s", {}).items())
        log(f"  TTFT {name}, {n // 1024}K prefix: kvring hit {hit * 1e3:.0f} ms (load {info['load_s'] * 1e3:.0f} ms"
            f"{' = ' + split if split else ''}, {kv_bytes / 1e9:.2f} GB; generate {info['generate_s'] * 1e3:.0f} ms; "
            f"save {info['save_s'] * 1e3:.0f} ms) vs recompute {rec * 1e3:.0f} ms: {rec / hit:.1f}x")
        torch.cuda.empty_cache()
    results["ttft"] = rows


def decode_rate(c, model, name, prompt_len, n_new, shards_label, results):
    import kvring.hf as khf
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, model.config.vocab_size, (1, prompt_len), generator=g).cuda()

    def timed(make_cache):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.time()
        model.generate(ids, max_new_tokens=1, do_sample=False, past_key_values=make_cache(), pad_token_id=0)
        torch.cuda.synchronize()
        prefill = time.time() - t0
        t0 = time.time()
        model.generate(ids, max_new_tokens=n_new, do_sample=False, past_key_values=make_cache(), pad_token_id=0)
        torch.cuda.synchronize()
        total = time.time() - t0
        return (n_new - 1) / max(1e-9, total - prefill), torch.cuda.max_memory_allocated() - base

    from transformers import DynamicCache
    local_tps, local_mem = timed(lambda: DynamicCache())
    k = [0]

    def passq_cache():
        k[0] += 1
        return khf.PassQSession(c, model, [f"{name}-rate-{shards_label}-{k[0]}"]).cache()

    try:
        kv_tps, kv_mem = timed(passq_cache)
    finally:
        for _, m in khf._attention_modules(model):
            m.__dict__.pop("kvring_session", None)
        khf._set_attention(model, "sdpa")
    r = {"model": name, "prompt": prompt_len, "shards": shards_label, "passq_tokens_per_s": kv_tps,
         "sdpa_tokens_per_s": local_tps, "engine_peak_extra_bytes_passq": kv_mem, "engine_peak_extra_bytes_sdpa": local_mem}
    results.setdefault("decode", []).append(r)
    log(f"  decode {name}, {prompt_len // 1024}K prompt, {shards_label} shard(s): pass-Q {kv_tps:.1f} tok/s vs local sdpa "
        f"{local_tps:.1f} tok/s; engine peak GPU memory above the weights: pass-Q {kv_mem / 1e9:.2f} GB, "
        f"sdpa {local_mem / 1e9:.2f} GB")


class Sections:
    """Runs the named parts of a benchmark: an exception is recorded under results["errors"] (and the run goes
    on), a part returning False fails the run, and the results are saved to `path` after every part."""

    def __init__(self, results, path):
        self.results, self.path, self.ok = results, Path(path), True

    def save(self):
        self.path.write_text(json.dumps(self.results, indent=1, default=str))

    def __call__(self, name, f):
        t0 = time.time()
        try:
            self.ok &= f() is not False
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            self.results.setdefault("errors", {})[name] = repr(e)
            self.ok = False
        log(f"   ({name}: {time.time() - t0:.0f} s)")
        self.save()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin", default=str(ROOT / ".gpu"))
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="checks,heldout,figures",
                   help="comma-separated: checks (= passq,prefix,evicted,kill), heldout, figures (= ttft,decode), "
                        "or any of those parts")
    p.add_argument("--detach", action="store_true",
                   help="clients with detach_device_steps=True (decode steps do not wait for the nodes' replies); "
                        "the kill check is left out: a detached step that fails is not retried on another replica")
    args = p.parse_args()
    import kvring
    from kvring.local_cluster import LocalCluster, start_mps
    log("[mps] " + start_mps(ROOT))  # before this process's first CUDA call (the default deployment: docs/MPS.md)
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0)}
    import transformers
    results["transformers"] = transformers.__version__
    results["torch"] = torch.__version__
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    page = str(2 << 20)  # one 16-token block of all 32 layers (8B); the 40-layer shape's blocks are 2.5 MiB
    parts = set(args.only.split(","))
    if "checks" in parts:
        parts |= {"passq", "prefix", "evicted", "kill"}
    if "figures" in parts:
        parts |= {"ttft", "decode"}
    copts = {"detach_device_steps": True} if args.detach else {}
    if args.detach and "kill" in parts:
        parts.discard("kill")
        log("(--detach: the kill check left out)")

    section = Sections(results, out / "hf_e2e.json")

    if parts & {"passq", "prefix", "evicted", "kill", "ttft", "decode"}:
        log("== Llama-3-8B shapes (random weights)")
        model = build_model(32, 32, 8, 4096, 14336, seed=1)
        # The checks hold at most an 8K prefix at R=2 (~2 GB over the 4 daemons): 6 GB of HBM each leaves room
        # for the engine's model and logits on an 80 GB card.
        with LocalCluster(nodes=4, port=8200, replication=2, write_quorum=1, host_bytes="12G", page_bytes=page, gpu=0,
                          hbm_bytes="6G", chunk_blocks=256, bin=args.bin, root=ROOT) if parts & {
                              "passq", "prefix", "evicted", "kill"} else contextlib.nullcontext() as cl:
            c = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=60, **copts) if cl else None
            if "passq" in parts:
                section("passq-8b", lambda: passq_check(c, model, "llama3-8b", 4096, 32, results))
            if "prefix" in parts:
                section("prefix-8b", lambda: prefix_check(c, model, "llama3-8b", 8192, results))
            if "evicted" in parts:
                section("evicted-8b", lambda: prefix_check(c, model, "llama3-8b", 4096, results, evict=True))
            if "kill" in parts:
                section("kill-8b", lambda: passq_check(c, model, "llama3-8b", 1024, 32, results,
                                                       kill=(lambda: cl.kill9(1), 32 + 10 * 32)))
            if c:
                c.close()
        if "ttft" in parts or "decode" in parts:
            with LocalCluster(nodes=4, port=8300, replication=1, host_bytes="12G", page_bytes=page, gpu=0,
                              hbm_bytes="6G", chunk_blocks=256, bin=args.bin, root=ROOT) as cl:
                c = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=120, **copts)
                lens = [8192, 32768] + ([] if args.quick else [131072])
                if "ttft" in parts:
                    section("ttft", lambda: ttft(c, model, "llama3-8b", lens, results))
                if "decode" in parts:
                    section("decode-4", lambda: decode_rate(c, model, "llama3-8b", 16384 if args.quick else 32768, 48, 4, results))
                c.close()
        if "decode" in parts:
            with LocalCluster(nodes=1, port=8400, replication=1, host_bytes="12G", page_bytes=page, gpu=0,
                              hbm_bytes="12G", bin=args.bin, root=ROOT) as cl:
                c = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=120, **copts)
                section("decode-1", lambda: decode_rate(c, model, "llama3-8b", 16384 if args.quick else 32768, 48, 1, results))
                c.close()
        del model
        torch.cuda.empty_cache()
    if "heldout" in parts:
        log("== held-out shape: 40 layers, 40 q / 8 kv heads, head_dim 128 (random weights)")
        model = build_model(40, 40, 8, 5120, 13824, seed=2)
        page40 = str(40 * 2 * 8 * 16 * 128 * 2)
        # (an 8K prefix of 2.5 MiB blocks is 1.3 GB: 4 GB of HBM a daemon leaves the 40-layer model and its
        # eager reference room on an 80 GB card)
        with LocalCluster(nodes=4, port=8500, replication=1, host_bytes="8G", page_bytes=page40, gpu=0, hbm_bytes="4G",
                          chunk_blocks=256, bin=args.bin, root=ROOT) as cl:
            c = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=60, **copts)
            section("passq-heldout", lambda: passq_check(c, model, "heldout-40x40", 4096, 32, results))
            section("prefix-heldout", lambda: prefix_check(c, model, "heldout-40x40", 8192, results))
            c.close()
        del model
        torch.cuda.empty_cache()
    log("hf_e2e: " + ("all checks passed" if section.ok else "SOME CHECKS FAILED"))
    section.save()
    sys.exit(0 if section.ok else 1)


if __name__ == "__main__":
    main()
