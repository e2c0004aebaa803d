"""etcd with TLS client certificates and v3 auth: a real etcd started with
--client-cert-auth and auth enabled (certificates made here with openssl),
a coordinator and a worker that find each other through it, and the errors
of a wrong password, a missing, foreign or expired client certificate, an
unknown CA and an expired server certificate, each naming what was refused
while the cluster keeps serving."""
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BIN, STORIES, check, free_port_pair, run_tests, wait_for  # noqa: E402


def openssl(*args, cwd):
    p = subprocess.run(["openssl"] + list(args), cwd=cwd, capture_output=True, text=True, timeout=60)
    check(p.returncode == 0, "openssl %s: %s" % (" ".join(args), p.stderr[-500:]))


def make_ca(d, name):
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=%s" % name,
            "-keyout", name + ".key", "-out", name + ".pem", cwd=d)


def make_cert(d, ca, name, subject, ext, days="2"):
    with open(os.path.join(d, name + ".ext"), "w") as f:
        f.write(ext)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", name + ".key",
            "-out", name + ".csr", cwd=d)
    openssl("x509", "-req", "-in", name + ".csr", "-CA", ca + ".pem", "-CAkey", ca + ".key", "-CAcreateserial",
            "-days", days, "-extfile", name + ".ext", "-out", name + ".pem", cwd=d)


