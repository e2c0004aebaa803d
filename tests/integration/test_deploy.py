"""Deployment files stay true to the binaries: every option the Kubernetes
manifests pass exists in the binary's --help, the worker count matches the
coordinator's grid, and the images build targets that exist."""
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BIN, ROOT, check, run_tests  # noqa: E402


def options(binary):
    out = subprocess.run([os.path.join(BIN, binary), "--help"], capture_output=True, text=True, timeout=30).stdout
    return set(re.findall(r"^\s+(--[a-z0-9-]+)", out, re.M))


def test_k8s_manifest_matches_binaries():
    import yaml
    with open(os.path.join(ROOT, "deploy", "k8s", "loom.yaml")) as f:
        docs = list(yaml.safe_load_all(f))
    grid = None
    workers = None
    for d in docs:
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            cmd = c.get("command", [""])[0]
            if not cmd.startswith("loom"):
                continue
            known = options(cmd)
            for a in c.get("args", []):
                name = a.split("=", 1)[0]
                check(name in known, "%s has no option %s (deploy/k8s/loom.yaml)" % (cmd, name))
            if cmd == "loom-coordinator":
                args = dict(a.split("=", 1) for a in c["args"])
                grid = int(args.get("--tp", 1)) * int(args.get("--pp", 1))
            if cmd == "loom-worker":
                workers = d["spec"]["replicas"]
    check(grid is not None and workers == grid, "worker replicas %s, grid %s" % (workers, grid))


def test_dockerfiles_build_real_targets():
    for name in ("Dockerfile", "Dockerfile.cuda"):
        with open(os.path.join(ROOT, "deploy", "docker", name)) as f:
            text = f.read()
        for target in re.findall(r"--target ([a-z0-9 -]+)", text)[0].split():
            check(os.path.exists(os.path.join(BIN, target)), "%s builds unknown target %s" % (name, target))


if __name__ == "__main__":
    run_tests([test_k8s_manifest_matches_binaries, test_dockerfiles_build_real_targets])
