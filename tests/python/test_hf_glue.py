"""kvring.hf's glue without transformers (which runs on the GPU host, bench/gpu/hf_e2e.py): PassQSession's
attention over a local cluster of CPU daemons, against attention computed here in float64, through a
minimal stand-in for transformers' registries and Cache base classes. Skips without torch. Where CUDA is
present (the GPU host) it runs again on GPU daemons with CUDA tensors, which takes the session's prepared
path (kvring.torch.StepPlan), against the unprepared one and the same reference.

    python3 tests/python/test_hf_glue.py
"""
import math
import os
import sys
import types
import unittest

try:
    import torch
except ImportError:
    torch = None


def fake_transformers():
    """The pieces of transformers kvring.hf touches: AttentionInterface, AttentionMaskInterface, Cache."""
    registry = {}
    tf = types.ModuleType("transformers")
    tf.AttentionInterface = type("AttentionInterface", (), {"register": staticmethod(lambda n, f: registry.setdefault(n, f))})
    masking = types.ModuleType("transformers.masking_utils")
    masking.AttentionMaskInterface = tf.AttentionInterface
    cache_utils = types.ModuleType("transformers.cache_utils")

    class CacheLayerMixin:
        def __init__(self):
            self.keys = self.values = None
            self.is_initialized = False

    class Cache:
        def __init__(self, layers=None):
            self.layers = layers

        def update(self, k, v, layer_idx, cache_kwargs=None):
            return self.layers[layer_idx].update(k, v, cache_kwargs)

        def get_seq_length(self, layer_idx=0):
            return self.layers[layer_idx].get_seq_length()

    cache_utils.Cache, cache_utils.CacheLayerMixin = Cache, CacheLayerMixin
    tf.cache_utils, tf.masking_utils = cache_utils, masking
    sys.modules.update({"transformers": tf, "transformers.cache_utils": cache_utils, "transformers.masking_utils": masking})
    return registry


@unittest.skipIf(torch is None, "needs torch")
class HfGlueTest(unittest.TestCase):
    def test_passq_session_appends_and_attends_exactly(self):
        self._check(torch.device("cpu"), prepared=True)

    @unittest.skipIf(torch is None or not torch.cuda.is_available(), "needs CUDA")
    def test_prepared_and_unprepared_steps_on_gpu_daemons(self):
        for prepared in (True, False):
            with self.subTest(prepared=prepared):
                self._check(torch.device("cuda"), prepared=prepared)

    def _check(self, device, prepared):
        registry = fake_transformers()
        import kvring
        import kvring.hf as khf
        from kvring.local_cluster import LocalCluster

        H, HKV, D, L = 4, 2, 16, 2

        class Attn(torch.nn.Module):  # what _attention_modules looks for
            def __init__(self, i):
                super().__init__()
                self.layer_idx, self.q_proj, self.k_proj = i, torch.nn.Identity(), torch.nn.Identity()

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = torch.nn.ModuleList([Attn(i) for i in range(L)])
                self.config = types.SimpleNamespace(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=HKV,
                                                    head_dim=D, num_hidden_layers=L, _attn_implementation="sdpa")

        model = Model()
        gpu = dict(gpu=0, hbm_bytes="256M") if device.type == "cuda" else {}
        with LocalCluster(nodes=3, port=int(os.environ.get("KVRING_TEST_PORT", "17900")), replication=1, chunk_blocks=2,
                          **gpu) as cl:
            c = kvring.Client(cl.coordinator, cl.tenant_token)
            sess = khf.PassQSession(c, model, ["a", "b"], block_tokens=16, max_rows_per_step=40, prepared=prepared)
            self.assertEqual(model.config._attn_implementation, "kvring")
            fn = registry["kvring"]
            cache = sess.cache()
            g = torch.Generator().manual_seed(0)
            keys = [[[] for _ in range(L)] for _ in range(2)]
            vals = [[[] for _ in range(L)] for _ in range(2)]
            def step(T):
                for layer in range(L):
                    q = torch.randn(2, H, T, D, generator=g).to(torch.bfloat16)
                    k = torch.randn(2, HKV, T, D, generator=g).to(torch.bfloat16)
                    v = torch.randn(2, HKV, T, D, generator=g).to(torch.bfloat16)
                    kd, vd = k.to(device), v.to(device)
                    kk, vv = cache.update(kd, vd, layer)
                    self.assertIs(kk, kd)  # the cache keeps nothing
                    out, w = fn(model.layers[layer], q.to(device), kk, vv, None, scaling=1 / math.sqrt(D))
                    self.assertIsNone(w)
                    self.assertEqual(tuple(out.shape), (2, T, H, D))
                    self.assertEqual(out.dtype, q.dtype)  # the model's dtype (on CUDA: written by the merge)
                    self.assertEqual(out.device.type, device.type)
                    out = out.cpu()
                    for b in range(2):
                        keys[b][layer].append(k[b].double())
                        vals[b][layer].append(v[b].double())
                        K = torch.cat(keys[b][layer], 1)  # [HKV, S, D]
                        V = torch.cat(vals[b][layer], 1)
                        S = K.shape[1]
                        qq = q[b].double()  # [H, T, D]
                        s = torch.einsum("htd,hsd->hts", qq, K.repeat_interleave(H // HKV, 0)) / math.sqrt(D)
                        pos = torch.arange(S - T, S)
                        s.masked_fill_(torch.arange(S)[None, None, :] > pos[None, :, None], float("-inf"))
                        ref = torch.einsum("hts,hsd->thd", torch.softmax(s, -1), V.repeat_interleave(H // HKV, 0))
                        err = ((out[b].double() - ref).norm() / ref.norm()).item()
                        self.assertLess(err, 2e-2, f"T={T} layer {layer} seq {b}")

            for T in (100, 1, 1, 37, 1):  # a chunked prefill (3 steps of <= 40 rows), decode, another chunk
                step(T)
            self.assertEqual(cache.get_seq_length(0), 140)
            self.assertEqual(sess.tokens, [[140, 140]] * L)
            self.assertEqual(sess.steps, (3 + 1 + 1 + 1 + 1) * L)
            if device.type == "cuda" and prepared:  # decode steps timed at the engine
                self.assertEqual(len(sess.decode_steps), 3 * L)
                self.assertTrue(all(s[0] > 0 and s[3] > 0 for s in sess.decode_steps))
            # Rejected drafts: the cache's crop (what assisted generation calls) cuts the sequences on kvring
            # back too, and the next tokens attend over the kept ones only.
            cache.crop(120)
            self.assertEqual(cache.get_seq_length(0), 120)
            self.assertEqual(sess.tokens, [[120, 120]] * L)
            for b in range(2):
                for layer in range(L):
                    keys[b][layer] = [torch.cat(keys[b][layer], 1)[:, :120]]
                    vals[b][layer] = [torch.cat(vals[b][layer], 1)[:, :120]]
            step(3)
            self.assertEqual(sess.tokens, [[123, 123]] * L)
            # end(): detached, and the sequences are gone from kvring.
            sess.end()
            self.assertEqual(model.config._attn_implementation, "sdpa")
            self.assertEqual(c.delete_sequence("a")["nodes_holding"], 0)
            c.close()


if __name__ == "__main__":
    unittest.main()
