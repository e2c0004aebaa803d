"""The command-line tools: `loom run` tells a story, bad models and bad input
end with a clear message (never a crash), every binary has --help, and stop
strings end a completion without being emitted."""
import json
import os
import re
import shutil
import struct
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BIN, ROOT, Cluster, STORIES, check, run_tests  # noqa: E402

WORK = os.environ.get("LOOM_TEST_WORK", "/tmp/loom-it-cli")
LOOM = os.path.join(BIN, "loom")


def loom_run(model, prompt="Once upon a time", *extra):
    return subprocess.run([LOOM, "run", "--model", model, "--prompt", prompt, "--temperature", "0",
                           "--max-tokens", "64", "--threads", "1"] + list(extra),
                          capture_output=True, text=True, timeout=60)


def test_greedy_story():
    p = loom_run(STORIES)
    check(p.returncode == 0, p.stderr)
    print("  " + p.stdout.strip()[:120])
    # the reference implementation's greedy continuation of this prompt
    check(p.stdout.startswith(", there was a little girl named Lily. She loved to play outside in the park."),
          "not the expected story: %r" % p.stdout)
    check("time to first token" in p.stderr and "tokens/s" in p.stderr, "no timing on stderr: %r" % p.stderr)
    check("loading" not in p.stdout, "logs leaked into stdout")


def copy_model(name):
    d = os.path.join(WORK, name)
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(STORIES, d)
    os.chmod(d, 0o755)
    for f in os.listdir(d):
        os.chmod(os.path.join(d, f), 0o644)
    return d


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n)), f.read()


def write_with_header(path, hdr, data):
    raw = json.dumps(hdr).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def expect_error(model, *words, prompt="Once upon a time", extra=()):
    p = loom_run(model, prompt, *extra)
    check(p.returncode not in (0, -11, -6, 134, 139), "%s: exit %d (a crash or a success)" % (model, p.returncode))
    msg = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
    print("  %-22s -> %s" % (os.path.basename(model), msg[:150]))
    check(msg.startswith("error:"), "no clear error line: %r" % p.stderr)
    for w in words:
        check(w in msg, "error %r does not mention %r" % (msg, w))


def test_bad_models():
    st = "model.safetensors"
    d = copy_model("truncated")
    with open(os.path.join(d, st), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(d, st)) // 2)
    expect_error(d, st)

    d = copy_model("offsets")
    n, hdr, data = header(os.path.join(d, st))
    name = next(k for k in hdr if k != "__metadata__")
    hdr[name]["data_offsets"] = [len(data) - 4, len(data) + 4096]
    write_with_header(os.path.join(d, st), hdr, data)
    expect_error(d, st)

    d = copy_model("dtype")
    n, hdr, data = header(os.path.join(d, st))
    hdr["model.norm.weight"]["dtype"] = "I32"
    write_with_header(os.path.join(d, st), hdr, data)
    expect_error(d, "model.norm.weight", "I32")

    d = copy_model("missing")
    n, hdr, data = header(os.path.join(d, st))
    del hdr["model.layers.3.mlp.down_proj.weight"]
    write_with_header(os.path.join(d, st), hdr, data)
    expect_error(d, "model.layers.3.mlp.down_proj.weight", "not found")

    d = copy_model("heads")
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_attention_heads"] = 7
    cfg["num_key_value_heads"] = 7
    del cfg["head_dim"]
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    expect_error(d, "config.json", "7")

    d = copy_model("nojson")
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write("{\"hidden_size\": 64,")
    expect_error(d, "config.json")

    expect_error(os.path.join(WORK, "does-not-exist"), "does-not-exist")


