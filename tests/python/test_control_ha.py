"""The etcd mode as deploy/local-cluster.sh --etcd starts it (a 3-member etcd,
two coordinators, daemons given both) through the Python package: kill -9 the
leading coordinator, and the client, the daemons and tenant administration
carry on through the standby once it leads; nothing acknowledged is lost."""
import os
import signal
import time
import unittest

import numpy as np

import kvring
from kvring.local_cluster import LocalCluster

PORT = int(os.environ.get("KVRING_TEST_PORT", "23600"))


class ControlHa(unittest.TestCase):
    def test_the_leaders_death_is_invisible_to_the_data_path_and_costs_writes_one_lease(self):
        with LocalCluster(nodes=2, port=PORT, replication=2, host_bytes="64M", page_bytes="1M", etcd=True) as cl:
            self.assertIn(",", cl.coordinator)
            c = kvring.Client(cl.coordinator, cl.tenant_token)
            layout = kvring.Layout(block_tokens=16, layers=2, kv_heads=2, head_dim=64, dtype="f16")
            keys = c.chain("m", layout, np.arange(16 * 8, dtype=np.uint32))
            blocks = np.random.default_rng(1).standard_normal((8,) + layout.block_shape).astype(np.float16)
            c.put(keys, blocks, layout)
            names = [f"t{i}" for i in range(3)]
            for n in names:
                kvring.create_tenant(cl.coordinator, cl.admin_token, n)
            # Which coordinator leads: its log says so.
            leader = next(i for i in (0, 1) if "leading the coordinators" in cl.log(f"coordinator{i}"))
            pid = int((cl.dir / "pids" / f"coordinator{leader}").read_text())
            os.kill(pid, signal.SIGKILL)
            killed = time.time()
            # The data path does not notice.
            np.testing.assert_array_equal(c.get(keys, layout), blocks)
            # Writes come back once the standby leads (lease 5 s by default).
            while True:
                try:
                    kvring.create_tenant(cl.coordinator, cl.admin_token, "after")
                    break
                except kvring.UnavailableError as e:  # (clear: no coordinator leads yet)
                    self.assertIn("coordinator", str(e))
                    self.assertLess(time.time() - killed, 15, str(e))
                    time.sleep(0.2)
            took = time.time() - killed
            print(f"writes resumed {took:.1f} s after the leader's kill -9")
            self.assertIn("leading the coordinators", cl.log(f"coordinator{1 - leader}"))
            # A new client, given both coordinators, connects; every tenant is there.
            c2 = kvring.Client(cl.coordinator, cl.tenant_token)
            np.testing.assert_array_equal(c2.get(keys, layout), blocks)
            for n in names + ["after"]:
                with self.assertRaises(kvring.AlreadyExistsError):  # (the name is taken: it was kept)
                    kvring.create_tenant(cl.coordinator, cl.admin_token, n)
            c.close()
            c2.close()


if __name__ == "__main__":
    unittest.main()
