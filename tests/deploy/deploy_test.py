#!/usr/bin/env python3
"""Checks the deployment files: Kubernetes manifests are valid YAML with the
objects a cluster needs, every config file (systemd and the ConfigMap) is
accepted by the binary it configures (--check_config), and the systemd units
name binaries and configs that exist in the layout they describe."""
import configparser, os, subprocess, sys, tempfile
import yaml

root, build = sys.argv[1], sys.argv[2]
fail = []

docs = list(yaml.safe_load_all(open(os.path.join(root, "deploy/k8s/kvring.yaml"))))
kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
for need in [("Namespace", "kvring"), ("ConfigMap", "kvring-config"), ("Secret", "kvring-tokens"),
             ("Deployment", "kvring-coordinator"), ("Service", "kvring-coordinator"), ("Service", "kvringd"),
             ("StatefulSet", "kvringd"), ("StatefulSet", "kvring-etcd"), ("Service", "kvring-etcd")]:
    if need not in kinds:
        fail.append(f"k8s: missing {need}")
for d in docs:
    for key in ("apiVersion", "kind", "metadata"):
        if key not in d:
            fail.append(f"k8s: {d.get('kind')} lacks {key}")
    if d["kind"] in ("Deployment", "StatefulSet"):
        spec = d["spec"]
        if spec["selector"]["matchLabels"] != spec["template"]["metadata"]["labels"]:
            fail.append(f"k8s: {d['metadata']['name']} selector does not match its pod labels")
        for c in spec["template"]["spec"]["containers"]:
            binary = os.path.basename(c["command"][0])
            if binary not in ("kvringd", "kvring-coordinator", "etcd"):
                fail.append(f"k8s: unknown binary {binary}")

# The control plane is highly available (docs/CONTROL-PLANE.md): at least two
# coordinators in etcd mode, each advertising its own pod address, and the
# ConfigMap's etcd members are the etcd StatefulSet's pods, which form one
# cluster of that many members.
by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
coord_dep = by_name.get(("Deployment", "kvring-coordinator"))
etcd_sts = by_name.get(("StatefulSet", "kvring-etcd"))
conf_lines = dict(l.split("=", 1) for l in next(d for d in docs if d["kind"] == "ConfigMap")["data"]
                  ["coordinator.conf"].splitlines() if "=" in l and not l.lstrip().startswith("#"))
conf_lines = {k.strip(): v.strip() for k, v in conf_lines.items()}
if coord_dep and etcd_sts:
    if coord_dep["spec"]["replicas"] < 2:
        fail.append("k8s: fewer than two coordinators")
    if not any("--advertise=$(POD_IP):7000" in c["command"] for c in coord_dep["spec"]["template"]["spec"]["containers"]):
        fail.append("k8s: the coordinators do not advertise their pod address")
    n, svc = etcd_sts["spec"]["replicas"], etcd_sts["spec"]["serviceName"]
    pods = [f"kvring-etcd-{i}.{svc}.kvring.svc.cluster.local" for i in range(n)]
    if conf_lines.get("etcd", "").split(",") != [f"{p}:2379" for p in pods]:
        fail.append(f"k8s: coordinator.conf etcd = {conf_lines.get('etcd')!r}, not the {n} etcd pods")
    cmd = etcd_sts["spec"]["template"]["spec"]["containers"][0]["command"]
    initial = next((a.split("=", 1)[1] for a in cmd if a.startswith("--initial-cluster=")), "")
    if initial.split(",") != [f"kvring-etcd-{i}=http://{p}:2380" for i, p in enumerate(pods)]:
        fail.append(f"k8s: etcd --initial-cluster {initial!r} does not name its {n} pods")
    if n < 3 or n % 2 == 0:
        fail.append(f"k8s: {n} etcd members (want an odd number, at least 3)")
    if not by_name.get(("Service", "kvring-etcd"), {}).get("spec", {}).get("publishNotReadyAddresses"):
        fail.append("k8s: the etcd peers cannot resolve each other before they are ready")

def check_conf(binary, text, what):
    with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
        f.write(text)
    r = subprocess.run([binary, f"--config={f.name}", "--check_config"], capture_output=True, text=True)
    os.unlink(f.name)
    if r.returncode != 0 or "config OK" not in r.stdout:
        fail.append(f"{what}: {binary} rejects it: {r.stdout}{r.stderr}")