def test_bad_input():
    expect_error(STORIES, "512", prompt="Once upon a time " * 200)  # longer than the context
    p = subprocess.run([LOOM, "run", "--model", STORIES, "--prompt", "x", "--temperature", "-1"],
                       capture_output=True, text=True, timeout=30)
    check(p.returncode == 2 and "--temperature" in p.stderr, "temperature -1: %r" % p.stderr)
    p = subprocess.run([LOOM, "run", "--model", STORIES, "--prompt", "x", "--device", "tpu"],
                       capture_output=True, text=True, timeout=30)
    check(p.returncode != 0 and "tpu" in p.stderr, "device tpu: %r" % p.stderr)
    p = subprocess.run([LOOM, "run", "--model", STORIES], capture_output=True, text=True, timeout=30)
    check(p.returncode == 2 and "--prompt" in p.stderr, "missing prompt: %r" % p.stderr)
    p = subprocess.run([os.path.join(BIN, "loom-worker"), "--coordinator", "tcp://127.0.0.1:1",
                        "--decode-buckets", "maybe"], capture_output=True, text=True, timeout=30)
    check(p.returncode == 2 and "--decode-buckets must be auto, on or off" in p.stderr,
          "decode-buckets maybe: %r" % p.stderr)


def test_help_everywhere():
    for cmd in (["loom", "--help"], ["loom", "run", "--help"], ["loom", "generate", "--help"],
                ["loom", "bench", "--help"], ["loom", "health", "--help"], ["loom", "stats", "--help"],
                ["loom", "embed", "--help"],
                ["loom-coordinator", "--help"], ["loom-worker", "--help"]):
        p = subprocess.run([os.path.join(BIN, cmd[0])] + cmd[1:], capture_output=True, text=True, timeout=30)
        check(p.returncode == 0 and "usage:" in p.stdout, "%s: %r" % (" ".join(cmd), p.stdout + p.stderr))
    p = subprocess.run([os.path.join(BIN, "..", "..", "deploy", "local", "launch.sh"), "--help"],
                       capture_output=True, text=True, timeout=30)
    check(p.returncode == 0 and "usage:" in p.stdout, "launch.sh --help")


def test_stop_strings():
    with Cluster(STORIES, 1, 1) as c:
        rc, full, ids_full, err = c.generate("Once upon a time", 40)
        check(rc == 0, err)
        rc, text, ids, err = c.generate("Once upon a time", 40, extra=["--stop", "named"])
        check(rc == 0, err)
        check(full.startswith(text.rstrip("\n")) and "named" not in text, "stop string: %r vs %r" % (text, full))
        check(text.rstrip("\n") == full.split("named")[0], "text before the stop: %r" % text)
        check("finish stop" in err, "finish reason: %r" % err)
        # a stop string split across tokens, and one that never appears
        rc, text2, _, err = c.generate("Once upon a time", 40, extra=["--stop", "ttle gi", "--stop", "zzz"])
        check(rc == 0 and text2.rstrip("\n") == full.split("ttle gi")[0], "split stop: %r" % text2)
        # as many stop strings as the APIs take (common/request_limits.h: 64), the last one firing
        many = []
        for i in range(63):
            many += ["--stop", "zz%d" % i]
        rc, text3, _, err = c.generate("Once upon a time", 40, extra=many + ["--stop", "named"])
        check(rc == 0 and text3 == text, "64 stop strings: rc %d %r %s" % (rc, text3, err))
        rc, _, _, err = c.generate("Once upon a time", 40, extra=many + ["--stop", "named", "--stop", "x"])
        check(rc == 2 and "at most 64 --stop" in err, "65 stop strings: rc %d %s" % (rc, err))


