"""Several hosts on one machine: network namespaces joined by veth pairs to a
bridge (itself in a namespace of its own), addresses in 10.x. etcd, the
coordinator, each worker and the client each run in their own namespace;
the workers' data plane is TCP across them. Mid-stream a whole host is cut
off (its link goes down): its worker stops answering, the coordinator loses
it after the heartbeat timeout, the spare on a third host takes its place,
and the stream ends with the tokens of an uninterrupted run (the failure
semantics of DESIGN.md: the coordinator holds every sequence's tokens).
When the link comes back, the cut-off worker stands by as the new spare.

Needs root and `ip netns`; without them it prints "skipped: needs root and
ip netns" and exits 77 (ctest's SKIP_RETURN_CODE). Every namespace it made
is deleted on the way out, also when the test fails."""
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BIN, Failure, check, gen_model, run_local, run_tests, sanitizer_reports, wait_for  # noqa: E402

WORK = os.environ.get("LOOM_TEST_WORK", "/tmp/loom-it-netns")
SKIP = 77
PROMPT = "Once upon a time"


def sh(*argv, check_rc=True):
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check_rc and p.returncode != 0:
        raise RuntimeError("%s: %s" % (" ".join(argv), p.stderr.strip()))
    return p


def netns_usable():
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    name = "lnt-probe-%d" % os.getpid()
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        return False
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return True


class Net:
    """Hosts as namespaces on one bridge; processes in them; all removed on exit."""

    def __init__(self, hosts):
        tag = "%d" % (os.getpid() % 100000)
        self.prefix = "lnt%s-" % tag
        self.subnet = "10.%d.%d" % (random.randint(100, 250), random.randint(0, 250))
        self.hosts = {h: "%s.%d" % (self.subnet, i + 1) for i, h in enumerate(hosts)}
        self.sw = self.prefix + "sw"
        self.made = []
        self.procs = {}
        self.dir = tempfile.mkdtemp(prefix="loom-netns-")

    def ns(self, host):
        return self.prefix + host

    def __enter__(self):
        try:
            for n in [self.sw] + [self.ns(h) for h in self.hosts]:
                sh("ip", "netns", "add", n)
                self.made.append(n)
                sh("ip", "-n", n, "link", "set", "lo", "up")
            sh("ip", "-n", self.sw, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.sw, "link", "set", "br0", "up")
            for h, addr in self.hosts.items():
                port = "v-" + h
                sh("ip", "-n", self.sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns",
                   self.ns(h))
                sh("ip", "-n", self.sw, "link", "set", port, "master", "br0")
                sh("ip", "-n", self.sw, "link", "set", port, "up")
                sh("ip", "-n", self.ns(h), "addr", "add", addr + "/24", "dev", "eth0")
                sh("ip", "-n", self.ns(h), "link", "set", "eth0", "up")
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for n in reversed(self.made):
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=30)
        self.made = []
        reports = [r for r in sanitizer_reports(self.dir) if r != "etcd.log"]
        if exc[0] is not None or reports:
            for name in sorted(self.procs):
                sys.stderr.write("---- %s\n%s\n" % (name, self.log(name)[-2500:]))
        shutil.rmtree(self.dir, ignore_errors=True)
        if exc[0] is None and reports:
            raise Failure("sanitizer reports in %s" % ", ".join(reports))
        return False

    def start(self, name, host, argv):
        with open(os.path.join(self.dir, name + ".log"), "a") as log:
            # `ip netns exec` execs argv: the pid is the process's own
            self.procs[name] = subprocess.Popen(["ip", "netns", "exec", self.ns(host)] + argv,
                                                stdout=subprocess.DEVNULL, stderr=log)
        return self.procs[name]

    def run(self, host, argv, timeout):
        return subprocess.run(["ip", "netns", "exec", self.ns(host)] + argv, capture_output=True, text=True,
                              timeout=timeout)

    def log(self, name):
        try:
            with open(os.path.join(self.dir, name + ".log")) as f:
                return f.read()
        except OSError:
            return ""

    def link(self, host, up):
        sh("ip", "-n", self.sw, "link", "set", "v-" + host, "up" if up else "down")



def ids_of(err):
    return [int(x) for line in err.splitlines() if line.startswith("ids:") for x in line[4:].split()]