kvringd = os.path.join(build, "control/kvringd")
coord = os.path.join(build, "control/kvring-coordinator")
cm = next(d for d in docs if d["kind"] == "ConfigMap")
check_conf(kvringd, cm["data"]["kvringd.conf"], "ConfigMap kvringd.conf")
check_conf(coord, cm["data"]["coordinator.conf"], "ConfigMap coordinator.conf")
check_conf(kvringd, open(os.path.join(root, "deploy/systemd/kvringd-0.conf")).read(), "systemd kvringd-0.conf")
check_conf(coord, open(os.path.join(root, "deploy/systemd/coordinator.conf")).read(), "systemd coordinator.conf")
check_conf(coord, open(os.path.join(root, "deploy/systemd/coordinator-etcd.conf")).read(),
           "systemd coordinator-etcd.conf")
# A bad config must be rejected, or the checks above prove nothing.
with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
    f.write("listen = 0.0.0.0:7100\nno_such_flag = 1\n")
r = subprocess.run([kvringd, f"--config={f.name}", "--check_config"], capture_output=True, text=True)
if r.returncode == 0:
    fail.append("kvringd accepted a config with an unknown flag")

for unit in ("kvring-coordinator.service", "kvringd@.service"):
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.read(os.path.join(root, "deploy/systemd", unit))
    for sec in ("Unit", "Service", "Install"):
        if sec not in cp:
            fail.append(f"{unit}: no [{sec}] section")
    exe = cp["Service"]["ExecStart"].split()[0]
    if os.path.basename(exe) not in ("kvringd", "kvring-coordinator"):
        fail.append(f"{unit}: ExecStart runs {exe}")

# GPU nodes share their GPU with the engines through CUDA MPS (docs/MPS.md):
# the node unit wants the MPS unit and starts after it, and sees its pipe.
mps = configparser.ConfigParser(strict=False, interpolation=None)
mps.read(os.path.join(root, "deploy/systemd/kvring-mps.service"))
if "Service" not in mps or os.path.basename(mps["Service"].get("ExecStart", "").split()[0]) != "nvidia-cuda-mps-control":
    fail.append("kvring-mps.service: ExecStart does not run nvidia-cuda-mps-control")
elif mps["Service"].get("Type") != "forking" or "ConditionPathExists" not in mps["Unit"]:
    fail.append("kvring-mps.service: not Type=forking, or not skipped where the NVIDIA tools are missing")
node_unit = open(os.path.join(root, "deploy/systemd/kvringd@.service")).read()
for line in ("Wants=kvring-mps.service", "BindPaths=-/tmp/nvidia-mps"):
    if line not in node_unit.splitlines():
        fail.append(f"kvringd@.service lacks {line}")
if "kvring-mps.service" not in [w for l in node_unit.splitlines() if l.startswith("After=") for w in l.split("=", 1)[1].split()]:
    fail.append("kvringd@.service does not start after kvring-mps.service")
# local-cluster.sh: its MPS commands run where the NVIDIA tools are missing (they say so and succeed).
r = subprocess.run(["bash", os.path.join(root, "deploy/local-cluster.sh"), "mps-status"], capture_output=True, text=True)
if r.returncode != 0 or "MPS" not in r.stdout:
    fail.append(f"local-cluster.sh mps-status: rc {r.returncode}: {r.stdout}{r.stderr}")
# local-cluster.sh start refuses ports another listener holds (a cluster started with another --dir), naming
# the port, instead of starting daemons that would register with that cluster's coordinator.
import socket
held = socket.socket()
held.bind(("127.0.0.1", 0))
held.listen(1)
port = held.getsockname()[1]
with tempfile.TemporaryDirectory() as d:
    r = subprocess.run(["bash", os.path.join(root, "deploy/local-cluster.sh"), "start", "--dir", d, "--port", str(port),
                        "--nodes", "1", "--bin", build], capture_output=True, text=True, timeout=60)
    if r.returncode == 0 or f"port {port} is in use" not in r.stderr or os.path.exists(os.path.join(d, "pids", "node0")):
        fail.append(f"local-cluster.sh start on a held port: rc {r.returncode}: {r.stdout}{r.stderr}")
held.close()

if fail:
    print("\n".join(fail))
    sys.exit(1)
print(f"deploy files OK: {len(docs)} Kubernetes objects, 5 config files, 3 systemd units")
