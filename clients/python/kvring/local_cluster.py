"""A local kvring cluster (coordinator + N daemons on loopback) for tests,
demos and workloads, driven through deploy/local-cluster.sh.

    with LocalCluster(nodes=4, port=7600) as cl:
        c = kvring.Client(cl.coordinator, cl.tenant_token)

Binaries come from `bin` (default: KVRING_BIN, else the build directory this
package was built into), the script from `root` (default: KVRING_ROOT, else
the binaries' parent). gpu=DEV makes every daemon a GPU node with hbm_bytes
of HBM (and starts CUDA MPS first unless mps=False: see start_mps());
chunk_blocks and write_quorum go to the coordinator. etcd=True runs the
control plane without a single point of failure: a 3-member etcd and two
coordinators (cl.coordinator then names both; docs/CONTROL-PLANE.md).
"""
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


class LocalCluster:
    def __init__(self, nodes=4, port=7600, replication=2, host_bytes="512M", page_bytes="2M", directory=None, keep=False,
                 gpu=-1, hbm_bytes="0", chunk_blocks=64, write_quorum=0, bin=None, root=None, daemon_flags="",
                 gpus=None, mps=True, etcd=False):
        here = Path(__file__).resolve()
        self.bin = Path(bin or os.environ.get("KVRING_BIN", here.parents[2]))
        self.root = Path(root or os.environ.get("KVRING_ROOT", self.bin.parent))
        self.gpu, self.hbm_bytes, self.chunk_blocks, self.write_quorum = gpu, hbm_bytes, chunk_blocks, write_quorum
        self.daemon_flags = daemon_flags
        self.mps = mps
        self.etcd = etcd
        self.gpus = gpus  # a list of devices: daemon i on gpus[i % len(gpus)] (overrides gpu)
        self.nodes, self.port, self.replication = nodes, port, replication
        self.host_bytes, self.page_bytes = host_bytes, page_bytes
        self._own_dir = directory is None
        self.dir = Path(directory or tempfile.mkdtemp(prefix="kvring-cluster-"))
        self.keep = keep
        self.coordinator = f"127.0.0.1:{port},127.0.0.1:{port + 320}" if etcd else f"127.0.0.1:{port}"

    def _script(self, *args):
        return _run_script(self.root, *args, "--dir", str(self.dir), "--bin", str(self.bin),
                           env=dict(os.environ, KVRING_BIN=str(self.bin)))

    def start(self):
        self._script("start", "--nodes", str(self.nodes), "--port", str(self.port), "--replication",
                     str(self.replication), "--host-bytes", self.host_bytes, "--page-bytes", self.page_bytes,
                     "--gpu", str(self.gpu), "--hbm-bytes", str(self.hbm_bytes), "--chunk-blocks",
                     str(self.chunk_blocks), "--write-quorum", str(self.write_quorum), "--daemon-flags",
                     self.daemon_flags, *(["--gpus", ",".join(str(g) for g in self.gpus)] if self.gpus else []),
                     *([] if self.mps else ["--no-mps"]), *(["--etcd"] if self.etcd else []))
        return self

    def stop(self):
        self._script("stop")
        if self._own_dir and not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    def log(self, name):
        """The text of a process's log (name: "coordinator" (with etcd: "coordinator0", "coordinator1",
        "etcd<j>") or "node<i>")."""
        return (self.dir / "logs" / f"{name}.log").read_text(errors="replace")

    def kill9(self, node):
        """SIGKILL daemon `node` (fault tests)."""
        pid = int((self.dir / "pids" / f"node{node}").read_text())
        os.kill(pid, 9)

    @property
    def admin_token(self):
        return (self.dir / "admin.token").read_text().strip()

    @property
    def tenant_token(self):
        return (self.dir / "tenant.token").read_text().strip()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _run_script(root, *args, env=None):
    """deploy/local-cluster.sh under `root` with `args`: its output, or RuntimeError with it."""
    r = subprocess.run(["bash", str(Path(root) / "deploy/local-cluster.sh"), *args], env=env, capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise RuntimeError(f"local-cluster.sh {args[0]} failed:\n{r.stdout}{r.stderr}")
    return r.stdout


def _mps_script(action, root=None):
    root = root or os.environ.get("KVRING_ROOT", Path(__file__).resolve().parents[3])
    return _run_script(root, action).strip()


def start_mps(root=None):
    """Starts CUDA MPS (as deploy/local-cluster.sh --gpu does) unless it runs. A process joins MPS when it first
    touches CUDA: a script that starts GPU daemons and then uses the GPU itself calls this before its first CUDA
    call, so it shares the daemons' GPU context instead of paying a context switch on every pass-Q step."""
    return _mps_script("mps-start", root)


def stop_mps(root=None):
    """Ends CUDA MPS (processes that joined it keep running until they exit)."""
    return _mps_script("mps-stop", root)

