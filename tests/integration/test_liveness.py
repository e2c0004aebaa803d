"""Liveness that means it: a keyed coordinator paused (SIGSTOP) past the
workers' --coordinator-timeout-ms and resumed serves again (it used to wedge
for good: the workers had left the grid, the coordinator took their new
registrations for retries and waited for step results that never came);
/health reports not ready, with a reason, while the reactor is stalled or no
step completes, and ready again after; a step past its deadline is re-planned.

Timing: the machine is slow and shared, so every wait is a generous deadline
on an event, never a fixed sleep that must be long enough."""
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Cluster, STORIES, check, free_port, kill, open_stream, run_tests, wait_for  # noqa: E402

PROMPT = "Once upon a time"


def health(port, timeout=10):
    """GET /health: (status, body dict, seconds it took)."""
    t0 = time.time()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        body = r.read()
    finally:
        conn.close()
    try:
        doc = json.loads(body)
    except ValueError:
        doc = {"raw": body.decode(errors="replace")}
    return r.status, doc, time.time() - t0


class Load:
    """n client loops, each sending one request after another until stopped;
    every outcome is kept as (end time, return code, last stderr line)."""

    def __init__(self, c, n, max_tokens=300):
        self.c, self.max_tokens, self.stop, self.res = c, max_tokens, False, []
        self.threads = [threading.Thread(target=self.loop) for _ in range(n)]

    def loop(self):
        while not self.stop:
            p = self.c.generate_async(PROMPT, max_tokens=self.max_tokens, extra=["--ignore-eos"])
            try:
                _, err = p.communicate(timeout=120)
                lines = err.strip().splitlines()
                self.res.append((time.time(), p.returncode, lines[-1] if lines else ""))
            except subprocess.TimeoutExpired:  # a wedged request: the failure this test is about
                p.kill()
                p.communicate()
                self.res.append((time.time(), "timeout", "no answer in 120 s"))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        for t in self.threads:
            t.join()
        return False


def served_after(c, t, deadline_s=60):
    """A new request succeeds after time t (retrying the retryable UNAVAILABLE)."""
    end = time.time() + deadline_s
    last = None
    while time.time() < end:
        p = c.generate_async(PROMPT, max_tokens=8)
        _, err = p.communicate(timeout=60)
        if p.returncode == 0:
            return
        last = err.strip()
        check("UNAVAILABLE" in last, "a request after the resume failed with a non-retryable error: %s" % last)
        time.sleep(0.5)
    raise AssertionError("no request succeeded within %d s after the resume: %s" % (deadline_s, last))


def check_outcomes(res, since):
    for t, rc, line in res:
        if t < since:
            continue
        check(rc != "timeout", "a request never ended: %s" % line)
        check("UNAVAILABLE: UNAVAILABLE" not in line, "a doubled status prefix: %s" % line)
        check(rc == 0 or "UNAVAILABLE" in line, "a request failed with a non-retryable error: %s" % line)


def test_pause_keyed_coordinator():
    """SIGSTOP 5.5 s (past the workers' 3 s coordinator timeout) of a keyed
    1x1 coordinator under load, then SIGCONT: nothing wedges."""
    for _ in range(2):  # the wedge depended on which message the resumed reactor read first
        http = free_port()
        with Cluster(STORIES, 1, 1, coord_args=["--http", "127.0.0.1:%d" % http]) as c:
            with Load(c, 4) as load:
                wait_for(lambda: sum(1 for r in load.res if r[1] == 0) >= 2, 60, "requests served before the pause")
                cp = c.pid("coordinator")
                os.kill(cp, signal.SIGSTOP)
                t_pause = time.time()
                time.sleep(5.5)
                os.kill(cp, signal.SIGCONT)
                t_resume = time.time()
                wait_for(lambda: sum(1 for r in load.res if r[0] > t_resume + 1 and r[1] == 0) >= 2, 90,
                         "requests served after the resume (the grid wedged?)")
            check_outcomes(load.res, t_pause)
            served_after(c, t_resume)
            wait_for(lambda: health(http)[0] == 200, 30, "/health ready after the resume")
            log = c.log("coordinator")
            check("left the grid" in log or "missed heartbeats" in log,
                  "the coordinator never noticed that its worker left the grid:\n" + log[-2000:])


