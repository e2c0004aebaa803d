"""Security of a launched cluster with its defaults: a peer that claims a
worker's id on the control port (no key, a key of another cluster, a key of
this cluster under another name) sees no step plan and changes no token;
with client keys, a client without an allowed key gets no answer; bad keys
are clear errors; a capture of the loopback traffic holds no prompt text."""
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BIN, Cluster, STORIES, check, generate, kill, run_local, run_tests, wait_for  # noqa: E402

HIJACK = os.path.join(BIN, "..", "tests", "hijack")
LOOM = os.path.join(BIN, "loom")
PROMPT = "Once upon a time"


def keygen_cluster(d, workers=1, clients=0):
    p = subprocess.run([LOOM, "keygen", "--cluster", "--dir", d, "--workers", str(workers), "--clients",
                        str(clients)], capture_output=True, text=True, timeout=30)
    check(p.returncode == 0, "loom keygen --cluster failed: %s" % p.stderr)


def hijack(ctl, ident, keys=(), seconds=4, silent=False):
    return subprocess.Popen([HIJACK, "--control", ctl, "--id", ident, "--seconds", str(seconds)] + list(keys)
                            + (["--silent"] if silent else []),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def hijack_counts(p):
    out, err = p.communicate(timeout=60)
    check(p.returncode == 0, "hijack failed: %s" % err)
    words = out.split()
    # "hijack: N message(s), M step plan(s), K token(s) chosen (...)"
    return int(words[1]), int(words[3])


def attack_during_stream(c, ident, keys, expect, silent=False):
    """One attack while a stream runs: returns (messages, plans) the attacker got."""
    h = hijack("tcp://127.0.0.1:%d" % (c.port + 1), ident, keys, silent=silent)
    time.sleep(0.7)  # connected and registering before the request starts
    rc, _, ids, err = c.generate(PROMPT, 32, extra=["--ignore-eos"])
    msgs, plans = hijack_counts(h)
    check(rc == 0, "generate during the attack as %s: %s" % (ident, err))
    check(ids == expect, "the attack as %s changed the tokens: %s, expected %s" % (ident, ids, expect))
    return msgs, plans


def test_control_plane_hijack_is_refused():
    expect = run_local(STORIES, PROMPT, 32, extra=["--ignore-eos"])[1]
    other = tempfile.mkdtemp(prefix="loom-other-")
    try:
        keygen_cluster(other, 2)
        with Cluster(STORIES, 1, 1) as c:
            keys = os.path.join(c.run_dir, "keys")
            ours_pub = os.path.join(keys, "coordinator.pub")
            attacks = [
                ("no key", "worker-0", []),
                ("a worker key of another cluster", "worker-0",
                 ["--curve-server-key", ours_pub, "--curve-secret", os.path.join(other, "worker-0.key")]),
                ("another cluster's keys", "worker-0",
                 ["--curve-server-key", os.path.join(other, "coordinator.pub"),
                  "--curve-secret", os.path.join(other, "worker-0.key")]),
            ]
            for what, ident, k in attacks:
                for silent in (False, True):
                    msgs, plans = attack_during_stream(c, ident, k, expect, silent)
                    check(msgs == 0 and plans == 0, "%s%s: the peer got %d message(s), %d plan(s)"
                          % (what, " (silent)" if silent else "", msgs, plans))
            # a key this cluster trusts, but named otherwise: it may not speak as
            # worker-0 (its connection is refused: no handover) nor under a free id
            intruder = c.worker_keys("intruder")
            for ident, silent in (("worker-0", True), ("worker-0", False), ("worker-7", False)):
                msgs, plans = attack_during_stream(c, ident, intruder, expect, silent)
                check(plans == 0 and msgs == 0,
                      "an allowed key named 'intruder' speaking as %s got %d message(s), %d plan(s)"
                      % (ident, msgs, plans))
            log = c.log("coordinator")
            check("refused a worker connection from 127.0.0.1" in log, "no refusal with the address in the log")
            check("is not in the worker allow-list" in log, "the foreign key's refusal names no reason")
            check("the CURVE handshake failed" in log, "the keyless peer's refusal is not logged")
            check("speaks as 'worker-7' but its key is 'intruder'" in log, "the identity refusal is not logged")
            n = log.count("speaks as 'worker-7' but its key is 'intruder'")
            check(n == 1, "one peer's identity refusals were logged %d times in a few seconds (at most once per "
                          "10 s)" % n)
            rc, out = c.health()
            check(rc == 0 and "ready" in out, "not serving after the attacks: %s" % out)
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_unkeyed_control_plane_is_hijacked():
    """The same attack on --insecure works: the test can fail. Without keys a
    connected worker's routing id is not taken over (no ROUTER_HANDOVER), but
    any peer may take a slot that is free, under any id: here worker-0's, once
    it died."""
    with Cluster(STORIES, 1, 1, launch_args=["--insecure"]) as c:
        kill(c.pid("worker-0"))
        wait_for(lambda: "waiting for a worker to take its place" in c.log("coordinator"), 20, "the slot to free")
        h = hijack("tcp://127.0.0.1:%d" % (c.port + 1), "intruder", seconds=8)
        time.sleep(2)  # registered, "loaded", joined
        generate(c.addr, PROMPT, 32, extra=["--ignore-eos", "--timeout-ms", "3000"], timeout=30)
        msgs, plans = hijack_counts(h)
        check(plans > 0, "the unkeyed control plane was not taken over (%d messages): the attack is broken" % msgs)


def test_client_keys_are_required():
    other = tempfile.mkdtemp(prefix="loom-other-")
    try:
        keygen_cluster(other, 1, 1)
        with Cluster(STORIES, 1, 1, launch_args=["--client-keys", "1"]) as c:
            keys = os.path.join(c.run_dir, "keys")
            pub = os.path.join(keys, "coordinator.pub")
            expect = run_local(STORIES, PROMPT, 8, extra=["--ignore-eos"])[1]
            rc, _, ids, err = generate(c.addr, PROMPT, 8, extra=[
                "--ignore-eos", "--curve-server-key", pub, "--curve-secret", os.path.join(keys, "client-0.key")])
            check(rc == 0 and ids == expect, "a client with its key: %s" % err)
            # the keys by environment, as the library reads them
            env = dict(os.environ, LOOM_CURVE_SERVER_KEY=pub,
                       LOOM_CURVE_SECRET=open(os.path.join(keys, "client-0.key")).read().split("\n")[1])
            p = subprocess.run([LOOM, "health", "--addr", c.addr], capture_output=True, text=True, timeout=30,
                               env=env)
            check(p.returncode == 0 and "ready" in p.stdout + p.stderr, "keys from the environment: %s" % p.stderr)
            for what, extra in [("no key", []),
                                ("another cluster's client key",
                                 ["--curve-server-key", pub, "--curve-secret", os.path.join(other, "client-0.key")]),
                                ("a worker key", ["--curve-server-key", pub,
                                                  "--curve-secret", os.path.join(keys, "worker-0.key")])]:
                rc, _, ids, err = generate(c.addr, PROMPT, 8, extra=["--timeout-ms", "2500"] + extra, timeout=30)
                check(rc != 0 and not ids, "%s: the client was served" % what)
                # told at once (the refused handshake drops the connection) or at its own timeout
                check("UNAVAILABLE" in err, "%s: %s" % (what, err))
            log = c.log("coordinator")
            check("refused a client connection from 127.0.0.1" in log, "client refusals are not logged")
            check("is not in the client allow-list" in log, "the client refusal names no reason")
            rc, _, ids, err = generate(c.addr, PROMPT, 8, extra=[
                "--ignore-eos", "--curve-server-key", pub, "--curve-secret", os.path.join(keys, "client-0.key")])
            check(rc == 0 and ids == expect, "the trusted client after the refusals: %s" % err)
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_bad_keys_are_clear_errors():
    d = tempfile.mkdtemp(prefix="loom-keys-")
    try:
        keygen_cluster(d, 1)
        coord = [os.path.join(BIN, "loom-coordinator"), "--model", STORIES, "--listen", "tcp://127.0.0.1:0",
                 "--control", "tcp://127.0.0.1:0"]
        bad = os.path.join(d, "bad.allow")
        with open(bad, "w") as f:
            f.write("worker-0 not-a-key\n")
        cases = [
            (coord + ["--curve-secret", os.path.join(d, "missing.key"), "--worker-keys", os.path.join(d, "workers.allow")],
             "the coordinator's secret key"),
            (coord + ["--curve-secret", os.path.join(d, "coordinator.key"), "--worker-keys", bad], "bad.allow:1"),
            (coord + ["--curve-secret", os.path.join(d, "coordinator.key")], "--worker-keys"),
            (coord + ["--worker-keys", os.path.join(d, "workers.allow")], "--curve-secret"),
            ([os.path.join(BIN, "loom-coordinator"), "--model", STORIES, "--listen", "tcp://0.0.0.0:0",
              "--control", "tcp://127.0.0.1:0"], "--client-keys"),
            ([os.path.join(BIN, "loom-coordinator"), "--model", STORIES, "--listen", "tcp://127.0.0.1:0",
              "--control", "tcp://0.0.0.0:0"], "--insecure"),
            ([os.path.join(BIN, "loom-worker"), "--coordinator", "tcp://127.0.0.1:1", "--curve-server-key",
              os.path.join(d, "coordinator.pub")], "secret key"),
            ([os.path.join(BIN, "loom-worker"), "--coordinator", "tcp://127.0.0.1:1", "--curve-server-key",
              os.path.join(d, "coordinator.key.nope"), "--curve-secret", os.path.join(d, "worker-0.key")],
             "the server's public key"),
            ([LOOM, "generate", "--addr", "tcp://127.0.0.1:1", "--prompt", "x", "--curve-secret",
              os.path.join(d, "workers.allow"), "--curve-server-key", os.path.join(d, "coordinator.pub")],
             "holds no 40-character Z85 key"),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_CURVE") and "KEYS" not in k}
        for cmd, want in cases:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
            check(p.returncode != 0 and want in p.stderr,
                  "%s: exit %d, stderr %r (wanted %r)" % (" ".join(cmd[1:]), p.returncode, p.stderr[-400:], want))
        # a secret key file readable by others is refused by nobody, but keygen writes 0600
        check(os.stat(os.path.join(d, "worker-0.key")).st_mode & 0o077 == 0, "keygen left a secret key readable")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def coordinator_start_log(args):
    """Starts a hand-made coordinator (no workers) and returns its log once it waits for workers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_CURVE") and "KEYS" not in k}
    p = subprocess.Popen([os.path.join(BIN, "loom-coordinator"), "--model", STORIES, "--listen", "tcp://127.0.0.1:0"]
                         + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = ""
    try:
        for line in p.stdout:
            out += line
            if "waiting for" in line:
                break
    finally:
        p.terminate()
        out += p.communicate(timeout=30)[0]
    return out


def test_unkeyed_control_plane_needs_insecure():
    """A hand-started coordinator with an unkeyed control plane is refused
    (exit 2, before the model is read) without --insecure, on loopback too,
    naming both ways out; with --insecure it starts and says the plane is not
    keyed (loudly off loopback); with keys it starts without the warning."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_CURVE") and "KEYS" not in k}
    for ctl in ("tcp://127.0.0.1:0", "tcp://0.0.0.0:0"):
        p = subprocess.run([os.path.join(BIN, "loom-coordinator"), "--model", STORIES, "--listen",
                            "tcp://127.0.0.1:0", "--control", ctl], capture_output=True, text=True, timeout=60,
                           env=env)
        check(p.returncode == 2, "an unkeyed control plane on %s without --insecure: exit %d, %r"
              % (ctl, p.returncode, p.stderr[-600:]))
        for want in ("--curve-secret FILE --worker-keys FILE", "loom keygen --cluster", "deploy/local/launch.sh",
                     "'loom serve'", "or --insecure to run it unkeyed"):
            check(want in p.stderr, "the refusal on %s does not say %r: %r" % (ctl, want, p.stderr[-600:]))
        check(("not keyed: any process on this host" if "127.0.0.1" in ctl else "which other hosts can reach")
              in p.stderr, "the refusal on %s names no reason: %r" % (ctl, p.stderr[-600:]))
        check("loading" not in p.stderr and "waiting for" not in p.stderr, "refused only after starting: %r"
              % p.stderr[-600:])
    log = coordinator_start_log(["--control", "tcp://0.0.0.0:0", "--insecure"])
    check("*** SECURITY: the control plane binds tcp://0.0.0.0:0 without keys" in log,
          "an unkeyed control plane off loopback with --insecure: %s" % log[-600:])
    log = coordinator_start_log(["--control", "tcp://127.0.0.1:0", "--insecure"])
    check("--insecure: the control plane (tcp://127.0.0.1:0) is not keyed" in log and "waiting for" in log,
          "an unkeyed loopback control plane with --insecure: %s" % log[-600:])
    d = tempfile.mkdtemp(prefix="loom-keys-")
    try:
        keygen_cluster(d, 1)
        log = coordinator_start_log(["--control", "tcp://127.0.0.1:0", "--curve-secret",
                                     os.path.join(d, "coordinator.key"), "--worker-keys",
                                     os.path.join(d, "workers.allow")])
        check("CURVE: control plane keyed" in log and "the control plane (tcp://127.0.0.1:0) is not keyed" not in log
              and "waiting for" in log,
              "a keyed loopback control plane: %s" % log[-600:])
    finally:
        shutil.rmtree(d, ignore_errors=True)


