"""Membership in etcd: workers find the coordinator there and hold their
keys under leases; the coordinator claims its cluster and publishes the
plan; a dead worker's key goes away and the coordinator notices."""
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BIN, Cluster, Etcd, STORIES, check, kill, run_local, run_tests  # noqa: E402


def wait_for(cond, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def test_cluster_through_etcd():
    with Etcd() as etcd:
        with Cluster(STORIES, 2, 1, launch_args=["--etcd", etcd.url, "--cluster", "it"],
                     coord_args=["--etcd-ttl", "2"], worker_args=["--etcd-ttl=2"]) as c:
            rc, _, ids, err = c.generate("Once upon a time", 16)
            check(rc == 0 and ids == run_local(STORIES, "Once upon a time", 16)[1], "generate via etcd: %s" % err)
            coord = json.loads(etcd.get("/loom/it/coordinator"))
            check(coord["control"] == "tcp://127.0.0.1:%d" % (c.port + 1) and coord["api"] == c.addr,
                  "coordinator key: %s" % coord)
            workers = etcd.keys("/loom/it/workers/")
            check(workers == ["/loom/it/workers/worker-0", "/loom/it/workers/worker-1"], "worker keys: %s" % workers)
            plan = json.loads(etcd.get("/loom/it/plan"))
            check(plan["tp"] == 2 and plan["pp"] == 1 and len(plan["workers"]) == 2 and plan["epoch"] >= 1,
                  "plan: %s" % plan)
            print("  plan: %s" % json.dumps(plan)[:160])

            # a second coordinator for the same cluster is refused with a clear message
            p = subprocess.run([os.path.join(BIN, "loom-coordinator"), "--insecure", "--model", STORIES, "--listen",
                                "tcp://127.0.0.1:0", "--control", "tcp://127.0.0.1:0", "--etcd", etcd.url,
                                "--cluster", "it"], capture_output=True, text=True, timeout=30)
            check(p.returncode != 0 and "another coordinator" in p.stderr, "second coordinator: %r" % p.stderr)

            # a killed worker's lease expires: its key goes and the coordinator says so
            kill(c.pid("worker-1"))
            check(wait_for(lambda: etcd.keys("/loom/it/workers/") == ["/loom/it/workers/worker-0"], 10),
                  "worker-1's key did not expire")
            # whichever comes first: its missed heartbeats ("lost") or its key's expiry ("left etcd")
            noticed = lambda: any("worker-1" in l and ("lost" in l or "left etcd" in l)
                                  for l in c.log("coordinator").splitlines())
            check(wait_for(noticed, 10), "the coordinator did not notice")
        # a clean stop revokes the leases at once
        check(wait_for(lambda: etcd.keys("/loom/it/") == [], 5), "keys left after stop: %s" % etcd.keys("/loom/it/"))


def test_worker_waits_for_coordinator():
    with Etcd() as etcd:
        # the worker starts first and finds the coordinator once it appears
        wlog = open(os.path.join(etcd.dir, "worker.log"), "w+")
        clog = open(os.path.join(etcd.dir, "coordinator.log"), "w+")
        w = subprocess.Popen([os.path.join(BIN, "loom-worker"), "--etcd", etcd.url, "--cluster", "late",
                              "--threads", "1", "--id", "early"], stdout=subprocess.DEVNULL, stderr=wlog)
        try:
            def says_waiting():
                wlog.seek(0)
                return "to appear in etcd" in wlog.read()
            check(wait_for(says_waiting, 10), "the worker did not say it waits")
            check(w.poll() is None, "the worker gave up")
            ready = os.path.join(etcd.dir, "ready")
            co = subprocess.Popen([os.path.join(BIN, "loom-coordinator"), "--insecure", "--model", STORIES, "--listen",
                                   "tcp://127.0.0.1:0", "--control", "tcp://127.0.0.1:0", "--etcd", etcd.url,
                                   "--cluster", "late", "--ready-file", ready],
                                  stdout=subprocess.DEVNULL, stderr=clog)
            try:
                formed = wait_for(lambda: os.path.exists(ready), 20)
                if not formed:
                    for name, f in (("worker", wlog), ("coordinator", clog)):
                        f.seek(0)
                        print("--- %s log ---\n%s" % (name, "".join(f.readlines()[-20:])))
                check(formed, "the grid did not form")
            finally:
                co.terminate()
                co.wait(timeout=20)
        finally:
            w.terminate()
            w.wait(timeout=20)
    # without a coordinator and with a short wait, the worker says why it gives up
    with Etcd() as etcd:
        p = subprocess.run([os.path.join(BIN, "loom-worker"), "--etcd", etcd.url, "--cluster", "nobody",
                            "--coordinator-wait-s", "1"], capture_output=True, text=True, timeout=30)
        check(p.returncode != 0 and "no coordinator for cluster 'nobody'" in p.stderr, p.stderr)
    p = subprocess.run([os.path.join(BIN, "loom-worker"), "--etcd", "http://127.0.0.1:1", "--cluster", "x",
                        "--coordinator-wait-s", "1"], capture_output=True, text=True, timeout=30)
    check(p.returncode != 0 and "127.0.0.1:1" in p.stderr, "unreachable etcd: %r" % p.stderr)


if __name__ == "__main__":
    run_tests([test_cluster_through_etcd, test_worker_waits_for_coordinator])
