"""End to end through a real 4-node cluster (processes on loopback): the
reference engine's next-token logits with attention through kvring equal
those with a local KV cache.

  - pass-Q: prefill, then decode, with the sequence's KV in the cluster and
    only queries and partials on the wire;
  - prefix reuse: a second request with the same prompt loads the cached
    prefix (hash-placed blocks) and prefills only the rest;
  - pass-Q prefill of a new chunk over a stored prefix.
"""
import os
import unittest

import numpy as np

import kvring
from kvring import connector, engine
from kvring.local_cluster import LocalCluster

PORT = int(os.environ.get("KVRING_TEST_PORT", "17600"))


class EngineEndToEnd(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = LocalCluster(nodes=4, port=PORT, replication=1).start()
        cls.client = kvring.Client(cls.cluster.coordinator, cls.cluster.tenant_token)
        cls.cfg = engine.Config()
        cls.model = engine.Model(cls.cfg, seed=7)
        c = cls.cfg
        cls.layout = kvring.Layout(c.block_tokens, c.layers, c.kv_heads, c.head_dim, "f16")
        cls.rng = np.random.default_rng(3)

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()

    def assertLogitsClose(self, got, want):
        err = np.max(np.abs(got - want)) / np.max(np.abs(want))
        self.assertLess(err, 1e-4, f"max relative logit error {err}")

    def test_pass_q_decode_equals_local_attention(self):
        prompt = self.rng.integers(0, self.cfg.vocab, 203)  # 12 full blocks + 11 tokens
        want_tokens, want = engine.greedy(self.model, prompt, 24, engine.LocalAttention(self.cfg))
        s = connector.TailPassQ(self.client, self.layout, "e2e-passq")
        got_tokens, got = engine.greedy(self.model, prompt, 24, s)
        self.assertEqual(got_tokens, want_tokens)
        self.assertLogitsClose(got, want)
        self.assertEqual(s.stored_blocks, (203 + 24) // 16)
        self.assertGreater(s.attend_calls, 0)
        # The KV really lives in the cluster: the blocks are spread over the shards.
        held = [n["sequences"] for n in self.client.stats() if n["ok"]]
        self.assertGreaterEqual(sum(1 for h in held if h > 0), 1)
        # Pass-Q moved far fewer bytes than pulling the KV at every step would.
        self.assertLess(s.bytes_sent + s.bytes_received, 24 * s.pull_bytes_per_step())

    def test_prefix_reuse_loads_cached_blocks_and_gives_the_same_logits(self):
        system = self.rng.integers(0, self.cfg.vocab, 160)  # 10 blocks, shared
        conn = connector.Connector(self.client, "tiny-e2e", self.layout)
        first = np.concatenate([system, self.rng.integers(0, self.cfg.vocab, 37)])
        local = engine.LocalAttention(self.cfg)
        self.model.forward(first, 0, local)
        self.assertEqual(conn.lookup(first), 0)
        self.assertEqual(conn.save(first, local.k, local.v), len(first) // 16)
        second = np.concatenate([system, self.rng.integers(0, self.cfg.vocab, 50)])
        hit = conn.lookup(second)
        self.assertEqual(hit, 160)
        k, v = conn.load(second, hit)
        cached = engine.LocalAttention(self.cfg)
        cached.k, cached.v = k, v
        got = self.model.forward(second[hit:], hit, cached)[-1]
        want = self.model.forward(second, 0, engine.LocalAttention(self.cfg))[-1]
        self.assertLogitsClose(got, want)

    def test_pass_q_prefill_of_a_new_chunk_over_a_stored_prefix(self):
        prompt = self.rng.integers(0, self.cfg.vocab, 300)
        s = connector.TailPassQ(self.client, self.layout, "e2e-chunked")
        self.model.forward(prompt[:256], 0, s)   # 16 blocks stored
        self.assertEqual(s.stored_blocks, 16)
        got = self.model.forward(prompt[256:], 256, s)  # 44 queries shipped per layer
        want = self.model.forward(prompt, 0, engine.LocalAttention(self.cfg))[256:]
        self.assertLogitsClose(got, want)

    def test_errors_are_typed_exceptions(self):
        with self.assertRaises(kvring.UnauthenticatedError):
            kvring.Client(self.cluster.coordinator, "not-a-token-of-anyone")
        with self.assertRaises(kvring.InvalidArgumentError):
            self.client.put(np.zeros((2, 2), np.uint64) + 1, np.zeros(10, np.uint8), self.layout)
        with self.assertRaises(kvring.NotFoundError):
            self.client.get(np.array([[5, 6]], np.uint64), self.layout)
        with self.assertRaises(kvring.NotFoundError):  # every replica says NOT_FOUND
            self.client.attend("no-such-seq", self.layout, 48, np.zeros((1, 8, 32), np.float32), np.array([100]))
        with self.assertRaises(kvring.InvalidArgumentError):
            self.client.attend("e2e-passq", self.layout, 16, np.zeros((1, 8, 31), np.float32), np.array([100]))
        # Wrong argument types say what is wrong, as kvring errors.
        ro = np.zeros(self.layout.bytes, np.uint8)
        ro.setflags(write=False)
        with self.assertRaisesRegex(kvring.InvalidArgumentError, "read-only"):
            self.client.get_into(np.array([[5, 6]], np.uint64), self.layout, ro)
        with self.assertRaisesRegex(kvring.InvalidArgumentError, "read-only"):
            self.client.get_into(np.array([[5, 6]], np.uint64), self.layout, bytes(self.layout.bytes))
        with self.assertRaisesRegex(kvring.InvalidArgumentError, "parent"):
            self.client.put(np.array([[5, 6]], np.uint64), np.zeros(self.layout.bytes, np.uint8), self.layout,
                            parent=np.zeros((3, 3), np.uint64))
        with self.assertRaisesRegex(kvring.InvalidArgumentError, "keys"):
            self.client.lookup("not keys")


if __name__ == "__main__":
    unittest.main(verbosity=2)