def plain_bytes(payload):
    """Sends payload in clear over a loopback TCP connection of our own."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    cli.sendall(payload)
    conn.recv(len(payload))
    for s in (cli, conn, srv):
        s.close()


def test_loopback_capture_holds_no_prompt_text():
    tcpdump = shutil.which("tcpdump")
    if not tcpdump or os.geteuid() != 0:
        print("skip test_loopback_capture_holds_no_prompt_text: needs tcpdump (scripts/setup-debian.sh) and root")
        return
    marker = "Zorblax%dQuixotic" % random.randint(100000, 999999)
    prompt = "Once upon a time %s met a cat" % marker
    pcap = tempfile.mktemp(suffix=".pcap")
    expect = run_local(STORIES, prompt, 24, extra=["--ignore-eos"])[1]
    with Cluster(STORIES, 2, 1, launch_args=["--client-keys", "1"],
                 coord_args=["--comm", "tcp", "--encrypt-data-plane"]) as c:
        keys = os.path.join(c.run_dir, "keys")
        cap = subprocess.Popen([tcpdump, "-i", "lo", "-U", "-s", "0", "-w", pcap, "tcp"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            line = cap.stderr.readline()  # "listening on lo, ..." once it captures
            check("listening" in line, "tcpdump: %s" % line)
            plain_bytes(b"before " + marker.encode())
            rc, _, ids, err = generate(c.addr, prompt, 24, extra=[
                "--ignore-eos", "--curve-server-key", os.path.join(keys, "coordinator.pub"),
                "--curve-secret", os.path.join(keys, "client-0.key")])
            check(rc == 0 and ids == expect, "the keyed client over an encrypted data plane: %s" % err)
            plain_bytes(b"after " + marker.encode())
            time.sleep(1.0)
        finally:
            cap.send_signal(signal.SIGINT)
            cap.wait(timeout=30)
        with open(pcap, "rb") as f:
            data = f.read()
        os.unlink(pcap)
        # the capture works: the plain bytes sent around the request are in it
        check(b"before " + marker.encode() in data and b"after " + marker.encode() in data,
              "the capture missed the plain control bytes (%d bytes)" % len(data))
        check(data.count(marker.encode()) == 2, "the prompt text crossed loopback in clear")


if __name__ == "__main__":
    run_tests([test_bad_keys_are_clear_errors, test_unkeyed_control_plane_needs_insecure,
               test_control_plane_hijack_is_refused,
               test_unkeyed_control_plane_is_hijacked, test_client_keys_are_required,
               test_loopback_capture_holds_no_prompt_text])