def test_openblas_core():
    # OpenBLAS falls back to its SSE3 kernels on CPUs newer than its build;
    # loom re-executes itself with OPENBLAS_CORETYPE set to the CPU's family.
    fallbacks = {"prescott", "core2", "penryn", "dunnington", "nehalem", "katmai", "coppermine", "northwood",
                 "banias", "atom"}
    flags = open("/proc/cpuinfo").read().split()
    env = dict(os.environ, LOOM_LOG_LEVEL="debug")
    env.pop("OPENBLAS_CORETYPE", None)
    args = [LOOM, "run", "--model", STORIES, "--prompt", "Once", "--max-tokens", "4"]

    def core(p):
        m = re.search(r"OpenBLAS core (\w+)", p.stderr)
        check(p.returncode == 0 and m, "loom run: %r" % p.stderr[-2000:])
        return m.group(1)
    got = core(subprocess.run(args, capture_output=True, text=True, env=env, timeout=60))
    if "avx2" in flags and "fma" in flags:
        check(got.lower() not in fallbacks, "OpenBLAS runs its %s kernels on a CPU with AVX2" % got)
    env["OPENBLAS_CORETYPE"] = "Haswell"  # the user's choice stands
    forced = core(subprocess.run(args, capture_output=True, text=True, env=env, timeout=60))
    check(forced == "Haswell", "OPENBLAS_CORETYPE=Haswell gave %s" % forced)
    print("  OpenBLAS core %s (Haswell when asked)" % got)


def test_router_links():
    # loom-router links the gateway library, not the coordinator's engine:
    # no OpenBLAS (the coordinator, which runs the engine's kernels, does)
    def libs(name):
        p = subprocess.run(["ldd", os.path.join(BIN, name)], capture_output=True, text=True, timeout=30)
        check(p.returncode == 0, "ldd %s: %r" % (name, p.stderr))
        return p.stdout.lower()
    check("blas" in libs("loom-coordinator"), "ldd shows no OpenBLAS in loom-coordinator: the check proves nothing")
    router = libs("loom-router")
    check("blas" not in router, "loom-router links OpenBLAS:\n%s" % router)
    check("microhttpd" in router, "loom-router does not link libmicrohttpd:\n%s" % router)


def test_tcp_data_plane():
    # the data plane used across hosts, forced on one host
    with Cluster(STORIES, 2, 2, coord_args=["--comm", "tcp"]) as c:
        rc, _, ids, err = c.generate("Once upon a time", 32)
        check(rc == 0, err)
        local = subprocess.run([LOOM, "run", "--model", STORIES, "--prompt", "Once upon a time", "--temperature",
                                "0", "--max-tokens", "32", "--ids", "--quiet"], capture_output=True, text=True)
        want = [int(x) for x in local.stderr.split("ids:")[1].split()]
        check(ids == want, "tcp grid %s vs loom run %s" % (ids, want))
        check("data plane tcp" in c.log("coordinator"), "coordinator did not choose tcp")


def test_launch_cpu_offset():
    """launch.sh --cpu-offset K pins a cluster's workers from core K on (two
    clusters on one machine each on cores of their own); a bad K is refused."""
    p = subprocess.run([os.path.join(ROOT, "deploy", "local", "launch.sh"), "--model", STORIES, "--cpu-offset", "x"],
                       capture_output=True, text=True, timeout=30)
    check(p.returncode == 2 and "--cpu-offset" in p.stderr, "--cpu-offset x: %d %s" % (p.returncode, p.stderr))
    cores = os.cpu_count() or 1
    with Cluster(STORIES, 1, 1, threads=1, launch_args=["--cpu-offset", str(cores - 1)]) as c:
        rc, _, ids, err = c.generate("Once upon a time", 8)
        check(rc == 0 and len(ids) == 8, err)
        with open("/proc/%d/status" % c.pid("worker-0")) as f:
            allowed = [x.split(":")[1].strip() for x in f if x.startswith("Cpus_allowed_list")][0]
        check(allowed == str(cores - 1), "worker pinned to %r, want core %d" % (allowed, cores - 1))


# every model_type the config parser accepts (common/model_config.c), each served by one family
MODEL_TYPES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe",
               "qwen2_moe", "gpt_oss", "deepseek_v3", "deepseek_v2"]