def test_host_cut_off_mid_stream():
    model = gen_model(os.path.join(WORK, "slow"), "--dim", "256", "--hidden-dim", "768", "--layers", "8",
                      "--heads", "8", "--kv-heads", "4", "--vocab", "512", "--max-pos", "4096", "--seed", "3")
    n = 600
    expect = run_local(model, PROMPT, n, extra=["--ignore-eos"])[1]
    etcd_bin = shutil.which("etcd") or "/usr/bin/etcd"
    check(os.path.exists(etcd_bin), "etcd is not installed (sudo apt-get install etcd-server)")
    with Net(["etcd", "coord", "a", "b", "c", "client"]) as net:
        H = net.hosts
        etcd_url = "http://%s:2379" % H["etcd"]
        net.start("etcd", "etcd", [etcd_bin, "--name", "lnt", "--data-dir", os.path.join(net.dir, "etcd"),
                                   "--logger=zap", "--log-level=error", "--listen-client-urls", etcd_url,
                                   "--advertise-client-urls", etcd_url, "--listen-peer-urls",
                                   "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
                                   "--initial-cluster", "lnt=http://127.0.0.1:2380", "--heartbeat-interval=10",
                                   "--election-timeout=50"])
        wait_for(lambda: net.run("coord", ["curl", "-s", "-m", "1", etcd_url + "/health"], 5).stdout.find(
            "true") >= 0, 15, "etcd to be healthy")
        ready = os.path.join(net.dir, "ready")
        addr = "tcp://%s:5555" % H["coord"]
        # both ZeroMQ planes keyed, as across real hosts (docs/operations.md#security)
        keys = os.path.join(net.dir, "keys")
        loom = os.path.join(BIN, "loom")
        subprocess.run([loom, "keygen", "--cluster", "--dir", keys, "--clients", "1"], check=True,
                       capture_output=True, timeout=30)
        for h in ["a", "b", "c"]:
            subprocess.run([loom, "keygen", "--name", h, "--dir", keys, "--allow", os.path.join(keys, "workers.allow")],
                           check=True, capture_output=True, timeout=30)
        coord_keys = ["--curve-secret", os.path.join(keys, "coordinator.key"),
                      "--worker-keys", os.path.join(keys, "workers.allow"),
                      "--client-keys", os.path.join(keys, "clients.allow")]

        def wkeys(h):
            return ["--curve-server-key", os.path.join(keys, "coordinator.pub"),
                    "--curve-secret", os.path.join(keys, h + ".key")]
        member = ["--etcd", etcd_url, "--cluster", "netns"]
        # a small KV pool: a spare's join is then the control plane's time, not a GB of KV memory being cleared
        net.start("coordinator", "coord", [os.path.join(BIN, "loom-coordinator"), "--model", model, "--pp", "2",
                                           "--comm", "tcp", "--num-kv-blocks", "512", "--listen", addr, "--control",
                                           "tcp://%s:5556" % H["coord"], "--ready-file", ready] + member
                  + coord_keys)
        for h in ["a", "b"]:
            net.start("worker-" + h, h, [os.path.join(BIN, "loom-worker"), "--id", h, "--threads", "1",
                                          "--data-host", H[h]] + member + wkeys(h))
        wait_for(lambda: os.path.exists(ready), 60, "the grid to form")
        net.start("worker-c", "c", [os.path.join(BIN, "loom-worker"), "--id", "c", "--threads", "1",
                                     "--data-host", H["c"]] + member + wkeys("c"))
        wait_for(lambda: "standing by" in net.log("worker-c"), 20, "the spare on host c to stand by")
        log = net.log("coordinator")
        check("data plane tcp" in log, "the data plane is not tcp: %s" % log[-800:])
        check("tcp://%s:" % H["a"] in log and "tcp://%s:" % H["b"] in log, "workers not on their hosts")

        client = ["ip", "netns", "exec", net.ns("client"), os.path.join(BIN, "loom"), "generate", "--addr", addr,
                  "--prompt", PROMPT, "--temperature", "0", "--ignore-eos", "--ids", "--timeout-ms", "60000",
                  "--curve-server-key", os.path.join(keys, "coordinator.pub"),
                  "--curve-secret", os.path.join(keys, "client-0.key")]
        # another host that claims worker a's id without a key sees nothing
        hj = subprocess.run(["ip", "netns", "exec", net.ns("client"), os.path.join(BIN, "..", "tests", "hijack"),
                             "--control", "tcp://%s:5556" % H["coord"], "--id", "a", "--seconds", "2", "--silent"],
                            capture_output=True, text=True, timeout=60)
        check(hj.returncode == 0 and hj.stdout.startswith("hijack: 0 message(s), 0 step plan(s)"),
              "a keyless peer on another host: %s %s" % (hj.stdout, hj.stderr))
        stream = subprocess.Popen(client + ["--max-tokens", str(n)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(0.5)
            check(stream.poll() is None, "the stream ended before the cut")
            t_cut = time.time()
            net.link("b", up=False)  # host b is cut off: no FIN, no RST, just silence
            out, err = stream.communicate(timeout=90)
        finally:
            if stream.poll() is None:
                stream.kill()
                stream.wait()
        t_done = time.time()
        check(stream.returncode == 0, "the stream did not survive host b's cut: %s" % err[-400:])
        check(ids_of(err) == expect, "after the cut the ids differ from an uninterrupted run")
        log = net.log("coordinator")
        check("worker c registered" in log and "grid restored" in log, "no failover in the log: %s" % log[-1500:])
        t = {}
        for line in log.splitlines():
            for name, mark in (("lost", "missed heartbeats"), ("spare", "worker c registered"),
                               ("ready", "grid restored")):
                if name not in t and mark in line:
                    hh, mm, ss = line.split()[0].split(":")
                    t[name] = int(hh) * 3600 + int(mm) * 60 + float(ss)
        cut = t_cut % 86400
        print("  host b cut off: lost after %.2f s, spare registered at %.2f s, serving again at %.2f s; the stream "
              "finished %.2f s after the cut with the uninterrupted ids"
              % (t["lost"] - cut, t["spare"] - cut, t["ready"] - cut, t_done - t_cut))
        p = subprocess.run(client + ["--max-tokens", "16"], capture_output=True, text=True, timeout=60)
        check(p.returncode == 0 and ids_of(p.stderr) == expect[:16], "a new request after the cut: %s" % p.stderr)
        # host b comes back: its worker finds the grid full and stands by as the new spare
        net.link("b", up=True)
        t_up = time.time()
        wait_for(lambda: "standing by" in net.log("worker-b"), 20, "worker b to stand by after the link came back")
        print("  host b back after %.1f s cut off: its worker stands by %.2f s later" % (t_up - t_cut, time.time() - t_up))
        check(net.procs["worker-b"].poll() is None, "worker b exited")


if __name__ == "__main__":
    if not netns_usable():
        print("skipped: needs root and ip netns")
        sys.exit(SKIP)
    os.makedirs(WORK, exist_ok=True)
    run_tests([test_host_cut_off_mid_stream])
