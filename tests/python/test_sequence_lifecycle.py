"""Sequence lifecycle on a real 4-node cluster (R=2): a sequence built by
appends is truncated (speculative decoding's rejected drafts) and appended
again with other K/V, and attends exactly like the same tokens built from
scratch; DeleteSequence gives every block back (the nodes' block and
sequence counts return to where they were) and is idempotent; another
tenant's delete of the same id touches nothing of ours; forks (and a fork of
a fork) share their source's blocks without a copy, attend exactly, are
found by a client that did not make them, and outlive their source; another
tenant cannot fork ours; deletes on one thread beside appends on others
leave the appended sequences exact; the CLI does each."""
import math
import os
import subprocess
import unittest

import numpy as np

import kvring
from kvring.local_cluster import LocalCluster

PORT = int(os.environ.get("KVRING_TEST_PORT", "22600"))
# On a GPU host: KVRING_TEST_GPU=<device> runs the daemons with --gpu (bf16 blocks, which the CUDA kernels take, so
# truncation resets HBM copies); CI runs them on the CPU with f32 blocks.
GPU = int(os.environ.get("KVRING_TEST_GPU", "-1"))
DTYPE, D = ("bf16", 64) if GPU >= 0 else ("f32", 32)
RTOL = 2e-2 if GPU >= 0 else 1e-4