def test_info():
    """`loom info` and `--json`: the CPU backend runs every model type; a CUDA build on a machine
    without a GPU lists cuda as compiled, "no CUDA device", and every model type as running there
    (no capability of the CPU backend is missing on cuda)."""
    p = subprocess.run([LOOM, "info", "--json"], capture_output=True, text=True, timeout=30)
    check(p.returncode == 0, "loom info --json: %r" % p.stderr)
    info = json.loads(p.stdout)
    backends = {b["name"]: b for b in info["backends"]}
    cpu = backends["cpu"]
    check(cpu["compiled"] and cpu["devices"] == 1, "cpu: %r" % cpu)
    types = {t["model_type"]: t for t in cpu["model_types"]}
    check(sorted(types) == sorted(MODEL_TYPES), "cpu model types: %r" % sorted(types))
    for t in types.values():
        check(t["runs"] == "yes" and t["lacks"] == [] and t["lacks_for_some_configs"] == [], "cpu: %r" % t)
    check("attn_window" in cpu["capabilities"] and "kv_int8" in cpu["capabilities"], "cpu caps: %r" % cpu)
    text = subprocess.run([LOOM, "info"], capture_output=True, text=True, timeout=30)
    check(text.returncode == 0 and text.stdout.startswith("cpu: "), "loom info: %r" % (text.stdout + text.stderr))
    for mt in MODEL_TYPES:
        check(re.search(r"^  %s +yes$" % mt, text.stdout, re.M), "loom info: %s on cpu: %r" % (mt, text.stdout))
    h = subprocess.run([LOOM, "info", "--help"], capture_output=True, text=True, timeout=30)
    check(h.returncode == 0 and "usage:" in h.stdout, "loom info --help: %r" % h.stdout)
    cuda = backends["cuda"]
    if not cuda["compiled"]:
        check("not compiled in" in cuda["device_status"] and "cuda: not compiled in" in text.stdout, "cuda: %r" % cuda)
        print("  skipped: the CUDA half (this build has no CUDA backend; build with -DLOOM_CUDA=ON)")
        return
    ct = {t["model_type"]: t for t in cuda["model_types"]}
    check(sorted(ct) == sorted(MODEL_TYPES), "cuda model types: %r" % sorted(ct))
    # the CUDA backend has every capability the CPU backend has but one
    # (docs/architecture.md's capability table): heads wider than 768, which
    # only a DeepSeek config with a latent row beyond its releases' 576 needs
    for mt, t in ct.items():
        if mt.startswith("deepseek"):
            check(t["runs"] == "depends" and t["lacks"] == [] and t["lacks_for_some_configs"] == ["attn_huge"],
                  "cuda %s: %r" % (mt, t))
        else:
            check(t["runs"] == "yes" and t["lacks"] == [] and t["lacks_for_some_configs"] == [], "cuda: %r" % t)
    check("attn_wide" in cuda["capabilities"], "cuda caps: %r" % cuda["capabilities"])
    for cap in cpu["capabilities"]:
        check(cap == "attn_huge" or cap in cuda["capabilities"], "cuda lacks %s: %r" % (cap, cuda["capabilities"]))
    check("kv_fp8" in cuda["capabilities"], "cuda caps: %r" % cuda["capabilities"])
    for mt in MODEL_TYPES:
        if not mt.startswith("deepseek"):
            check(len(re.findall(r"^  %s +yes$" % mt, text.stdout, re.M)) == 2, "loom info: %s on cuda: %r" % (mt, text.stdout))
    if cuda["devices"] == 0:
        check(cuda["device_status"] == "no CUDA device" and "cuda: no CUDA device" in text.stdout, "cuda: %r" % cuda)
    else:
        print("  (a CUDA device is visible: the no-device line is not checked)")


if __name__ == "__main__":
    os.makedirs(WORK, exist_ok=True)
    run_tests([test_greedy_story, test_bad_models, test_bad_input, test_help_everywhere, test_stop_strings,
               test_openblas_core, test_router_links, test_tcp_data_plane, test_launch_cpu_offset, test_info])
