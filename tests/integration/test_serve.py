"""`loom serve`: one command that starts and supervises a coordinator and its
workers. On stories260K with --tensor-parallel-size 2 it answers the official
OpenAI SDK, restarts a worker that dies, stops every child on SIGTERM, and its
children go too when it is killed with SIGKILL; vLLM's flag names work, and bad
input (an unknown flag, a vLLM flag Loom lacks, a bad model dir) is refused.
Also: every binary refuses a CPU without the build's instruction sets
(LOOM_CPU_PRETEND_MISSING pretends one is missing).
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import BIN, ROOT, STORIES, Failure, check, kill, run_tests, wait_for  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LOOM = os.path.join(BIN, "loom")
KEY = "serve-test-key"


def free_port():
    return harness.free_port()


def alive(pid):
    """pid is a live process (a zombie is not)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children(pid):
    """{pid: argv0 basename} of pid's live child processes, from /proc."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != pid or fields[0] == "Z":
                continue
            with open("/proc/%s/cmdline" % d, "rb") as f:
                argv0 = f.read().split(b"\0")[0].decode()
            out[int(d)] = os.path.basename(argv0)
        except (OSError, IndexError, ValueError):
            pass
    return out


def http(port, method, path, body=None, key=KEY, timeout=60):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), method=method,
                                 data=json.dumps(body).encode() if body is not None else None)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", "Bearer " + key)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except (urllib.error.URLError, ConnectionError, socket.timeout):
        return None, None


class Serve:
    """`loom serve` as a child of the test; log in a file, always stopped."""

    def __init__(self, *args, model=STORIES, env=None):
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="loom-serve-it-")
        self.log_path = os.path.join(self.dir, "serve.log")
        self.args = [LOOM, "serve", model, "--port", str(self.port)] + list(args)
        self.env = dict(os.environ, **(env or {}))
        self.proc = None

    def __enter__(self):
        self.log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, stdout=self.log_file, stderr=subprocess.STDOUT, env=self.env)
        return self

    def wait_ready(self, timeout=120):
        def ready():
            check(self.proc.poll() is None, "loom serve exited (%s): %s" % (self.proc.returncode, self.log()[-3000:]))
            return "OpenAI API at" in self.log()
        wait_for(ready, timeout, "loom serve to be ready")

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def __exit__(self, *exc):
        pids = list(children(self.proc.pid)) if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for p in pids:
            kill(p)
        self.log_file.close()
        log = self.log()
        sanitizer = "ERROR: AddressSanitizer" in log or "ERROR: LeakSanitizer" in log or "runtime error:" in log
        if exc[0] is not None or sanitizer:
            sys.stderr.write("---- loom serve log\n%s\n" % log[-4000:])
        shutil.rmtree(self.dir, ignore_errors=True)
        if exc[0] is None and sanitizer:
            raise Failure("a sanitizer report in the log of loom serve and its children")
        return False


def loom(*args, env=None, timeout=60):
    return subprocess.run([LOOM] + list(args), capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def test_bad_input():
    p = loom("serve", STORIES, "--frobnicate")
    check(p.returncode == 2 and "unknown option '--frobnicate'" in p.stderr, "unknown flag: %d %r" % (p.returncode, p.stderr))
    p = loom("serve", STORIES, "--gpu-memory-utilization", "0.9")
    check(p.returncode == 2 and "vLLM flag --gpu-memory-utilization is not supported by Loom" in p.stderr,
          "vLLM flag: %d %r" % (p.returncode, p.stderr))
    p = loom("serve", STORIES, "-dp", "2")
    check(p.returncode == 2 and "vLLM flag -dp is not supported by Loom" in p.stderr, "-dp: %r" % p.stderr)
    bad = tempfile.mkdtemp(prefix="loom-serve-bad-")
    try:
        p = loom("serve", bad)
        check(p.returncode == 2 and "config.json not found" in p.stderr, "empty dir: %d %r" % (p.returncode, p.stderr))
    finally:
        shutil.rmtree(bad)
    p = loom("serve", "/nonexistent/model")
    check(p.returncode == 2 and "config.json not found" in p.stderr, "missing dir: %r" % p.stderr)
    p = loom("serve")
    check(p.returncode == 2 and "needs a model directory" in p.stderr, "no model: %r" % p.stderr)
    p = loom("serve", STORIES, "--enable-prefix-caching", "--no-enable-prefix-caching")
    check(p.returncode == 2 and "contradict" in p.stderr, "both prefix flags: %r" % p.stderr)
    # a value the coordinator refuses: serve exits 2 with the coordinator's message, no child left
    with Serve("--kv-cache-dtype", "nonsense") as s:
        try:
            rc = s.proc.wait(60)
        except subprocess.TimeoutExpired:
            rc = None
        check(rc == 2, "a refused --kv-cache-dtype: exit %r" % rc)
        check("--kv-cache-dtype must be" in s.log(), "no coordinator message: %s" % s.log()[-1500:])
    junk = tempfile.NamedTemporaryFile("w", suffix=".jinja", delete=False)
    junk.write("{% for m in messages %}\n{{ m }")  # a syntax error: start-up refused naming where
    junk.close()
    try:
        with Serve("--chat-template", junk.name) as s:
            rc = s.proc.wait(60)
            # (compiled when the gateway starts: the coordinator exits 1, and serve with it)
            check(rc not in (0, None) and junk.name + ":2:" in s.log(), "a broken template: %r %s" % (
                rc, s.log()[-800:]))
    finally:
        os.unlink(junk.name)
    p = loom("serve", "--help")
    check(p.returncode == 0, "serve --help failed")
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--served-model-name", "--quantization", "--kv-cache-dtype", "--api-key",
                 "--enable-prefix-caching", "--no-enable-prefix-caching", "--block-size", "--seed", "--chat-template",
                 "--generation-config", "--uvicorn-log-level", "--host", "--port"):
        check(flag + " " in p.stdout, "serve --help lacks %s" % flag)


def test_serve_tp2_sdk_restart_sigterm():
    """The main run: tp 2, the OpenAI SDK, generation_config defaults, a worker restart, SIGTERM."""
    gen_dir = tempfile.mkdtemp(prefix="loom-serve-gen-")
    with open(os.path.join(gen_dir, "generation_config.json"), "w") as f:
        json.dump({"temperature": 0.0, "max_new_tokens": 5}, f)
    chat_file = os.path.join(gen_dir, "chat.jinja")  # --chat-template FILE: a ChatML template
    with open(chat_file, "w") as f:
        f.write("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    zmq_port = free_port()
    try:
        with Serve("--tensor-parallel-size", "2", "--chat-template", chat_file, "--api-key", KEY,
                   "--served-model-name", "tiny", "--generation-config", gen_dir, "--seed", "1234",
                   "--zmq-listen", "127.0.0.1:%d" % zmq_port, "--max-num-seqs", "8") as s:
            s.wait_ready()
            kids = children(s.proc.pid)
            names = sorted(kids.values())
            check("chat template: " + chat_file in s.log(), "the template file was not announced")
            for pid in kids:
                with open("/proc/%d/cmdline" % pid, "rb") as f:
                    check(KEY.encode() not in f.read(), "the API key is on a child's command line")
            # loading progress as log lines (not a terminal): bytes and percent, per TP rank
            for rank in ("tp rank 0/2", "tp rank 1/2"):
                check(any(rank in l and "MB (100%)" in l for l in s.log().splitlines()),
                      "no loading progress line for %s" % rank)
            check("\r" not in s.log(), "a refreshed terminal line in a log file")
            check(names == ["loom-coordinator", "loom-worker", "loom-worker"], "children %r" % kids)
            # the internal control plane is keyed with this run's own keys (secure by default)
            check("CURVE: control plane keyed" in s.log(), "the control plane is not keyed")
            for w in ("worker-0", "worker-1"):
                check("worker %s: control plane: CURVE" % w in s.log(), "%s did not connect with its key" % w)
            keys_dirs = set()
            for pid in kids:
                with open("/proc/%d/cmdline" % pid, "rb") as f:
                    argv = f.read().split(b"\0")
                for i, a in enumerate(argv[:-1]):
                    if a == b"--curve-secret":
                        keys_dirs.add(os.path.dirname(argv[i + 1].decode()))
            check(len(keys_dirs) == 1, "not one key set for the run: %r" % keys_dirs)
            keys_dir = keys_dirs.pop()
            check(os.stat(keys_dir).st_mode & 0o077 == 0, "the key directory is readable by others")
            # the first request: a seeded sampling run (compared with the SIGKILL run's)
            st, seeded = http(s.port, "POST", "/v1/completions",
                              {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0})
            check(st == 200, "seeded request: %r %r" % (st, seeded))
            # generation_config defaults: no temperature, no max_tokens -> greedy, 5 tokens
            st, d = http(s.port, "POST", "/v1/completions", {"prompt": "Once upon a time"})
            check(st == 200 and d["usage"]["completion_tokens"] == 5, "defaults: %r %r" % (st, d))
            st, g = http(s.port, "POST", "/v1/completions",
                         {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0})
            check(st == 200 and g["choices"][0]["text"] == d["choices"][0]["text"],
                  "defaults are not greedy: %r vs %r" % (d, g))
            st, _ = http(s.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}, key=None)
            check(st == 401, "--api-key not enforced: %r" % st)
            # the scheme-less --zmq-listen address serves the loom.v1 API
            p = loom("health", "--addr", "127.0.0.1:%d" % zmq_port, "--api-key", KEY)
            check(p.returncode == 0, "loom health on the ZeroMQ API: %s" % (p.stdout + p.stderr))
            # the official OpenAI SDK
            spec = {"prompt": "Once upon a time", "messages": [{"role": "user", "content": "Hi there"}],
                    "max_tokens": 16, "seed": 7}
            p = subprocess.run(["node", os.path.join(HERE, "openai_client.mjs"), "http://127.0.0.1:%d/v1" % s.port,
                                KEY, json.dumps(spec)], capture_output=True, text=True, timeout=180)
            check(p.returncode == 0, "the OpenAI SDK client failed: %s" % (p.stderr[-2000:] or p.stdout[-500:]))
            out = json.loads(p.stdout)
            check(out["models"] == ["tiny"], "models %r" % out["models"])
            check(out["completion"]["usage"]["completion_tokens"] == 16, "completion %r" % out["completion"])
            check(out["completion_stream"]["text"] == out["completion"]["text"], "stream != non-stream")
            check(out["chat"]["content"] == out["chat_stream"]["text"] and out["chat"]["role"] == "assistant",
                  "chat stream != chat: %r" % out["chat"])
            check(out["seeded_same"], "the same seed gave different texts")
            check(out["err_key"]["status"] == 401, "wrong key: %r" % out["err_key"])
            # a worker that dies is restarted and the grid serves again
            victim = [p for p, n in kids.items() if n == "loom-worker"][0]
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda: "restarting it" in s.log(), 30, "the restart of the killed worker")

            def restarted():
                k = children(s.proc.pid)
                return victim not in k and sorted(k.values()) == names
            wait_for(restarted, 30, "a new worker process")
            deadline = time.time() + 90
            while True:
                st, d2 = http(s.port, "POST", "/v1/completions",
                              {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0})
                if st == 200 or time.time() > deadline:
                    break
                time.sleep(0.5)
            check(st == 200 and d2["choices"][0]["text"] == g["choices"][0]["text"],
                  "after the restart: %r %r" % (st, d2))
            # SIGTERM: every child stops, serve exits 0, nothing is left
            kids = children(s.proc.pid)
            t0 = time.time()
            s.proc.send_signal(signal.SIGTERM)
            rc = s.proc.wait(90)
            print("  SIGTERM: loom serve and its %d children gone in %.2f s" % (len(kids), time.time() - t0))
            check(rc == 0, "loom serve exited %d after SIGTERM" % rc)
            left = [p for p in kids if alive(p)]
            check(not left, "children left after SIGTERM: %r" % left)
            log = s.log()
            check("coordinator exited with status 0" in log, "the coordinator did not stop cleanly")
            check(log.count("exited with status 0") >= 3, "not every child stopped cleanly: %s" % log[-2000:])
            check(not os.path.exists(keys_dir), "the run's keys outlived it: %s" % keys_dir)
            return seeded["choices"][0]["text"]
    finally:
        shutil.rmtree(gen_dir, ignore_errors=True)


SEEDED = {}


def test_main_run():
    SEEDED["first"] = test_serve_tp2_sdk_restart_sigterm()


def test_sigkill_leaves_no_orphan():
    """SIGKILL of loom serve: the children (now orphans) exit on their own; --seed repeats the first run."""
    with Serve("-tp", "2", "--seed", "1234", "--uvicorn-log-level", "warning", "--no-enable-prefix-caching") as s:
        s.wait_ready()
        st, seeded = http(s.port, "POST", "/v1/completions",
                          {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0}, key=None)
        check(st == 200, "request: %r %r" % (st, seeded))
        if "first" in SEEDED:
            check(seeded["choices"][0]["text"] == SEEDED["first"],
                  "--seed 1234 did not repeat: %r vs %r" % (seeded["choices"][0]["text"], SEEDED["first"]))
        check(" INFO " not in s.log().split("OpenAI API at")[-1], "--uvicorn-log-level warning still logs INFO")
        kids = children(s.proc.pid)
        check(len(kids) == 3, "children %r" % kids)
        t0 = time.time()
        s.proc.kill()
        s.proc.wait(10)
        wait_for(lambda: not any(alive(p) for p in kids), 60, "the children of a killed loom serve to exit")
        print("  SIGKILL: the 3 orphans exited in %.2f s" % (time.time() - t0))


def test_progress_on_a_terminal():
    """loom run on a terminal (script(1) gives it one) refreshes one progress line in place."""
    if shutil.which("script") is None:
        print("  skipped: no script(1) to make a terminal")
        return
    cmd = "%s run --model %s --prompt Once --max-tokens 2 --threads 1" % (LOOM, STORIES)
    p = subprocess.run(["script", "-qec", cmd, "/dev/null"], capture_output=True, timeout=120)
    out = p.stdout.decode(errors="replace")  # bytes: text mode would turn the \r into newlines
    check(p.returncode == 0, "loom run under script failed: %s" % out[-1000:])
    check("\rloading layers [0, 5), tp rank 0/1: " in out and "\x1b[K" in out,
          "no refreshed progress line: %r" % out[:600])
    check("(100%)" in out, "the final progress line is missing: %r" % out[:600])


def test_coordinator_vllm_aliases():
    """loom-coordinator takes vLLM's names and scheme-less addresses; refuses vLLM flags it lacks by name."""
    coord = [os.path.join(BIN, "loom-coordinator"), "--insecure"]  # an unkeyed control plane, said so
    p = subprocess.run(coord + ["--model", STORIES, "-tp", "3"], capture_output=True, text=True, timeout=60)
    check(p.returncode != 0 and "tensor parallelism 3" in p.stderr, "-tp 3 was not read as tp 3: %r" % p.stderr)
    p = subprocess.run(coord + ["--model", STORIES, "--pipeline-parallel-size", "9"], capture_output=True, text=True,
                       timeout=60)
    check(p.returncode != 0 and "9" in p.stderr, "--pipeline-parallel-size 9 accepted: %r" % p.stderr)
    p = subprocess.run(coord + ["--model", STORIES, "-q", "q9"], capture_output=True, text=True, timeout=60)
    check(p.returncode != 0 and "q9" in p.stderr, "-q q9 was not read as --quantization: %r" % p.stderr)
    p = subprocess.run(coord + ["--model", STORIES, "--enable-lora", "--max-lora-rank", "100"], capture_output=True,
                       text=True, timeout=60)
    check(p.returncode == 2 and "--max-lora-rank 100" in p.stderr, "%r" % p.stderr)
    p = subprocess.run(coord + ["--model", STORIES, "--log-level", "loud"], capture_output=True, text=True, timeout=60)
    check(p.returncode == 2 and "--log-level must be" in p.stderr, "%r" % p.stderr)
    p = subprocess.run(coord + ["--model", STORIES, "--port", "8000", "--http", "127.0.0.1:8000"], capture_output=True,
                       text=True, timeout=60)
    check(p.returncode == 2 and "not both" in p.stderr, "%r" % p.stderr)
    api, ctl, port = free_port(), free_port(), free_port()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(coord + ["--model", STORIES, "--tensor-parallel-size", "2", "-pp", "1",
                             "--listen", "127.0.0.1:%d" % api, "--control", "127.0.0.1:%d" % ctl,
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "debug"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        def up():
            log.seek(0)
            return "API on tcp://127.0.0.1:%d, workers on tcp://127.0.0.1:%d" % (api, ctl) in log.read()
        wait_for(up, 30, "the coordinator on scheme-less addresses")
        st, _ = http(port, "GET", "/health", key=None)
        check(st is not None, "--host/--port did not start the HTTP gateway")
        w = subprocess.run([os.path.join(BIN, "loom-worker"), "--coordinator", "", "--threads", "1"],
                           capture_output=True, text=True, timeout=30)
        check(w.returncode == 2 and "--coordinator takes an address" in w.stderr, "empty address: %r" % w.stderr)
    finally:
        proc.kill()
        proc.wait()
        log.close()


def test_serve_forwards_engine_flags():
    """vLLM's engine flags on loom serve reach the grid: -pp, --max-model-len, --block-size,
    --no-enable-prefix-caching, -q, --max-num-batched-tokens, each seen in what the server reports."""
    with Serve("-pp", "2", "--max-model-len", "256", "--block-size", "32", "--no-enable-prefix-caching",
               "-q", "int8", "--max-num-batched-tokens", "96", "--log-level", "debug") as s:
        s.wait_ready()
        log = s.log()
        check("2 pipeline stage(s) x 1 tensor-parallel rank(s)" in log, "-pp 2 did not make two stages: %s"
              % log[-2000:])
        check("matmul weights quantized" in log and "(0 matmul weights quantized)" not in log,
              "-q int8 did not quantize the shards: %s" % log[-2000:])
        st, models = http(s.port, "GET", "/v1/models", key=None)
        check(st == 200 and models["data"][0]["max_model_len"] == 256, "/v1/models: %s %s" % (st, models))
        req = urllib.request.Request("http://127.0.0.1:%d/metrics" % s.port)
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
        line = [l for l in text.splitlines() if l.startswith("vllm:cache_config_info{")]
        check(line and 'block_size="32"' in line[0] and 'enable_prefix_caching="False"' in line[0],
              "vllm:cache_config_info: %s" % line)
        # a prompt longer than --max-num-batched-tokens is prefilled in chunks and still answered
        st, out = http(s.port, "POST", "/v1/completions", {"model": "stories260K", "prompt": "Once upon a time " * 30,
                                                          "max_tokens": 4, "temperature": 0}, key=None)
        check(st == 200 and out["usage"]["prompt_tokens"] > 96 and out["usage"]["completion_tokens"] == 4,
              "completion: %s %s" % (st, out))
        st, out = http(s.port, "POST", "/v1/completions", {"model": "stories260K", "prompt": "Once " * 300,
                                                          "max_tokens": 4}, key=None)
        check(st == 400, "a prompt beyond --max-model-len 256 was not refused: %s %s" % (st, out))


def test_serve_speculative_config():
    """vLLM's --speculative-config on loom serve: a draft model drafts on the grid (vLLM's
    spec_decode counters move, the greedy text equals a run without speculation), and
    what Loom does not take is refused naming it."""
    for cfg, want in (('{"method": "eagle3", "model": "x"}', "method 'eagle3' is not supported"),
                      ('{"method": "ngram", "draft_tensor_parallel_size": 2}', "'draft_tensor_parallel_size' is not supported"),
                      ('{"num_speculative_tokens": 4}', "method '' is not supported"),
                      ('{"method": "ngram", "num_speculative_tokens": 2.5}', "must be an integer"),
                      ("[1]", "must be a JSON object")):
        p = loom("serve", STORIES, "--speculative-config", cfg)
        check(p.returncode == 2 and want in p.stderr, "%s: %d %r" % (cfg, p.returncode, p.stderr))
    p = loom("serve", STORIES, "--speculative-config", '{"method": "ngram"}', "--speculative-method", "ngram")
    check(p.returncode == 2 and "not both" in p.stderr, "both forms: %r" % p.stderr)
    body = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True}
    with Serve("--speculative-config", json.dumps({"method": "draft_model", "model": STORIES,
                                                    "quantization": "int8", "num_speculative_tokens": 3})) as s:
        s.wait_ready()
        check("speculative draft: " in s.log() and "(int8," in s.log(), "no draft loaded: %s" % s.log()[-2000:])
        st, on = http(s.port, "POST", "/v1/completions", body, key=None)
        st2, off = http(s.port, "POST", "/v1/completions", dict(body, speculative=False), key=None)
        check(st == st2 == 200 and on["choices"][0]["text"] == off["choices"][0]["text"],
              "speculation changed the text: %s %s" % (on, off))
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % s.port, timeout=30) as r:
            text = r.read().decode()
        acc = [float(l.split()[-1]) for l in text.splitlines()
               if l.startswith("vllm:spec_decode_num_accepted_tokens_total")]
        check(acc and acc[0] > 0, "no accepted drafts in /metrics: %s" % acc)


