"""The three workload scripts (clients/examples), each run small (--quick)
against its own local cluster of real processes; their JSON results must
show the behaviour each workload exists to show."""
import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

ROOT = Path(os.environ.get("KVRING_ROOT", Path(__file__).resolve().parents[2]))
PORT = int(os.environ.get("KVRING_TEST_PORT", "17800"))


def run(script, port, *extra):
    out = tempfile.mkdtemp(prefix="kvring-wl-")
    r = subprocess.run([sys.executable, str(ROOT / "clients/examples" / script), "--quick", "--port", str(port),
                        "--out_dir", out, *extra], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise AssertionError(f"{script} failed:\n{r.stdout}\n{r.stderr}")
    return out, r.stdout


class Workloads(unittest.TestCase):
    def test_chat_reuses_shared_prefixes_and_matches_a_full_recompute(self):
        out, text = run("chat.py", PORT)
        res = json.loads((Path(out) / "chat.json").read_text())["result"]
        self.assertGreater(res["hit_rate"], 0.5, text)
        self.assertEqual(res["prefill_tokens_saved"], res["hit_tokens"])
        self.assertGreater(res["verified_turns"], 0)
        self.assertLess(res["turns_without_hit"], res["turns"])
        self.assertIn("prefix hit rate", text)

    def test_agent_memory_moves_far_fewer_bytes_with_pass_q(self):
        out, text = run("agent_memory.py", PORT + 300)
        res = json.loads((Path(out) / "agent_memory.json").read_text())["result"]
        self.assertGreater(res["ratio"], 5, text)  # ~30x at the quick run's 64K tokens, 65x at 128K
        self.assertGreater(res["pull_once_gbps"], 0)
        pc = res["per_context"]  # pull grows with the context, pass-Q does not
        self.assertGreater(pc[-1]["pull_bytes"], 3 * pc[0]["pull_bytes"])
        self.assertLess(pc[-1]["passq_bytes"], 1.5 * pc[0]["passq_bytes"])

    def test_cache_backend_hits_shared_prefixes_and_reads_them_back(self):
        out, text = run("cache_backend.py", PORT + 600, "--host_bytes", "512M")
        data = json.loads((Path(out) / "cache_backend.json").read_text())
        res = data["result"]
        self.assertGreater(res["hit_rate"], 0.3, text)
        self.assertTrue(all(b["read_blocks"] == min(b["hit_blocks"], 4096) or b["read_blocks"] <= b["hit_blocks"]
                            for b in data["batches"]))
        self.assertGreater(res["read_gb"], 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