def test_health_stalled_reactor():
    """The test hook stalls the reactor 4 s: /health (traffic and probe
    listeners) answers 503 'stalled' at once during it, 200 after."""
    http = free_port(2)
    probe = http + 1
    stall = os.path.join(tempfile.mkdtemp(prefix="loom-stall-"), "stall")
    os.environ["LOOM_TEST_STALL_FILE"] = stall
    try:
        with Cluster(STORIES, 1, 1, coord_args=["--http", "127.0.0.1:%d" % http, "--probe-listen",
                                                 "127.0.0.1:%d" % probe, "--liveness-timeout-ms", "1000"]) as c:
            wait_for(lambda: health(probe)[0] == 200, 30, "/health ready")
            with open(stall + ".tmp", "w") as f:
                f.write("4000")
            os.rename(stall + ".tmp", stall)
            wait_for(lambda: not os.path.exists(stall), 10, "the reactor to take the stall")
            seen = {}
            for port in (probe, http):
                def stalled():
                    st, doc, took = health(port)
                    if st == 503 and doc.get("state") == "stalled":
                        seen[port] = (doc, took)
                        return True
                    return False
                wait_for(stalled, 10, "/health on port %d to say stalled" % port)
            for port, (doc, took) in seen.items():
                check("reactor has not turned" in doc.get("message", ""), "the reason names the reactor: %r" % doc)
                check(took < 2.0, "a stalled /health took %.2f s: it must not wait for the reactor" % took)
            wait_for(lambda: health(probe)[0] == 200, 30, "/health ready again after the stall")
            check("the reactor stalled: a turn took" in c.log("coordinator"), "the stall is logged")
    finally:
        del os.environ["LOOM_TEST_STALL_FILE"]


def test_step_deadline():
    """A worker that stops computing but whose heartbeats are tolerated
    (--heartbeat-timeout-ms 60 s): /health goes not ready ('no step has
    completed') and the step's deadline fails the epoch; after SIGCONT the
    requests complete."""
    http = free_port()
    with Cluster(STORIES, 1, 1, coord_args=["--http", "127.0.0.1:%d" % http, "--heartbeat-timeout-ms", "60000",
                                             "--step-timeout-ms", "2000", "--step-timeout-per-token-us", "0",
                                             "--liveness-timeout-ms", "1000", "--recovery-timeout-ms", "60000"],
                 worker_args=["--coordinator-timeout-ms", "60000"]) as c:
        with Load(c, 2) as load:
            wait_for(lambda: sum(1 for r in load.res if r[1] == 0) >= 1, 60, "requests served")
            wp = c.pid("worker-0")
            os.kill(wp, signal.SIGSTOP)
            t_stop = time.time()
            try:
                msgs = []

                def stalled():
                    doc = health(http)[1]
                    msgs.append(doc.get("message", ""))
                    return doc.get("state") == "stalled"
                wait_for(stalled, 20, "/health to say stalled")
                check("no step has completed" in msgs[-1], "the reason names the steps: %r" % msgs[-1])
                wait_for(lambda: "past its deadline" in c.log("coordinator"), 30, "the step deadline to fire")
                # stopped past the ZMTP heartbeat timeout (2 s on the keyed control socket): the new
                # epoch's Assign is lost with the connection libzmq closes; the grid must notice
                time.sleep(4)
            finally:
                os.kill(wp, signal.SIGCONT)
            t_cont = time.time()
            wait_for(lambda: sum(1 for r in load.res if r[0] > t_cont and r[1] == 0) >= 1, 90,
                     "requests served after the worker resumed")
        check_outcomes(load.res, t_stop)
        served_after(c, t_cont)


def test_stream_ends_with_error_event():
    """The grid fails a streaming request mid-stream (its only worker killed,
    not back within --recovery-timeout-ms): the SSE stream ends with one
    error event, then data: [DONE]."""
    http = free_port()
    with Cluster(STORIES, 1, 1, coord_args=["--http", "127.0.0.1:%d" % http, "--recovery-timeout-ms", "500"]) as c:
        s, got = open_stream(http, {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}, events=3)
        kill(c.pid("worker-0"))
        s.settimeout(60)
        while True:
            b = s.recv(65536)
            if not b:
                break
            got += b
        s.close()
        events = [ln[6:] for ln in got.decode(errors="replace").splitlines() if ln.startswith("data: ")]
        check(events[-1] == "[DONE]", "the stream does not end with [DONE]: %r" % events[-3:])
        if "finish_reason\":\"length" in events[-2]:  # it finished before the kill took effect
            return
        err = json.loads(events[-2]).get("error")
        check(err and "not restored" in err["message"] and err["code"] == "service_unavailable",
              "the last event before [DONE] is not the error: %r" % events[-2])


if __name__ == "__main__":
    run_tests([test_pause_keyed_coordinator, test_health_stalled_reactor, test_step_deadline,
               test_stream_ends_with_error_event])
