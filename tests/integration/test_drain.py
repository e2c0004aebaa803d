"""Graceful drain and coordinator restarts.

SIGTERM makes the coordinator refuse new requests at once (ZeroMQ:
UNAVAILABLE "draining"; HTTP: 503 with Retry-After; /health not ready) while
the streams in flight run to their end; at --shutdown-timeout the rest end
with finish_reason "length" and [DONE]; then it exits 0. Workers outlive a
coordinator: they keep their weights and join the next one.

These tests start the processes themselves (not through launch.sh) to see
the coordinator's exit status."""
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import (BIN, STORIES, Etcd, Failure, check, free_port_pair, gen_model, generate,  # noqa: E402
                     open_stream, run_local, run_tests, sanitizer_reports, wait_for)

WORK = os.environ.get("LOOM_TEST_WORK", "/tmp/loom-it-drain")
PROMPT = "Once upon a time"


def slow_model():
    # a few ms per token on one thread: long streams are still running when we act
    return gen_model(os.path.join(WORK, "slow"), "--dim", "256", "--hidden-dim", "768", "--layers", "8", "--heads",
                     "8", "--kv-heads", "4", "--vocab", "512", "--max-pos", "4096", "--seed", "3")



class Procs:
    """A coordinator and workers started here, their logs in a private
    directory; everything still running is killed on exit."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="loom-drain-")
        self.procs = {}

    def start(self, name, argv):
        log = open(os.path.join(self.dir, name + ".log"), "a")
        self.procs[name] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        return self.procs[name]

    def coordinator(self, model, port, http_port=None, extra=(), name="coordinator", api_port=None):
        ready = os.path.join(self.dir, name + ".ready")
        if os.path.exists(ready):
            os.unlink(ready)
        api = api_port if api_port else port  # the control port is always port + 1
        argv = [os.path.join(BIN, "loom-coordinator"), "--insecure",
                "--model", model, "--listen", "tcp://127.0.0.1:%d" % api,
                "--control", "tcp://127.0.0.1:%d" % (port + 1), "--ready-file", ready] + list(extra)
        if http_port:
            argv += ["--http", "127.0.0.1:%d" % http_port]
        p = self.start(name, argv)
        p.ready_file = ready
        return p

    def worker(self, name, port, extra=()):
        return self.start(name, [os.path.join(BIN, "loom-worker"), "--coordinator", "tcp://127.0.0.1:%d" % (port + 1),
                                 "--threads", "1", "--id", name] + list(extra))

    def log(self, name):
        try:
            with open(os.path.join(self.dir, name + ".log")) as f:
                return f.read()
        except OSError:
            return ""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        reports = sanitizer_reports(self.dir)
        if exc[0] is not None or reports:
            for name in sorted(self.procs):
                sys.stderr.write("---- %s\n%s\n" % (name, self.log(name)[-3000:]))
        if exc[0] is None and reports:
            raise Failure("sanitizer reports in %s" % ", ".join(reports))
        return False


def wait_ready(p, timeout=60):
    wait_for(lambda: os.path.exists(p.ready_file) or p.poll() is not None, timeout, "the grid to be ready")
    check(p.poll() is None, "the coordinator exited with %s" % p.returncode)


def http_port():
    return harness.free_port()


def http_post(port, body, timeout=10):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, dict(r.getheaders()), data


def http_get(port, path, timeout=10):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("GET", path)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data



def read_to_end(s, got, timeout=60):
    s.settimeout(timeout)
    while True:
        b = s.recv(65536)
        if not b:
            break
        got += b
        if b"data: [DONE]" in got:
            break
    s.close()
    return got


def async_generate(addr, max_tokens, extra=()):
    return subprocess.Popen([os.path.join(BIN, "loom"), "generate", "--addr", addr, "--prompt", PROMPT,
                             "--max-tokens", str(max_tokens), "--temperature", "0", "--ignore-eos", "--ids",
                             "--timeout-ms", "120000"] + list(extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_running(addr, n, timeout=30):
    """Until the coordinator runs n requests: a client's start-up (the loom
    binary, its connect) takes longer than a fixed sleep on a loaded machine."""
    def running():
        p = subprocess.run([os.path.join(BIN, "loom"), "stats", "--addr", addr], capture_output=True, text=True,
                           timeout=30)
        try:
            return p.returncode == 0 and json.loads(p.stdout)["running"] >= n
        except ValueError:
            return False
    wait_for(running, timeout, "%d running request(s)" % n)


def ids_of(err):
    return [int(x) for line in err.splitlines() if line.startswith("ids:") for x in line[4:].split()]


def test_sigterm_drains():
    model = slow_model()
    port, hport = free_port_pair(), http_port()
    addr = "tcp://127.0.0.1:%d" % port
    with Procs() as P:
        co = P.coordinator(model, port, hport, extra=["--shutdown-timeout", "300"])
        P.worker("w0", port)
        wait_ready(co)
        # streams of about 6 s, whatever the build's speed (the sanitizer build is ~50x slower)
        # (the time of 65 tokens less that of 1: the client's own start-up left out)
        t0 = time.time()
        rc, _, _, err = generate(addr, PROMPT, 1, extra=["--ignore-eos"])
        t1 = time.time()
        rc2, _, _, err2 = generate(addr, PROMPT, 65, extra=["--ignore-eos"])
        check(rc == 0 and rc2 == 0, "warm-up: %s %s" % (err, err2))
        n = max(100, min(4000, int(64 / max(1e-3, (time.time() - t1) - (t1 - t0)) * 6)))
        expect = run_local(model, PROMPT, n, extra=["--ignore-eos"])[1]
        zs = async_generate(addr, n)
        hs, got = open_stream(hport, {"prompt": PROMPT, "max_tokens": n, "ignore_eos": True, "temperature": 0},
                              timeout=60)
        wait_running(addr, 2)
        check(zs.poll() is None, "the ZeroMQ stream ended before SIGTERM")
        t0 = time.time()
        co.send_signal(signal.SIGTERM)
        # not ready at once, new requests refused, the streams go on
        wait_for(lambda: http_get(hport, "/health")[0] == 503, 2, "/health to report not ready")
        st, body = http_get(hport, "/health")
        check(b"draining" in body, "/health while draining: %r" % body)
        st, hdrs, body = http_post(hport, {"prompt": PROMPT, "max_tokens": 4})
        err = json.loads(body).get("error", {})
        check(st == 503 and hdrs.get("Retry-After") == "1" and "draining" in err.get("message", ""),
              "a new HTTP request while draining: %d %s %r" % (st, hdrs, body))
        rc, _, _, zerr = generate(addr, PROMPT, 4)
        check(rc == 4 and "UNAVAILABLE" in zerr and "draining" in zerr, "a new ZeroMQ request: %d %r" % (rc, zerr))
        refused_in = time.time() - t0
        out, zerr = zs.communicate(timeout=120)
        check(zs.returncode == 0 and ids_of(zerr) == expect, "the ZeroMQ stream did not finish whole: %r" % zerr[-300:])
        got = read_to_end(hs, got)
        check(b"data: [DONE]" in got and b'"finish_reason":"length"' in got,
              "the HTTP stream did not finish: %r" % got[-300:])
        check(got.count(b"data: ") == n + 2, "the HTTP stream has %d events for %d tokens" % (got.count(b"data: "), n))
        rc = co.wait(timeout=30)
        print("  refusing within %.2f s of SIGTERM; drained and exited %.2f s after it" % (refused_in, time.time() - t0))
        check(rc == 0, "the coordinator exited with %d" % rc)
        log = P.log("coordinator")
        check("draining" in log and "drained" in log, "no drain in the log: %s" % log[-1500:])


def test_shutdown_timeout_cuts_streams():
    model = slow_model()
    port, hport = free_port_pair(), http_port()
    addr = "tcp://127.0.0.1:%d" % port
    with Procs() as P:
        co = P.coordinator(model, port, hport, extra=["--shutdown-timeout", "1"])
        P.worker("w0", port)
        wait_ready(co)
        zs = async_generate(addr, 4000)
        hs, got = open_stream(hport, {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "temperature": 0},
                              timeout=60)
        wait_running(addr, 2)
        t0 = time.time()
        co.send_signal(signal.SIGTERM)
        out, zerr = zs.communicate(timeout=30)
        t_end = time.time() - t0
        ids = ids_of(zerr)
        check(zs.returncode == 0 and 0 < len(ids) < 4000, "ZeroMQ stream at the timeout: %d %r" % (zs.returncode,
                                                                                                  zerr[-300:]))
        check(ids == run_local(model, PROMPT, len(ids), extra=["--ignore-eos"])[1], "the cut stream's ids are wrong")
        got = read_to_end(hs, got, timeout=10)
        check(b"data: [DONE]" in got and b'"finish_reason":"length"' in got,
              "the HTTP stream did not end with a final event: %r" % got[-300:])
        rc = co.wait(timeout=10)
        print("  streams cut %.2f s after SIGTERM (timeout 1 s) after %d tokens; exit %d" % (t_end, len(ids), rc))
        check(0.9 < t_end < 4, "the streams ended %.2f s after SIGTERM" % t_end)
        check(rc == 0, "the coordinator exited with %d" % rc)
        check("shutdown timeout" in P.log("coordinator"), "the log does not say why the streams ended")


def test_second_signal_exits_at_once():
    model = slow_model()
    port = free_port_pair()
    with Procs() as P:
        co = P.coordinator(model, port)
        P.worker("w0", port)
        wait_ready(co)
        zs = async_generate("tcp://127.0.0.1:%d" % port, 4000)
        wait_running("tcp://127.0.0.1:%d" % port, 1)
        t0 = time.time()
        co.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        co.send_signal(signal.SIGTERM)
        rc = co.wait(timeout=10)
        out, zerr = zs.communicate(timeout=10)
        print("  exited %.2f s after the first signal" % (time.time() - t0))
        check(time.time() - t0 < 3, "the second signal did not stop it at once")
        check(zs.returncode == 4 and "shutting down" in zerr, "the cut stream: %d %r" % (zs.returncode, zerr[-200:]))
        check(rc == 0, "the coordinator exited with %d" % rc)


def loads(P, name):
    return P.log(name).count("shard loaded:")


def test_workers_survive_coordinator_restart():
    # kill -9 of the coordinator: the workers notice its silence, keep their
    # weights and join a new coordinator on the same address, in their old slots
    expect = run_local(STORIES, PROMPT, 24)[1]
    port = free_port_pair()
    addr = "tcp://127.0.0.1:%d" % port
    with Procs() as P:
        co = P.coordinator(STORIES, port, extra=["--tp", "2", "--pp", "2"])
        ws = [P.worker("w%d" % i, port) for i in range(4)]
        wait_ready(co)
        rc, _, ids, err = generate(addr, PROMPT, 24)
        check(rc == 0 and ids == expect, "before the restart: %s" % err)
        co.kill()
        co.wait()
        t0 = time.time()
        wait_for(lambda: all("leaving the grid" in P.log("w%d" % i) for i in range(4)), 10,
                 "the workers to notice the coordinator is gone")
        noticed = time.time() - t0
        check(all(w.poll() is None for w in ws), "a worker exited with its coordinator")
        co = P.coordinator(STORIES, port, extra=["--tp", "2", "--pp", "2"], name="coordinator2")
        wait_ready(co, 30)
        print("  workers noticed the killed coordinator in %.2f s; a new one served %.2f s after the kill"
              % (noticed, time.time() - t0))
        rc, _, ids, err = generate(addr, PROMPT, 24)
        check(rc == 0 and ids == expect, "after the restart: %s" % err)
        for i in range(4):
            log = P.log("w%d" % i)
            check(loads(P, "w%d" % i) == 1 and "keeping the weights" in log,
                  "w%d loaded its shard %d times" % (i, loads(P, "w%d" % i)))
        check(P.log("coordinator2").count("loaded its shard") == 4, "the new coordinator did not form the grid")


def test_workers_follow_coordinator_through_etcd():
    # workers that found the coordinator in etcd follow its successor to a new address
    expect = run_local(STORIES, PROMPT, 24)[1]
    with Etcd() as etcd, Procs() as P:
        etcd_args = ["--etcd", etcd.url, "--cluster", "drain"]
        port = free_port_pair()
        co = P.coordinator(STORIES, port, extra=["--tp", "2"] + etcd_args)
        for i in range(2):
            P.start("w%d" % i, [os.path.join(BIN, "loom-worker"), "--threads", "1", "--id", "w%d" % i] + etcd_args)
        wait_ready(co)
        rc, _, ids, err = generate("tcp://127.0.0.1:%d" % port, PROMPT, 24)
        check(rc == 0 and ids == expect, "before the restart: %s" % err)
        co.send_signal(signal.SIGTERM)
        check(co.wait(timeout=30) == 0, "the first coordinator did not exit cleanly")
        port2 = free_port_pair()
        co = P.coordinator(STORIES, port2, extra=["--tp", "2"] + etcd_args, name="coordinator2")
        wait_ready(co, 30)
        rc, _, ids, err = generate("tcp://127.0.0.1:%d" % port2, PROMPT, 24)
        check(rc == 0 and ids == expect, "after the restart: %s" % err)
        for i in range(2):
            log = P.log("w%d" % i)
            check("the coordinator left" in log and "is now at tcp://127.0.0.1:%d" % (port2 + 1) in log,
                  "w%d did not follow: %s" % (i, log[-800:]))
            check(loads(P, "w%d" % i) == 1, "w%d loaded its shard again" % i)


def test_fast_restart_after_aborts_serves():
    # D2: a coordinator restarted before the workers noticed the crash starts
    # again at epoch 1; workers that saw epoch 1 aborted under the old one must
    # not fail its steps (the incarnation in Assign tells them apart)
    expect = run_local(STORIES, PROMPT, 16)[1]
    port = free_port_pair()
    addr = "tcp://127.0.0.1:%d" % port
    with Procs() as P:
        co = P.coordinator(STORIES, port, extra=["--tp", "2"])
        P.worker("w0", port)
        w1 = P.worker("w1", port)
        wait_ready(co)
        w1.kill()
        w1.wait()
        P.worker("w1", port)  # the same id again: epoch 1 is aborted, epoch 2 forms
        wait_for(lambda: "grid ready (epoch 2" in P.log("coordinator"), 30, "the grid to form again (epoch 2)")
        check("abort of epoch 1" in P.log("w0"), "w0 saw no abort")
        co.kill()
        co.wait()
        co = P.coordinator(STORIES, port, extra=["--tp", "2", "--recovery-timeout-ms", "0"], name="coordinator2")
        wait_ready(co, 30)
        check("leaving the grid" not in P.log("w0"), "w0 noticed the crash first: the case is not tested")
        for i in range(3):
            rc, _, ids, err = generate(addr, PROMPT, 16)
            check(rc == 0 and ids == expect, "request %d after the fast restart: %s" % (i, err))
        check("forgetting the epochs of the previous one" in P.log("w0"), "w0 did not see a new incarnation")


def test_restart_keeps_every_shard_2x2_etcd():
    # every worker of a 2x2 grid found through etcd gets its own slot back from
    # the next coordinator and keeps its weights
    expect = run_local(STORIES, PROMPT, 24)[1]
    with Etcd() as etcd, Procs() as P:
        etcd_args = ["--etcd", etcd.url, "--cluster", "keep"]
        port = free_port_pair()
        co = P.coordinator(STORIES, port, extra=["--tp", "2", "--pp", "2"] + etcd_args)
        for i in range(4):
            P.start("w%d" % i, [os.path.join(BIN, "loom-worker"), "--threads", "1", "--id", "w%d" % i] + etcd_args)
        wait_ready(co)
        rc, _, ids, err = generate("tcp://127.0.0.1:%d" % port, PROMPT, 24)
        check(rc == 0 and ids == expect, "before the restart: %s" % err)
        co.send_signal(signal.SIGTERM)
        check(co.wait(timeout=30) == 0, "the first coordinator did not exit cleanly")
        co = P.coordinator(STORIES, port, extra=["--tp", "2", "--pp", "2"] + etcd_args, name="coordinator2")
        wait_ready(co, 60)
        rc, _, ids, err = generate("tcp://127.0.0.1:%d" % port, PROMPT, 24)
        check(rc == 0 and ids == expect, "after the restart: %s" % err)
        # a crash (kill -9) within the lease TTL: the next coordinator takes over the dead one's key
        co.kill()
        co.wait()
        co = P.coordinator(STORIES, port, extra=["--tp", "2", "--pp", "2"] + etcd_args, name="coordinator3")
        wait_ready(co, 60)
        check("taking it over" in P.log("coordinator3"), "coordinator3: %s" % P.log("coordinator3")[-500:])
        rc, _, ids, err = generate("tcp://127.0.0.1:%d" % port, PROMPT, 24)
        check(rc == 0 and ids == expect, "after the crash: %s" % err)
        counts = [loads(P, "w%d" % i) for i in range(4)]
        print("  shard loads per worker over three coordinators: %s" % counts)
        check(counts == [1, 1, 1, 1], "a worker loaded its shard again: %s" % counts)
        for name in ("coordinator2", "coordinator3"):
            check(P.log(name).count("loaded its shard") == 4, "%s did not form the grid" % name)


def test_restarted_worker_takes_its_etcd_key():
    # D4: a worker restarted with the same id within its lease TTL takes over
    # the key its dead predecessor left; a second live process with that id waits
    with Etcd() as etcd, Procs() as P:
        etcd_args = ["--etcd", etcd.url, "--cluster", "d4"]
        port = free_port_pair()
        co = P.coordinator(STORIES, port, extra=etcd_args)
        wargs = [os.path.join(BIN, "loom-worker"), "--threads", "1", "--id", "w0", "--etcd-ttl", "30"] + etcd_args
        w = P.start("w0", wargs)
        wait_ready(co)
        w.kill()
        w.wait()
        w = P.start("w0b", wargs)
        wait_for(lambda: P.log("coordinator").count("grid ready") >= 2 or w.poll() is not None, 30,
                 "the restarted worker to join")
        check(w.poll() is None, "the restarted worker exited: %s" % P.log("w0b")[-500:])
        check("taking it over" in P.log("w0b"), "no takeover logged: %s" % P.log("w0b")[-500:])
        rc, _, ids, err = generate("tcp://127.0.0.1:%d" % port, PROMPT, 8)
        check(rc == 0 and ids, "after the takeover: %s" % err)
        twin = P.start("w0c", wargs)
        wait_for(lambda: "waiting for its lease to expire" in P.log("w0c") or twin.poll() is not None, 15,
                 "the twin to wait")
        check(twin.poll() is None and "waiting for its lease" in P.log("w0c"), "the twin: %s" % P.log("w0c")[-500:])
        twin.send_signal(signal.SIGTERM)
        twin.wait(timeout=10)
        check(w.poll() is None, "the serving worker exited")


def test_worker_says_it_waits():
    # a worker whose coordinator is not there says so every few seconds, with
    # the address, and joins once one starts there
    port = free_port_pair()
    # the control port stays bound (not listening: connects are refused) while
    # the worker waits, so no test running beside this one picks it for its own
    # coordinator, whose grid this worker would then join
    hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hold.bind(("127.0.0.1", port + 1))
    with Procs() as P:
        P.worker("w0", port)
        addr = "waiting for a coordinator at tcp://127.0.0.1:%d" % (port + 1)
        wait_for(lambda: P.log("w0").count(addr) >= 2, 20, "two waiting lines with the address")
        hold.close()
        # the API port is picked now: one picked 10 s ago may have been taken since
        api = free_port_pair()
        co = P.coordinator(STORIES, port, api_port=api)
        wait_ready(co, 30)
        rc, _, ids, err = generate("tcp://127.0.0.1:%d" % api, PROMPT, 8)
        check(rc == 0 and ids, "after the late start: %s" % err)


if __name__ == "__main__":
    os.makedirs(WORK, exist_ok=True)
    run_tests([test_sigterm_drains, test_shutdown_timeout_cuts_streams, test_second_signal_exits_at_once,
               test_workers_survive_coordinator_restart, test_workers_follow_coordinator_through_etcd,
               test_fast_restart_after_aborts_serves, test_restart_keeps_every_shard_2x2_etcd,
               test_restarted_worker_takes_its_etcd_key, test_worker_says_it_waits])
