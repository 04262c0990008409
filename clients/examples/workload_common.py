"""Shared plumbing of the workload scripts: where the cluster is (a running
one, or a LocalCluster started for the run), output files, small stats."""
import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np

import kvring
from kvring.local_cluster import LocalCluster


def parser(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--coordinator", help="host:port of a running cluster (default: start a local one)")
    p.add_argument("--admin_token_file", help="admin token of that cluster (to create tenants)")
    p.add_argument("--token_file", help="a tenant token of that cluster")
    p.add_argument("--port", type=int, default=7700, help="coordinator port of the local cluster started otherwise")
    p.add_argument("--out_dir", default="bench/out/workloads", help="where results (JSON, CSV, PNG) go (bench/out/ is not tracked)")
    p.add_argument("--quick", action="store_true", help="a small run (tests)")
    p.add_argument("--seed", type=int, default=1)
    return p


@contextlib.contextmanager
def cluster(args, **local):
    """Yields (coordinator, admin_token, tenant_token)."""
    if args.coordinator:
        read = lambda f: Path(f).read_text().strip() if f else None  # noqa: E731
        yield args.coordinator, read(args.admin_token_file), read(args.token_file)
        return
    with LocalCluster(port=args.port, **local) as cl:
        print(f"[workload] started a local cluster: {cl.nodes} daemons, coordinator {cl.coordinator}", flush=True)
        yield cl.coordinator, cl.admin_token, cl.tenant_token


def tenant(coordinator, admin_token, name, **kw):
    """A tenant's token, created for this run (unique name per run)."""
    return kvring.create_tenant(coordinator, admin_token, f"{name}-{os.getpid()}-{int(time.time() * 1000) % 100000}", **kw)


def pct(values, q):
    return float(np.percentile(np.asarray(values), q)) if len(values) else 0.0


def write_json(out_dir, name, obj):
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / name
    path.write_text(json.dumps(obj, indent=2) + "\n")
    return path


def plot(out_dir, name, draw):
    """Saves a matplotlib figure drawn by draw(plt); skipped (with a note) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[workload] matplotlib missing: no plot")
        return None
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fig = plt.figure(figsize=(7, 4))
    draw(plt)
    fig.tight_layout()
    path = Path(out_dir) / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
