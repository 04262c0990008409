#!/usr/bin/env python3
"""Speculative decoding on pass-Q: transformers' assisted generation (a small
draft model proposes tokens, the target verifies them and rejects some) with
the target's attention on kvring GPU daemons.

  python3 bench/gpu/hf_spec.py --bin .gpu [--new 48]

Each rejected draft is rolled back on kvring: transformers crops the target's
cache (PassQCache.crop), which truncates the session's sequence on every node
(TruncateSequence). Checks: the tokens equal the same assisted loop with
transformers' own sdpa attention (the KV in the engine), sdpa's plain greedy
decoding, and the target's plain greedy decoding on kvring; the next-token
logits through the rolled-back sequence equal a full recompute; reports the
rollbacks, the draft's acceptance and tokens/s of each loop.

Token equality needs a model whose greedy choices are decisive: with random
weights most steps are near-ties that bf16 rounding decides differently
(sdpa's assisted loop is not even equal to sdpa's greedy loop). So the
target and the draft are trained here, in seconds, on a task whose answer
needs attention over the whole context: sequences that repeat a random
32-token period, where the next token is the one 31 positions back. The
target (2 layers, 4 q / 2 kv heads, d128) trains until it is exact; the
draft (1 layer) is stopped early, at about 60% accuracy, so that rounds
accept some drafted tokens and reject others and every rollback length is
exercised. The smallest top-1 margin over the reference's steps is reported
beside the teacher-forced difference between kvring and sdpa.
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
from hf_e2e import compare_logits, greedy, log, set_attention, teacher_forced  # noqa: E402


def assisted(model, draft, ids, n, cache=None):
    t0 = time.time()
    out = model.generate(ids, max_new_tokens=n, do_sample=False, assistant_model=draft, past_key_values=cache,
                         pad_token_id=0)
    torch.cuda.synchronize()
    return out[0, ids.shape[1]:].tolist(), time.time() - t0


PERIOD = 32
VOCAB = 512


def copy_batch(batch, length, g):
    period = torch.randint(1, VOCAB, (batch, PERIOD), generator=g)
    return period.repeat(1, (length + PERIOD - 1) // PERIOD)[:, :length].cuda()


def train_copy_model(layers, seed, steps, stop_acc, length=1280, batch=16):
    """A Llama model trained on the periodic-copy task (fp32 weights, bf16 autocast), returned in bf16 for
    inference, with its last accuracy on held-out sequences."""
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=128, vocab_size=VOCAB, max_position_embeddings=8192,
                      rope_theta=10000.0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).cuda()
    set_attention(model, "sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    held = copy_batch(8, length, torch.Generator().manual_seed(seed + 1000))
    acc, loss, t0 = 0.0, float("nan"), time.time()
    for step in range(1, steps + 1):
        for grp in opt.param_groups:
            grp["lr"] = 1e-3 * min(1.0, step / 50)
        x = copy_batch(batch, length, g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x).logits
        loss = F.cross_entropy(logits[:, PERIOD - 1:-1].float().reshape(-1, VOCAB), x[:, PERIOD:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0:
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(held).logits[:, PERIOD - 1:-1].argmax(-1)
            acc = (pred == held[:, PERIOD:]).float().mean().item()
            log(f"[train] {layers} layer(s) step {step}: loss {loss.item():.4f}, held-out accuracy {acc:.4f}")
            if acc >= stop_acc:
                break
    model = model.to(torch.bfloat16).eval()
    return model, {"layers": layers, "steps": step, "loss": loss.item(), "accuracy": acc,
                   "seconds": time.time() - t0}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin", default=str(ROOT.parents[1] / ".gpu"))
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--train-steps", type=int, default=3000)
    p.add_argument("--new", type=int, default=48)
    args = p.parse_args()
    from kvring.local_cluster import start_mps
    print("[mps] " + start_mps(), flush=True)  # before this process's first CUDA call: the default deployment (docs/MPS.md)
    import kvring
    import kvring.hf as khf
    from kvring.local_cluster import LocalCluster
    target, target_train = train_copy_model(2, seed=1, steps=args.train_steps, stop_acc=1.0)
    draft, draft_train = train_copy_model(1, seed=2, steps=min(args.train_steps, 600), stop_acc=0.6)  # weak
    # Always 4 draft tokens a round (no confidence cut-off, no schedule): a round that rejects one rolls back.
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    g = torch.Generator().manual_seed(5)
    ids = copy_batch(1, args.prompt, g)
    res = {"date": time.strftime("%Y-%m-%d"), "prompt": args.prompt, "new_tokens": args.new,
           "target": target_train, "draft": draft_train}
    ref_plain, ref_logits = greedy(target, ids, args.new)
    res["sdpa_greedy_continues_the_period"] = ref_plain == copy_batch(1, args.prompt + args.new, g.manual_seed(5))[
        0, args.prompt:].tolist()
    top2 = ref_logits.topk(2, dim=-1).values
    res["min_top1_margin_rel"] = ((top2[:, 0] - top2[:, 1]) / ref_logits.abs().amax(dim=-1)).min().item()
    assisted(target, draft, ids, 4)  # warm-up (cuDNN plans)
    ref_spec, t_ref = assisted(target, draft, ids, args.new)
    res["sdpa_assisted_equals_sdpa_greedy"] = ref_spec == ref_plain
    res["sdpa_assisted_tok_s"] = args.new / t_ref
    page = str(1 << 20)
    with LocalCluster(nodes=1, port=8400, replication=1, host_bytes="8G", page_bytes=page, gpu=0, hbm_bytes="8G",
                      chunk_blocks=256, bin=args.bin, root=ROOT.parents[1]) as cl:
        c = kvring.Client(cl.coordinator, cl.tenant_token, rpc_timeout=60)
        with khf.PassQSession(c, target, ["spec-target"]) as sess:
            cache = sess.cache()
            calls = []
            hook = target.register_forward_pre_hook(lambda *_: calls.append(1))
            got, t_kv = assisted(target, draft, ids, args.new, cache=cache)
            hook.remove()
            res["kvring_assisted_tok_s"] = args.new / t_kv
            res["rollbacks"] = sess.truncations
            res["steps"] = sess.steps
            # One target forward for the prompt, then one a round; a round yields its accepted drafts + 1 token.
            res["rounds"] = len(calls) - 1
            res["draft_tokens_accepted"] = len(got) - res["rounds"]
            # After every rollback the sequence on kvring must hold exactly the accepted tokens' K/V: one more step
            # through it gives the next-token logits of a full recompute (checked below against sdpa).
            full = torch.cat([ids, torch.tensor([got], device=ids.device)], dim=1)
            held = min(sess.tokens[0])
            res["kvring_tokens_after"], res["tokens_generated_total"] = held, full.shape[1]
            if held >= full.shape[1]:  # the last round's verified tokens past max_new_tokens
                sess.truncate(full.shape[1] - 1)
                held = full.shape[1] - 1
            with torch.no_grad():
                after = target(full[:, held:], past_key_values=cache, use_cache=True).logits[0, -1].float()
        with khf.PassQSession(c, target, ["plain-target"]) as sess2:
            plain, _ = greedy(target, ids, args.new, cache=sess2.cache())
        # Teacher-forced logits through kvring against sdpa: the tolerance for near-ties.
        with khf.PassQSession(c, target, ["tf-target"]) as sess3:
            tf = teacher_forced(target, ids, ref_plain, sess3.cache())
        max_rel, ties = compare_logits(ref_logits, tf)
        c.close()
    with torch.no_grad():
        recompute = target(full).logits[0, -1].float()
    res["after_rollbacks_rel_logit_diff"] = ((after - recompute).abs().max() / recompute.abs().max()).item()
    res["kvring_assisted_equals_sdpa_assisted"] = got == ref_spec
    res["kvring_assisted_equals_kvring_greedy"] = got == plain
    res["kvring_greedy_equals_sdpa_greedy"] = plain == ref_plain
    res["first_difference"] = next((i for i, (a, b) in enumerate(zip(got, ref_spec)) if a != b), None)
    res["teacher_forced_max_rel_logit_diff"] = max_rel
    res["tie_steps"] = ties
    # The target is decisive (every step's top-1 margin far above the teacher-forced difference, no tie steps):
    # the tokens must be equal, and the K/V left on kvring after the rollbacks must give a full recompute's logits.
    ok = (res["rollbacks"] > 0 and res["after_rollbacks_rel_logit_diff"] < 5e-2 and not ties and
          got == ref_spec and ref_spec == ref_plain and plain == ref_plain)
    res["ok"] = ok
    log(json.dumps(res, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "hf_spec.json").write_text(json.dumps(res, indent=1))
    log("hf_spec: " + ("passed" if ok else "FAILED"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
