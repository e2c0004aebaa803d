"""Deployment files stay true to the binaries: every option the Kubernetes
manifests pass exists in the binary's --help, the worker count matches the
coordinator's grid, the worker's --health-file (for container probes) tells
its state, and the images build targets that exist."""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BIN, ROOT, STORIES, check, free_port_pair, generate, run_tests  # noqa: E402


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


# ---- the worker's health file ----------------------------------------------

def read_state(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def wait_state(path, states, timeout, procs):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for p in procs:
            check(p.poll() is None, "a process exited early: %s" % p.args)
        s = read_state(path)
        if s in states:
            return s
        time.sleep(0.1)
    raise AssertionError("%s stayed %r, expected %s" % (path, read_state(path), states))


def test_worker_health_file_and_spare():
    """What the worker probes read: serving, standby for a spare, a file that
    stops changing when the worker dies, and the spare serving in its place."""
    run = tempfile.mkdtemp(prefix="loom-health-")
    port = free_port_pair()
    ctl = "tcp://127.0.0.1:%d" % (port + 1)
    procs = []
    log = open(os.path.join(run, "all.log"), "w")

    def start(args):
        procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT))
        return procs[-1]

    ok = False
    try:
        coord = start([os.path.join(BIN, "loom-coordinator"), "--model", STORIES, "--listen",
                       "tcp://127.0.0.1:%d" % port, "--control", ctl, "--recovery-timeout-ms", "30000"])
        health = os.path.join(run, "%i.health")
        w0 = start([os.path.join(BIN, "loom-worker"), "--coordinator", ctl, "--threads", "1", "--id", "w0",
                    "--health-file", health])
        h0, h1 = os.path.join(run, "w0.health"), os.path.join(run, "w1.health")
        wait_state(h0, ("serving",), 60, procs)
        start([os.path.join(BIN, "loom-worker"), "--coordinator", ctl, "--threads", "1", "--id", "w1",
               "--health-file", health])
        wait_state(h1, ("standby",), 30, procs)
        check(not os.path.exists(h1 + ".tmp"), "the health file is renamed into place")
        before = os.stat(h0).st_mtime
        time.sleep(2.2)
        check(os.stat(h0).st_mtime > before, "the health file is rewritten every second")
        w0.send_signal(signal.SIGKILL)
        w0.wait()
        procs.remove(w0)
        wait_state(h1, ("joining", "serving"), 30, procs)
        wait_state(h1, ("serving",), 60, procs)
        dead = os.stat(h0).st_mtime
        time.sleep(1.5)
        check(os.stat(h0).st_mtime == dead and read_state(h0) == "serving",
              "a dead worker's file keeps its last state and stops aging")
        rc, out, ids, err = generate("tcp://127.0.0.1:%d" % port, "Once upon a time", max_tokens=8)
        check(rc == 0 and ids and len(ids) == 8, "generation after the spare took over: %d %s" % (rc, err))
        check(coord.poll() is None, "the coordinator exited")
        ok = True
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        log.close()
        if ok:
            shutil.rmtree(run, ignore_errors=True)
        else:
            with open(os.path.join(run, "all.log")) as f:
                sys.stderr.write(f.read()[-4000:])


def test_dockerfiles_build_real_targets():
    for name in ("Dockerfile", "Dockerfile.cuda"):
        with open(os.path.join(ROOT, "deploy", "docker", name)) as f:
            text = f.read()
        for target in re.findall(r"--target ([a-z0-9 -]+)", text)[0].split():
            check(os.path.exists(os.path.join(BIN, target)), "%s builds unknown target %s" % (name, target))


if __name__ == "__main__":
    run_tests([test_k8s_manifest_matches_binaries, test_worker_health_file_and_spare, test_dockerfiles_build_real_targets])
