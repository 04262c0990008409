"""A real Prometheus server scrapes a local cluster (coordinator and two
daemons), and a counter the cluster moved is queried back through its HTTP
API. Skips where Debian's prometheus package is not installed
(deploy/setup.sh installs it)."""
import json
import os
import shutil
import subprocess
import tempfile
import time
import unittest
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

import kvring
from kvring.local_cluster import LocalCluster

PORT = int(os.environ.get("KVRING_TEST_PORT", "18000"))
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


@unittest.skipUnless(os.access(PROMETHEUS, os.X_OK), "prometheus is not installed")
class PrometheusScrapesTheCluster(unittest.TestCase):
    def setUp(self):
        self.cluster = LocalCluster(nodes=2, port=PORT, replication=2).start()
        self.dir = Path(tempfile.mkdtemp(prefix="kvring-prometheus-"))
        self.web = f"127.0.0.1:{PORT + 90}"
        targets = [f"127.0.0.1:{PORT + 200}", f"127.0.0.1:{PORT + 201}", f"127.0.0.1:{PORT + 202}"]
        (self.dir / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: kvring\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n")
        self.log = open(self.dir / "prometheus.log", "w")
        self.prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address={self.web}"], stdout=self.log, stderr=subprocess.STDOUT)

    def tearDown(self):
        self.prom.terminate()
        self.prom.wait(timeout=20)
        self.log.close()
        self.cluster.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def api(self, path, **query):
        url = f"http://{self.web}/api/v1/{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())["data"]

    def until(self, what, fn, ok=bool, timeout=45):
        end = time.time() + timeout
        last = None
        while time.time() < end:
            try:
                last = fn()
                if ok(last):
                    return last
            except OSError as e:  # not listening yet
                last = e
            time.sleep(0.5)
        self.fail(f"{what}: last answer {last!r}\n{(self.dir / 'prometheus.log').read_text()[-3000:]}")

    def test_a_counter_comes_back_through_prometheus(self):
        c = kvring.Client(self.cluster.coordinator, self.cluster.tenant_token)
        layout = kvring.Layout(16, 2, 2, 64, "bf16")
        keys = c.chain("m", layout, np.arange(16 * 10, dtype=np.uint32))
        c.put(keys, np.zeros(10 * layout.bytes, np.uint8), layout)
        self.assertEqual(c.lookup(keys), 10)
        # Every target scraped and healthy: the expositions parsed.
        targets = self.until("all three targets up", lambda: (lambda t: len(t) == 3 and all(
            x["health"] == "up" for x in t) and t)(self.api("targets")["activeTargets"]))
        self.assertEqual(len(targets), 3, targets)
        # 10 blocks x 2 replicas went through Put on the daemons.
        # A target may have been scraped before the put reached it: wait for
        # a scrape that follows it (the failure shows the last value read).
        def value(query):
            result = self.api("query", query=query)["result"]
            return float(result[0]["value"][1]) if result else None

        self.until("the put counter at 20 blocks", lambda: value("sum(kvring_put_bytes_total)"),
                   ok=lambda v: v == 20 * layout.bytes)
        self.until("2 nodes up", lambda: value("kvring_nodes_up"), ok=lambda v: v == 2)
        reqs = self.api("query", query='sum by (op) (kvring_requests_total)')["result"]
        ops = {r["metric"]["op"]: float(r["value"][1]) for r in reqs}
        self.assertGreaterEqual(ops.get("put", 0), 2, ops)
        self.assertGreaterEqual(ops.get("lookup", 0), 1, ops)


if __name__ == "__main__":
    unittest.main(verbosity=2)