def reference(q, k, v):
    """Attention of q [rows, qh, d] over k/v [t, kvh, d] (float64, no mask), and its natural-log LSE."""
    rows, qh, d = q.shape
    kvh = k.shape[1]
    out = np.zeros((rows, qh, d))
    lse = np.zeros((rows, qh))
    for r in range(rows):
        for h in range(qh):
            s = k[:, h // (qh // kvh), :].astype(np.float64) @ q[r, h].astype(np.float64) / math.sqrt(d)
            m = s.max()
            p = np.exp(s - m)
            out[r, h] = p @ v[:, h // (qh // kvh), :].astype(np.float64) / p.sum()
            lse[r, h] = m + math.log(p.sum())
    return out, lse


class SequenceLifecycle(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = LocalCluster(nodes=4, port=PORT, replication=2, chunk_blocks=2, gpu=GPU,
                                   hbm_bytes="1G" if GPU >= 0 else "0").start()
        cls.c = kvring.Client(cls.cluster.coordinator, cls.cluster.tenant_token)
        cls.L = kvring.Layout(block_tokens=16, layers=2, kv_heads=2, head_dim=D, dtype=DTYPE)
        cls.rng = np.random.default_rng(11)

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        cls.cluster.stop()

    def wire(self, x):
        """f32 values as the layout's dtype (bf16: the top 16 bits; the reference then uses the same rounding)."""
        if DTYPE == "f32":
            return x
        return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)

    def rounded(self, x):
        if DTYPE == "f32":
            return x
        return (self.wire(x).astype(np.uint32) << 16).view(np.float32)

    def append(self, sid, have, k, v):
        """Appends k/v [n, kvh, d] on every layer (no query rows)."""
        for layer in range(self.L.layers):
            self.c.step(self.L, [(sid, have, 0, k.shape[0])], np.zeros((0, 4, D), np.float32), [], self.wire(k),
                        self.wire(v), layer=layer)

    def check(self, sid, k, v):
        q32 = self.rng.standard_normal((2, 4, D)).astype(np.float32)
        t = k.shape[0]
        for layer in range(self.L.layers):
            out, lse = self.c.step(self.L, [(sid, t, 2, 0)], self.wire(q32), [t - 1, t - 1], layer=layer, causal=False)
            ro, rl = reference(self.rounded(q32), self.rounded(k), self.rounded(v))
            np.testing.assert_allclose(out, ro, rtol=RTOL, atol=RTOL / 10)
            np.testing.assert_allclose(lse, rl, rtol=RTOL, atol=RTOL)

    def counts(self):
        st = self.c.stats()
        return sum(s["blocks"] for s in st), sum(s["sequences"] for s in st), sum(s["open_blocks"] for s in st)

    def test_truncate_and_reappend_is_exact_and_delete_gives_everything_back(self):
        base = self.counts()
        rnd = lambda n: self.rng.standard_normal((n, 2, D)).astype(np.float32)  # noqa: E731
        k, v = rnd(150), rnd(150)  # 9 full blocks + 6 tokens, over several chunks and nodes
        self.append("spec", 0, k, v)
        self.check("spec", k, v)
        # Drafts rejected: back to 133 (inside a sealed block), then other tokens.
        self.c.truncate_sequence("spec", 133)
        k2, v2 = rnd(20), rnd(20)
        self.append("spec", 133, k2, v2)
        K, V = np.concatenate([k[:133], k2]), np.concatenate([v[:133], v2])
        self.check("spec", K, V)
        # Back to a block boundary, and to a length past the end (no change).
        self.c.truncate_sequence("spec", 96)
        self.c.truncate_sequence("spec", 10_000)
        k3, v3 = rnd(7), rnd(7)
        self.append("spec", 96, k3, v3)
        self.check("spec", np.concatenate([K[:96], k3]), np.concatenate([V[:96], v3]))
        # Another tenant's delete of the same id is its own namespace's: ours stays.
        tok = kvring.create_tenant(self.cluster.coordinator, self.cluster.admin_token, "other")
        import time
        time.sleep(1.0)
        other = kvring.Client(self.cluster.coordinator, tok)
        self.assertEqual(other.delete_sequence("spec")["nodes_holding"], 0)
        other.close()
        self.check("spec", np.concatenate([K[:96], k3]), np.concatenate([V[:96], v3]))
        # Delete: every node's blocks, sequences and open blocks back where they were.
        r = self.c.delete_sequence("spec")
        self.assertGreaterEqual(r["nodes_holding"], 2)
        self.assertGreater(r["blocks_erased"], 0)
        self.assertEqual(self.counts(), base)
        mine = self.c.stats()  # the tenant's own view: nothing of it left on any node
        self.assertEqual(sum(s["tenant_sequences"] for s in mine), 0)
        self.assertEqual(sum(s["tenant_open_bytes"] for s in mine), 0)
        self.assertEqual(self.c.delete_sequence("spec")["nodes_holding"], 0)  # idempotent
        with self.assertRaises(kvring.NotFoundError):
            self.c.attend("spec", self.L, 16, np.zeros((1, 4, D), np.float32), [15])

    def test_a_sequence_starts_from_the_prefix_cache_and_attends_like_the_chain(self):
        n = 7  # blocks of the stored prompt: over several chunks (2 blocks) and nodes
        tokens = self.rng.integers(1, 50000, n * 16).tolist()
        keys = self.c.chain("prefix-model", self.L, tokens)
        k = self.rng.standard_normal((n * 16, 2, D)).astype(np.float32)
        v = self.rng.standard_normal((n * 16, 2, D)).astype(np.float32)
        blocks = np.zeros((n,) + self.L.block_shape, np.float32)
        for layer in range(self.L.layers):  # every layer the same K/V (check() compares each with one reference)
            blocks[:, layer, 0] = k.reshape(n, 16, 2, D).transpose(0, 2, 1, 3)
            blocks[:, layer, 1] = v.reshape(n, 16, 2, D).transpose(0, 2, 1, 3)
        self.c.put(keys, self.wire(blocks), self.L)
        r = self.c.start_sequence_from_prefix("pfx", keys, self.L)
        self.assertEqual((r["blocks"], r["tokens"]), (n, n * 16))
        self.assertEqual(r["blocks_shared"] + r["blocks_copied"], 2 * n)  # R=2 replicas of each block
        self.check("pfx", k, v)
        # It goes on like any sequence: appends after the prompt, then attends over both.
        ak, av = (self.rng.standard_normal((5, 2, D)).astype(np.float32) for _ in range(2))
        self.append("pfx", n * 16, ak, av)
        self.check("pfx", np.concatenate([k, ak]), np.concatenate([v, av]))
        with self.assertRaises(kvring.AlreadyExistsError):
            self.c.start_sequence_from_prefix("pfx", keys, self.L)
        # A chain the cache does not hold starts nothing.
        other = self.c.chain("another-model", self.L, tokens)
        self.assertEqual(self.c.start_sequence_from_prefix("none", other, self.L)["tokens"], 0)
        # Its end leaves the prefix cache whole.
        self.c.delete_sequence("pfx")
        self.assertEqual(self.c.lookup(keys), n)

    def test_forks_share_blocks_attend_exactly_and_outlive_their_source(self):
        base = self.counts()
        rnd = lambda n: self.rng.standard_normal((n, 2, D)).astype(np.float32)  # noqa: E731
        k, v = rnd(150), rnd(150)  # 9 full blocks + 6 tokens; chunks of 2 blocks (32 tokens): 5 chunks
        self.append("ctx", 0, k, v)
        blocks = self.counts()[0]
        # At 100 (block 6, sealed, keeps 4 tokens): chunks 0-3 placed with the source's; 6 full blocks shared
        # and block 6 copied, on each of R=2 replicas; no new store block.
        r = self.c.fork_sequence("ctx", "f1", 100)
        self.assertEqual(r, {"nodes_holding": r["nodes_holding"], "blocks_shared": 12, "blocks_copied": 2,
                             "shared_chunks": 4})
        self.assertEqual(self.counts()[0], blocks)
        self.check("f1", k[:100], v[:100])
        # Each side appends its own tokens; neither changes the other.
        fk, fv = rnd(50), rnd(50)
        self.append("f1", 100, fk, fv)
        ck, cv = rnd(20), rnd(20)
        self.append("ctx", 150, ck, cv)
        F1k, F1v = np.concatenate([k[:100], fk]), np.concatenate([v[:100], fv])
        self.check("f1", F1k, F1v)
        self.check("ctx", np.concatenate([k, ck]), np.concatenate([v, cv]))
        # A fork of the fork, past its fork point: chunks 0-3 with ctx's, chunk 4 with f1's.
        self.assertEqual(self.c.fork_sequence("f1", "f2", 140)["shared_chunks"], 5)
        gk, gv = rnd(9), rnd(9)
        self.append("f2", 140, gk, gv)
        self.check("f2", np.concatenate([F1k[:140], gk]), np.concatenate([F1v[:140], gv]))
        # A client that did not make the forks finds them (the nodes tell it, it resolves their placement).
        other = kvring.Client(self.cluster.coordinator, self.cluster.tenant_token)
        q = self.wire(self.rng.standard_normal((1, 4, D)).astype(np.float32))
        out, _ = other.step(self.L, [("f2", 149, 1, 0)], q, [148], layer=1, causal=False)
        mine, _ = self.c.step(self.L, [("f2", 149, 1, 0)], q, [148], layer=1, causal=False)
        np.testing.assert_array_equal(out, mine)
        other.close()
        listed = {s["sequence_id"]: s for s in self.c.list_sequences()}
        self.assertTrue(listed["f1"]["forked"] and listed["f2"]["forked"] and not listed["ctx"]["forked"])
        self.assertGreater(listed["ctx"]["shared_blocks"], 0)
        self.assertEqual(listed["ctx"]["host_blocks"] + listed["ctx"]["cold_blocks"], listed["ctx"]["full_blocks"])
        # Refusals: unknown source, past its length, onto an existing id, onto itself.
        with self.assertRaises(kvring.NotFoundError):
            self.c.fork_sequence("nope", "x", 10)
        with self.assertRaises(kvring.FailedPreconditionError):
            self.c.fork_sequence("ctx", "x", 171)
        with self.assertRaises(kvring.AlreadyExistsError):
            self.c.fork_sequence("ctx", "f1", 64)
        with self.assertRaises(kvring.InvalidArgumentError):
            self.c.fork_sequence("ctx", "ctx", 64)
        self.assertNotIn("x", {s["sequence_id"] for s in self.c.list_sequences()})
        # The source ends: the forks keep their bytes; then everything goes.
        self.c.delete_sequence("ctx")
        self.check("f1", F1k, F1v)
        self.check("f2", np.concatenate([F1k[:140], gk]), np.concatenate([F1v[:140], gv]))
        for sid in ("f1", "f2"):
            self.c.delete_sequence(sid)
        self.assertEqual(self.counts(), base)
        # The CLI forks too.
        self.append("cli-src", 0, k[:40], v[:40])
        cli = [str(self.cluster.bin / "clients/kvring"), "--coordinator=" + self.cluster.coordinator,
               "--token=" + self.cluster.tenant_token]
        r = subprocess.run(cli + ["--source=cli-src", "--sequence=cli-fork", "--keep_tokens=33", "seq-fork"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("forked 'cli-fork'", r.stdout)
        self.check("cli-fork", k[:33], v[:33])
        r = subprocess.run(cli + ["seq-fork", "--sequence=y"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--source", r.stderr)
        for sid in ("cli-src", "cli-fork"):
            self.c.delete_sequence(sid)
        self.assertEqual(self.counts(), base)

    def test_another_tenant_cannot_fork_ours_and_deletes_beside_appends_leave_the_rest_exact(self):
        base = self.counts()
        rnd = lambda n: self.rng.standard_normal((n, 2, D)).astype(np.float32)  # noqa: E731
        k, v = rnd(70), rnd(70)
        self.append("own", 0, k, v)
        held = self.counts()
        # Another tenant names our sequence: its namespace has no such source, so the fork is refused and
        # nothing of ours (or of its) is made or changed.
        tok = kvring.create_tenant(self.cluster.coordinator, self.cluster.admin_token, "forker")
        import time
        time.sleep(1.0)
        other = kvring.Client(self.cluster.coordinator, tok)
        with self.assertRaises(kvring.NotFoundError):
            other.fork_sequence("own", "stolen", 32)
        self.assertEqual(other.list_sequences(), [])
        other.close()
        self.assertEqual(self.counts(), held)
        self.assertNotIn("stolen", {s["sequence_id"] for s in self.c.list_sequences()})
        self.check("own", k, v)
        # Engines on other threads, each with its own client: four append token by token while four other
        # sequences are deleted under them. The deleted ones are gone, the appended ones attend exactly.
        import threading
        kept = {f"a{i}": (rnd(20), rnd(20)) for i in range(4)}
        doomed = [f"d{i}" for i in range(4)]
        for sid in doomed:
            self.append(sid, 0, rnd(40), rnd(40))
        errors = []

        def appender(sid, kk, vv):
            c = kvring.Client(self.cluster.coordinator, self.cluster.tenant_token)
            try:
                for t in range(kk.shape[0]):
                    for layer in range(self.L.layers):
                        c.step(self.L, [(sid, t, 0, 1)], np.zeros((0, 4, D), np.float32), [], self.wire(kk[t:t + 1]),
                               self.wire(vv[t:t + 1]), layer=layer)
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(f"{sid}: {e}")
            finally:
                c.close()

        def deleter():
            c = kvring.Client(self.cluster.coordinator, self.cluster.tenant_token)
            try:
                for sid in doomed:
                    c.delete_sequence(sid)
            except Exception as e:  # noqa: BLE001
                errors.append(f"delete: {e}")
            finally:
                c.close()

        threads = [threading.Thread(target=appender, args=(sid, *kv)) for sid, kv in kept.items()]
        threads.append(threading.Thread(target=deleter))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        listed = {s["sequence_id"] for s in self.c.list_sequences()}
        self.assertFalse(listed & set(doomed))
        for sid, (kk, vv) in kept.items():
            self.check(sid, kk, vv)
        for sid in list(kept) + ["own"]:
            self.c.delete_sequence(sid)
        self.assertEqual(self.counts(), base)

    def test_idle_sequences_expire_after_the_tenants_ttl(self):
        import time
        tok = kvring.create_tenant(self.cluster.coordinator, self.cluster.admin_token, "short-lived", sequence_ttl_s=1)
        time.sleep(1.0)  # the daemons learn the tenant at their next heartbeat
        c = kvring.Client(self.cluster.coordinator, tok)
        held = lambda: sum(s["sequences"] for s in c.stats())  # noqa: E731 (Stats names no sequence: no renewal)
        base = held()
        k = self.rng.standard_normal((40, 2, D)).astype(np.float32)
        for layer in range(self.L.layers):
            c.step(self.L, [("idle", 0, 0, 40)], np.zeros((0, 4, D), np.float32), [], self.wire(k), self.wire(k),
                   layer=layer)
        self.assertGreater(held(), base)
        t0 = time.time()
        while time.time() - t0 < 20 and held() > base:
            time.sleep(0.25)
        self.assertEqual(held(), base, "the idle sequence was not expired within 20 s")
        with self.assertRaises(kvring.NotFoundError):
            c.attend("idle", self.L, 40, self.wire(self.rng.standard_normal((1, 4, D)).astype(np.float32)), [39])
        c.close()

    def test_the_cli_deletes_and_truncates(self):
        k = self.rng.standard_normal((40, 2, D)).astype(np.float32)
        self.append("cli-seq", 0, k, k)
        cli = [str(self.cluster.bin / "clients/kvring"), "--coordinator=" + self.cluster.coordinator,
               "--token=" + self.cluster.tenant_token]
        r = subprocess.run(cli + ["--sequence=cli-seq", "--keep_tokens=20", "seq-truncate"], capture_output=True,
                           text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("truncated 'cli-seq'", r.stdout)
        self.check("cli-seq", k[:20], k[:20])
        r = subprocess.run(cli + ["seq-list"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        row = [line.split() for line in r.stdout.splitlines() if line.startswith("cli-seq ")]
        self.assertEqual(len(row), 1, r.stdout)
        self.assertEqual(int(row[0][1]), 20, r.stdout)  # tokens after the truncate
        self.assertGreaterEqual(int(row[0][2]), 2, r.stdout)  # R=2
        r = subprocess.run(cli + ["--sequence=cli-seq", "seq-delete"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("deleted 'cli-seq'", r.stdout)
        r = subprocess.run(cli + ["seq-list"], capture_output=True, text=True)
        self.assertNotIn("cli-seq ", r.stdout)
        r = subprocess.run(cli + ["seq-truncate", "--sequence=x"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("keep_tokens", r.stderr)


if __name__ == "__main__":
    unittest.main()
