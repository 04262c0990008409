"""The Python API driven with wrong types, shapes, ranges, NUL characters and
a closed client, against a real cluster: every call raises a kvring.Error
(never a bare Python exception, never a crash), and a sequence that was fed
bad K/V is still served exactly afterwards (nothing was appended)."""
import math
import os
import unittest

import numpy as np

import kvring
from kvring.local_cluster import LocalCluster

PORT = int(os.environ.get("KVRING_TEST_PORT", "21600"))


class ApiFuzz(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = LocalCluster(nodes=2, port=PORT, replication=2).start()
        cls.tok = cls.cluster.tenant_token
        cls.c = kvring.Client(cls.cluster.coordinator, cls.tok)
        cls.L = kvring.Layout(block_tokens=16, layers=2, kv_heads=2, head_dim=64, dtype="f16")

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        cls.cluster.stop()

    def assertKvringError(self, f, cls=kvring.Error):
        try:
            f()
        except cls:
            return
        except kvring.Error as e:
            self.fail("%s instead of %s" % (type(e).__name__, cls.__name__))
        except BaseException as e:  # noqa: BLE001 (the point of the test)
            self.fail("bare %s: %s" % (type(e).__name__, e))
        self.fail("no error")

    def test_every_bad_argument_is_a_kvring_error(self):
        c, L, tok, co = self.c, self.L, self.tok, self.cluster.coordinator
        q = np.zeros((1, 4, 64), np.float16)
        kv = np.zeros((1, 2, 64), np.float16)
        inv = kvring.InvalidArgumentError
        cases = [
            lambda: kvring.Client(None, tok),
            lambda: kvring.Client(co, tok, rpc_timeout=float("nan")),
            lambda: kvring.Client(co, tok, rpc_timeout=-1),
            lambda: kvring.Client(co, tok, rpc_timeout=0),
            lambda: kvring.Client(co, tok, threads=-1),
            lambda: kvring.Client(co, tok, threads=2 ** 40),
            lambda: kvring.Client(co, tok, ucx_spin_us=2 ** 40),
            lambda: kvring.Client(co, tok, ucx_spin_max_us=2 ** 40),
            lambda: kvring.Client(co, tok, ucx_spin_max_us=-2),
            lambda: kvring.Client(co, tok, node_reply_when_queued="yes"),
            lambda: kvring.Client(co, tok, detach_device_steps="yes"),
            lambda: kvring.Client(co, tok + "\0junk"),
            lambda: kvring.Layout(dtype=["bf16"]),
            lambda: kvring.Layout(head_dim="64"),
            lambda: c.chain(123, L, [1, 2]),
            lambda: c.chain("m\0x", L, [1] * 16),
            lambda: c.chain("m", L, [-1] * 16),
            lambda: c.chain("m", L, [2 ** 33] * 16),
            lambda: c.chain("m", "not a layout", [1] * 16),
            lambda: c.chain("m", L, "tokens"),
            lambda: c.lookup(["a", "b"]),
            lambda: c.lookup(np.array([[-1, 2]])),
            lambda: c.lookup(np.zeros((2, 3), np.uint64)),
            lambda: c.put_sequence("s", -1, np.array([[1, 2]], np.uint64), np.zeros((1,) + L.block_shape, np.float16), L),
            lambda: c.put_sequence("s\0x", 0, np.array([[1, 2]], np.uint64), np.zeros((1,) + L.block_shape, np.float16), L),
            lambda: c.put(np.array([[1, 2]], np.uint64), np.zeros((2,) + L.block_shape, np.float16), L),
            lambda: c.put(np.array([[1, 2]], np.uint64), np.zeros((1,) + L.block_shape, np.float16), L, pin="yes"),
            lambda: c.get_into(np.array([[1, 2]], np.uint64), L, np.zeros(3, np.uint8)),
            lambda: c.step(L, [("s", 32, 1)], q, [0]),
            lambda: c.step(L, "s", q, [0]),
            lambda: c.step(L, [], q, [0]),
            lambda: c.step(L, [(5, 32, 1, 0)], q, [0]),
            lambda: c.step(L, [("s", 0, 1, 1)], q, [0], np.zeros((1, 1, 64), np.float16), np.zeros((1, 1, 64), np.float16)),
            lambda: c.step(L, [("s", 0, 1, 1)], q, [0], np.zeros((1, 2, 64), np.float32), np.zeros((1, 2, 64), np.float32)),
            lambda: c.step(L, [("s", 0, 1, 1)], q, [0], np.zeros((1, 2, 32), np.float16), np.zeros((1, 2, 32), np.float16)),
            lambda: c.step(L, [("s", 0, 1, 1)], q, [0], [[0.0]], [[0.0]]),
            lambda: c.step(L, [("s", 0, 1, 100)], q, [0], kv, kv),
            lambda: c.step(L, [("s", 0, 1, 1)], q, [0]),
            lambda: c.step(L, [("s", 32, 1, 0)], q, [0], kv, kv),
            lambda: c.step(L, [("s", 0, 2 ** 32 + 1, 0)], q, [0]),
            lambda: c.step(L, [("s", 32, 1, 0)], q, [0], layer=2 ** 32),
            lambda: c.step(L, [("s", 32, 1, 0)], q, [0], layer=2),
            lambda: c.step(L, [("s", 32, 1, 0)], q, [0], window=-1),
            lambda: c.step(L, [("s", 32, 1, 0)], q, [0], softmax_scale=float("inf")),
            lambda: c.step(L, [("s", 32, 1, 0)], q, [-5]),
            lambda: c.step(L, [("s", 32, 1, 0)], q, [0, 1]),
            lambda: c.step(L, [("s", 32, 1, 0)], np.zeros((1, 3, 64), np.float16), [0]),
            lambda: c.step(L, [("s", 32, 1, 0)], "q", [0]),
            lambda: c.step_raw(L, [("s", 32, 1, 0)], None, 7, (1, 4, 64), [0], None, None),
            lambda: c.attend("s\0evil", L, 32, q, [31]),
            lambda: c.attend("s", L, -1, q, [31]),
            lambda: kvring.create_tenant(co, "x", "ok\0bad!"),
            lambda: kvring.create_tenant(co, "x", "ok", max_pinned_bytes=-1),
            lambda: kvring.create_tenant(co, "x", "ok", shared_namespaces="abc"),
            lambda: kvring.merge([np.zeros((1, 2, 4), np.float32)], [np.zeros((1, 3), np.float32)]),
            lambda: kvring.merge("x", "y"),
        ]
        for i, f in enumerate(cases):
            with self.subTest(case=i):
                self.assertKvringError(f, inv)

    def test_a_cast_output_is_refused_in_other_dtypes_and_off_the_device(self):
        """kvring_step_args.out_cast (C ABI 9): a dtype other than f16/bf16, or host buffers, is an InvalidArgument
        naming the field (checked by the C ABI and the client before anything is sent)."""
        import ctypes
        from kvring import _check, _lib, _native
        L = self.L
        q = np.zeros((1, 4, 64), np.float16)
        kv = np.zeros((1, 2, 64), np.float16)
        pos = np.zeros(1, np.int64)
        cast = np.zeros((1, 4, 64), np.float16)
        seqs = (_native.Seq * 1)(_native.Seq(b"cast-s", 0, 1, 1))
        out = np.zeros((1, 4, 64), np.float32)
        lse = np.zeros((1, 4), np.float32)
        for dtype, what in ((0, "out_cast_dtype"), (7, "out_cast_dtype"), (1, "device buffers")):
            a = _native.StepArgs(L._c(), seqs, 1, q.ctypes.data, 1, 1, 4, 64,
                                 pos.ctypes.data_as(_native.P(ctypes.c_int64)), kv.ctypes.data, kv.ctypes.data, 0, 1, 0,
                                 0.0, 0)
            a.out_cast, a.out_cast_dtype = cast.ctypes.data, dtype
            with self.assertRaises(kvring.InvalidArgumentError) as e:
                _check(_lib.kvring_step(self.c._h, ctypes.byref(a), out.ctypes.data, lse.ctypes.data, None))
            self.assertIn(what, str(e.exception))

    def test_refused_steps_change_nothing_and_the_sequence_stays_exact(self):
        c, L = self.c, self.L
        rng = np.random.default_rng(5)
        k = rng.standard_normal((20, 2, 64)).astype(np.float16)
        v = rng.standard_normal((20, 2, 64)).astype(np.float16)
        q = rng.standard_normal((1, 4, 64)).astype(np.float16)
        # 20 tokens appended on layer 0, one step each would be slow: one chunk.
        c.step(L, [("fz", 0, 0, 20)], np.zeros((0, 4, 64), np.float16), [], k, v)
        bad_k = rng.standard_normal((1, 2, 64)).astype(np.float16)
        bad_k[0, 1, 3] = np.nan
        inf_v = np.full((1, 2, 64), np.inf, np.float16)
        for nk, nv in ((bad_k, v[:1]), (k[:1], inf_v)):
            self.assertKvringError(lambda: c.step(L, [("fz", 20, 1, 1)], q, [20], nk, nv), kvring.InvalidArgumentError)
        self.assertKvringError(lambda: c.step(L, [("fz", 20, 1, 1)], q, [20], np.zeros((1, 1, 64), np.float16),
                                              np.zeros((1, 1, 64), np.float16)), kvring.InvalidArgumentError)
        # The sequence holds exactly the 20 good tokens: attention over it
        # equals a float64 reference over them.
        out, lse = c.step(L, [("fz", 20, 1, 0)], q, [19])
        kf, vf, qf = k.astype(np.float64), v.astype(np.float64), q.astype(np.float64)
        for h in range(4):
            s = kf[:, h // 2, :] @ qf[0, h] / math.sqrt(64)
            m = s.max()
            p = np.exp(s - m)
            ref = p @ vf[:, h // 2, :] / p.sum()
            np.testing.assert_allclose(out[0, h], ref, rtol=2e-3, atol=2e-3)
            self.assertAlmostEqual(float(lse[0, h]), m + math.log(p.sum()), places=2)

    def test_a_step_over_zero_tokens_and_unknown_sequences_say_why(self):
        q = np.zeros((1, 4, 64), np.float16)
        self.assertKvringError(lambda: self.c.step(self.L, [("zero", 0, 1, 0)], q, [0]), kvring.InvalidArgumentError)
        # Every replica answers NOT_FOUND: so does the step (not UNAVAILABLE).
        self.assertKvringError(lambda: self.c.attend("never-stored", self.L, 32, q, [31]), kvring.NotFoundError)

    def test_node_reply_when_queued_takes_its_default_on_and_off(self):
        # (C ABI 10: 0 the default, > 0 on, < 0 off; a CPU cluster answers every step once done either way.)
        q = np.zeros((1, 4, 64), np.float16)
        for v in (None, True, False):
            c = kvring.Client(self.cluster.coordinator, self.tok, node_reply_when_queued=v)
            self.assertKvringError(lambda: c.attend("never-stored", self.L, 32, q, [31]), kvring.NotFoundError)
            c.close()

    def test_detach_device_steps_leaves_host_steps_as_they_are(self):
        # (C ABI 11: detached steps are steps on a GPU stream; a step on host buffers waits for its replies, and
        # its error comes back from the call itself, not a later one)
        q = np.zeros((1, 4, 64), np.float16)
        c = kvring.Client(self.cluster.coordinator, self.tok, detach_device_steps=True)
        self.assertKvringError(lambda: c.attend("never-stored", self.L, 32, q, [31]), kvring.NotFoundError)
        self.assertKvringError(lambda: c.attend("never-stored", self.L, 32, q, [31]), kvring.NotFoundError)
        c.close()

    def test_a_closed_client_raises(self):
        c = kvring.Client(self.cluster.coordinator, self.tok)
        c.close()
        c.close()  # twice is fine
        q = np.zeros((1, 4, 64), np.float16)
        for f in (lambda: c.lookup(np.array([[1, 2]], np.uint64)), lambda: c.stats(), lambda: c.tenant,
                  lambda: c.namespace, lambda: c.map_version, lambda: c.attend("s", self.L, 32, q, [31]),
                  lambda: c.chain("m", self.L, [1] * 16)):
            self.assertKvringError(f, kvring.FailedPreconditionError)


if __name__ == "__main__":
    unittest.main()