def test_cpu_check():
    """Every binary refuses a CPU without the build's instruction sets, first thing."""
    for b in ("loom", "loom-coordinator", "loom-worker"):
        ok = subprocess.run([os.path.join(BIN, b), "--help"], capture_output=True, text=True, timeout=30)
        check(ok.returncode == 0, "%s --help failed: %s" % (b, ok.stderr))
        p = subprocess.run([os.path.join(BIN, b), "--help"], capture_output=True, text=True, timeout=30,
                           env=dict(os.environ, LOOM_CPU_PRETEND_MISSING="all"))
        if "was built for a CPU with" not in p.stderr and p.returncode == 0:
            print("  skipped: %s targets the baseline ISA (nothing to check)" % b)
            continue
        check(p.returncode == 1 and "this CPU lacks" in p.stderr and "usage" not in p.stdout,
              "%s with every feature missing: %d %r" % (b, p.returncode, p.stderr))
        need = p.stderr.split("built for a CPU with ")[1].split(";")[0].split()
        if "avx2" in need:
            p = subprocess.run([os.path.join(BIN, b), "--help"], capture_output=True, text=True, timeout=30,
                               env=dict(os.environ, LOOM_CPU_PRETEND_MISSING="avx2"))
            check(p.returncode == 1 and "this CPU lacks avx2." in p.stderr, "%s without avx2: %r" % (b, p.stderr))


if __name__ == "__main__":
    if shutil.which("node") is None or not os.path.isdir(os.path.join(ROOT, "tests", "reference", "node_modules",
                                                                      "openai")):
        print("the OpenAI SDK is missing: run npm ci --prefix tests/reference")
        sys.exit(1)
    run_tests([test_bad_input, test_coordinator_vllm_aliases, test_serve_forwards_engine_flags, test_serve_speculative_config, test_cpu_check, test_progress_on_a_terminal, test_main_run, test_sigkill_leaves_no_orphan])