class SecureEtcd:
    def __init__(self, d, server="server", data="data"):
        self.d = d
        port = free_port_pair()
        self.url = "https://127.0.0.1:%d" % port
        peer = "http://127.0.0.1:%d" % (port + 1)
        self.proc = subprocess.Popen(
            [shutil.which("etcd") or "/usr/bin/etcd", "--name", "sec", "--data-dir", os.path.join(d, data),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", "sec=" + peer,
             "--cert-file", os.path.join(d, server + ".pem"), "--key-file", os.path.join(d, server + ".key"),
             "--client-cert-auth", "--trusted-ca-file", os.path.join(d, "ca.pem"), "--logger=zap",
             "--log-level=error"], stdout=subprocess.DEVNULL, stderr=open(os.path.join(d, "etcd.log"), "w"))
        self.tls = ["--cacert", os.path.join(d, "ca.pem"), "--cert", os.path.join(d, "client.pem"),
                    "--key", os.path.join(d, "client.key")]
        # an expired server certificate is what a client must refuse: wait with -k then
        insecure = ["-k"] if server != "server" else []
        wait_for(lambda: '"health":"true"' in subprocess.run(
            ["curl", "-s", "-m", "1", self.url + "/health"] + insecure + self.tls, capture_output=True,
            text=True).stdout, 20, "the TLS etcd to be healthy")

    def ctl(self, *args):
        env = dict(os.environ, ETCDCTL_API="3")
        p = subprocess.run(["etcdctl", "--endpoints", self.url] + self.tls + list(args), capture_output=True,
                           text=True, timeout=30, env=env)
        check(p.returncode == 0, "etcdctl %s: %s" % (" ".join(args), p.stderr))

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_tls_and_auth():
    if not shutil.which("openssl") or not shutil.which("etcdctl"):
        print("skip test_tls_and_auth: needs openssl and etcdctl (scripts/setup-debian.sh)")
        return
    d = tempfile.mkdtemp(prefix="loom-etcd-sec-")
    procs = []
    etcd = None
    try:
        make_ca(d, "ca")
        make_ca(d, "other-ca")
        make_cert(d, "ca", "server", "/CN=etcd", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
        # no CommonName: etcd's gateway refuses a client certificate that has one
        # when auth is on (it would not be the user), so users come from passwords
        make_cert(d, "ca", "client", "/O=loom", "extendedKeyUsage=clientAuth\n")
        make_cert(d, "other-ca", "stranger", "/O=loom", "extendedKeyUsage=clientAuth\n")
        # valid until yesterday (openssl's negative -days ends before it starts)
        make_cert(d, "ca", "expired", "/O=loom", "extendedKeyUsage=clientAuth\n", days="-1")
        make_cert(d, "ca", "server-expired", "/CN=etcd",
                  "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n", days="-1")
        etcd = SecureEtcd(d)
        etcd.ctl("user", "add", "root", "--new-user-password", "rootpw")
        etcd.ctl("user", "grant-role", "root", "root")
        etcd.ctl("user", "add", "loom", "--new-user-password", "loompw")
        etcd.ctl("role", "add", "loom")
        etcd.ctl("role", "grant-permission", "loom", "--prefix=true", "readwrite", "/loom/")
        etcd.ctl("user", "grant-role", "loom", "loom")
        etcd.ctl("auth", "enable")
        for name, text in (("pw", "loompw\n"), ("badpw", "nope\n")):
            with open(os.path.join(d, name), "w") as f:
                f.write(text)

        def sec(cert="client", pw="pw", ca="ca"):
            out = ["--etcd", etcd.url, "--etcd-user", "loom", "--etcd-password-file", os.path.join(d, pw)]
            if ca:
                out += ["--etcd-cacert", os.path.join(d, ca + ".pem")]
            if cert:
                out += ["--etcd-cert", os.path.join(d, cert + ".pem"), "--etcd-key", os.path.join(d, cert + ".key")]
            return out

        port = free_port_pair()
        ready = os.path.join(d, "ready")
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_ETCD")}
        log = open(os.path.join(d, "coordinator.log"), "w")
        procs.append(subprocess.Popen([os.path.join(BIN, "loom-coordinator"), "--insecure",
                                       "--model", STORIES, "--listen",
                                       "tcp://127.0.0.1:%d" % port, "--control", "tcp://127.0.0.1:%d" % (port + 1),
                                       "--ready-file", ready, "--cluster", "sec"] + sec(),
                                      stdout=subprocess.DEVNULL, stderr=log, env=env))
        wlog = open(os.path.join(d, "worker.log"), "w")
        procs.append(subprocess.Popen([os.path.join(BIN, "loom-worker"), "--threads", "1", "--id", "w0",
                                       "--cluster", "sec"] + sec(), stdout=subprocess.DEVNULL, stderr=wlog, env=env))
        wait_for(lambda: os.path.exists(ready) or any(p.poll() is not None for p in procs), 60,
                 "the grid to form through the TLS + auth etcd")
        check(os.path.exists(ready), "no grid: %s %s" % (open(os.path.join(d, "coordinator.log")).read()[-800:],
                                                          open(os.path.join(d, "worker.log")).read()[-800:]))
        p = subprocess.run([os.path.join(BIN, "loom"), "generate", "--addr", "tcp://127.0.0.1:%d" % port,
                            "--prompt", "Once upon a time", "--max-tokens", "8"], capture_output=True, text=True,
                           timeout=60)
        check(p.returncode == 0, "generate: %s" % p.stderr)
        # each refusal is a clear start-up error naming what was refused
        cases = [
            (sec(pw="badpw"), "refused user 'loom': wrong user name or password"),
            (sec(cert=None), "refused this client's certificate, or needs one"),
            (sec(cert="stranger"), "refused this client's certificate, or needs one"),
            (sec(cert="expired"), ("the etcd client certificate --etcd-cert", "expired on")),
            (sec(ca=None), "refused its TLS certificate"),
            (sec(ca="other-ca"), "refused its TLS certificate"),
        ]
        for args, want in cases:
            p = subprocess.run([os.path.join(BIN, "loom-worker"), "--threads", "1", "--id", "bad",
                                "--cluster", "sec"] + args, capture_output=True, text=True, timeout=60, env=env)
            wants = want if isinstance(want, tuple) else (want,)
            check(p.returncode != 0 and all(w in p.stderr for w in wants), "%s: exit %d: %s (wanted %r)"
                  % (" ".join(args[2:]), p.returncode, p.stderr[-400:], want))
        p = subprocess.run([os.path.join(BIN, "loom-coordinator"), "--insecure",
                            "--model", STORIES, "--listen", "tcp://127.0.0.1:0",
                            "--control", "tcp://127.0.0.1:0", "--cluster", "other"] + sec(pw="badpw"),
                           capture_output=True, text=True, timeout=60, env=env)
        check(p.returncode != 0 and "wrong user name or password" in p.stderr, "coordinator: %s" % p.stderr[-400:])
        # an etcd whose own certificate has expired is refused, naming why
        stale = SecureEtcd(d, server="server-expired", data="data-expired")
        try:
            stale_args = sec()
            stale_args[1] = stale.url
            p = subprocess.run([os.path.join(BIN, "loom-worker"), "--threads", "1", "--id", "bad",
                                "--cluster", "sec"] + stale_args, capture_output=True, text=True, timeout=60, env=env)
            check(p.returncode != 0 and "refused its TLS certificate" in p.stderr and "expired" in p.stderr,
                  "expired etcd server certificate: exit %d: %s" % (p.returncode, p.stderr[-400:]))
        finally:
            stale.stop()
        p = subprocess.run([os.path.join(BIN, "loom"), "health", "--addr", "tcp://127.0.0.1:%d" % port],
                           capture_output=True, text=True, timeout=30)
        check(p.returncode == 0 and "ready" in p.stdout + p.stderr, "not serving after the refusals: %s" % p.stderr)
        check(all(p.poll() is None for p in procs), "a process of the cluster exited")
        # the coordinator's watch and both keepers authenticate too: no etcd warnings,
        # and the worker's key under the coordinator's watched prefix was seen
        clog = open(os.path.join(d, "coordinator.log")).read()
        wlog_text = open(os.path.join(d, "worker.log")).read()
        for name, text in (("coordinator", clog), ("worker", wlog_text)):
            check("etcd watch on" not in text and "etcd keeper for" not in text and "publish the plan" not in text,
                  "%s: etcd trouble: %s" % (name, text[-800:]))
        check("membership: etcd https://" in clog, "the coordinator did not use the TLS etcd: %s" % clog[-800:])
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        if etcd:
            etcd.stop()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    run_tests([test_tls_and_auth])
