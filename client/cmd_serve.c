/* `loom serve MODEL_DIR`: the one-command server. Starts a loom-coordinator
 * and its tp x pp loom-worker processes on this machine, supervises them,
 * and serves the OpenAI HTTP API on --host/--port, taking vLLM's flag names.
 *
 * Lifecycle of the supervisor:
 *   STARTING  coordinator and workers spawned; waiting for the grid's ready
 *             file. Any child that exits here is fatal: everything is
 *             stopped and serve exits 1 (2 when the coordinator refused its
 *             options), since a retry would fail the same way.
 *   SERVING   a worker that exits is logged and restarted (its slot is free
 *             in the coordinator's grid, so the new process takes it and the
 *             requests in flight are re-prefilled); more than
 *             MAX_RESTARTS within RESTART_WINDOW_S gives up: stop, exit 1.
 *             The coordinator exiting is fatal (it held the requests): stop,
 *             exit 1, and let the service manager restart `loom serve`.
 *   STOPPING  (SIGTERM/SIGINT, or a fatal exit) the coordinator gets
 *             SIGTERM and drains (--shutdown-timeout), then the workers get
 *             SIGTERM; whoever outstays its deadline gets SIGKILL. A second
 *             signal makes the coordinator stop at once.
 * Children run in a process group of their own (a terminal's Ctrl-C reaches
 * only the supervisor, which stops them in order) and with
 * PR_SET_PDEATHSIG, so that they also go when the supervisor is killed with
 * SIGKILL. */
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "client/commands.h"
#include "common/cli.h"
#include "common/endpoint.h"
#include "common/keys.h"
#include "common/log.h"
#include "common/util.h"
#include "coordinator/lora_serve.h"

#define MAX_RESTARTS 3          /* worker restarts allowed ... */
#define RESTART_WINDOW_S 300.0  /* ... within this many seconds */
#define WORKER_STOP_S 10.0      /* a worker's time to exit after SIGTERM */
#define COORD_STOP_EXTRA_S 10.0 /* the coordinator's, beyond its drain */

typedef struct argv_list {
    char **v;
    int n, cap;
} argv_list_t;

static void argv_push(argv_list_t *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void argv_push(argv_list_t *a, const char *fmt, ...) {
    if (a->n + 2 > a->cap) {
        a->cap = a->cap ? 2 * a->cap : 32;
        a->v = loom_xrealloc(a->v, (size_t)a->cap * sizeof *a->v);
    }
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    if (vasprintf(&s, fmt, ap) < 0) s = NULL;
    va_end(ap);
    if (!s) {
        fprintf(stderr, "error: out of memory\n");
        exit(1);
    }
    a->v[a->n++] = s;
    a->v[a->n] = NULL;
}

/* Appends S to A as a JSON string (quotes and backslashes escaped). */
static void json_str(char *out, size_t cap, const char *v) {
    size_t n = 0;
    if (n + 1 < cap) out[n++] = '"';
    for (; *v && n + 3 < cap; v++) {
        if (*v == '"' || *v == '\\') out[n++] = '\\';
        out[n++] = *v;
    }
    if (n + 1 < cap) out[n++] = '"';
    out[n] = 0;
}

/* vLLM's LoRA flags, checked here, handed on to the coordinator as given. */
static void lora_forward(argv_list_t *a, const loom_lora_serve_opts_t *o) {
    if (!o->enable) return;
    argv_push(a, "--enable-lora");
    argv_push(a, "--max-loras=%d", o->max_loras);
    argv_push(a, "--max-lora-rank=%d", o->max_lora_rank);
    argv_push(a, "--max-cpu-loras=%d", o->max_cpu_loras);
    if (o->allow_runtime_updating) argv_push(a, "--allow-runtime-lora-updating");
    for (int i = 0; i < o->n_modules; i++) {
        const loom_lora_module_spec_t *m = &o->modules[i];
        if (!m->base[0]) {
            argv_push(a, "--lora-modules=%s=%s", m->name, m->path);
            continue;
        }
        char n[300], p[2100], b[300];
        json_str(n, sizeof n, m->name);
        json_str(p, sizeof p, m->path);
        json_str(b, sizeof b, m->base);
        argv_push(a, "--lora-modules={\"name\": %s, \"path\": %s, \"base_model_name\": %s}", n, p, b);
    }
}

static void argv_free(argv_list_t *a) {
    for (int i = 0; i < a->n; i++) free(a->v[i]);
    free(a->v);
    memset(a, 0, sizeof *a);
}

typedef struct child {
    char name[32];       /* "coordinator", "worker 0", ... */
    argv_list_t argv;
    pid_t pid;           /* 0: not running */
    int restarts;        /* in the current window */
    double window_start; /* when that window began */
} child_t;

typedef enum { SERVE_STARTING, SERVE_SERVING, SERVE_STOPPING } serve_state_t;

typedef struct serve {
    char bin_dir[PATH_MAX];
    char run_dir[64];   /* private: the coordinator's ready file, the cluster's keys */
    char keys_dir[80];  /* run_dir/keys ("": not keyed) */
    char ready_file[128];
    child_t coord;
    child_t *workers;
    int n_workers;
    serve_state_t state;
    int exit_code;
    double coord_deadline, worker_deadline; /* STOPPING: when to SIGKILL (0: not yet signalled) */
    int shutdown_timeout_s;
} serve_t;

static volatile sig_atomic_t g_signals; /* SIGTERM/SIGINT received, counted */

static void on_stop_signal(int sig) {
    (void)sig;
    g_signals++;
}
static void on_child(int sig) { (void)sig; } /* only to interrupt the sleep */

/* A TCP port on 127.0.0.1 that is free now (the kernel's pick). */
static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    int port = -1;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

/* The directory of the running `loom` binary: loom-coordinator and
 * loom-worker are installed next to it ($LOOM_BIN overrides). */
static int find_bin_dir(char *out, size_t n) {
    const char *env = getenv("LOOM_BIN");
    if (env && env[0]) {
        snprintf(out, n, "%s", env);
        return 0;
    }
    char self[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) return -1;
    self[len] = '\0';
    char *slash = strrchr(self, '/');
    if (!slash) return -1;
    *slash = '\0';
    snprintf(out, n, "%s", self);
    return 0;
}

/* CURVE keys for the internal planes: one fresh key set per run in
 * run_dir/keys (common/keys.h), the way deploy/local/launch.sh keys its
 * clusters. The control plane is always keyed (each worker's routing id is
 * bound to its own key); the client API is keyed only when it binds an
 * address other hosts can reach (then a client key pair is made for the
 * operator). `insecure` turns both off. Returns -1 on error (said). */
static int serve_cluster_keys(serve_t *s, int insecure, const char *zmq_addr, argv_list_t *coord) {
    if (insecure) {
        LOOM_WARN("--insecure: the control plane between the coordinator and its workers is not keyed");
        argv_push(coord, "--insecure");
        argv_push(coord, "--insecure-api");
        return 0;
    }
    snprintf(s->keys_dir, sizeof s->keys_dir, "%s/keys", s->run_dir);
    int clients = !loom_endpoint_is_local(zmq_addr);
    loom_err_t err = {0};
    if (mkdir(s->keys_dir, 0700) != 0 ||
        loom_keys_make_set(s->keys_dir, s->n_workers, "worker-", clients, clients, 0, &err) < 0) {
        fprintf(stderr, "error: cannot make the cluster's keys in %s: %s\n", s->keys_dir,
                err.msg[0] ? err.msg : strerror(errno));
        return -1;
    }
    argv_push(coord, "--curve-secret");
    argv_push(coord, "%s/coordinator.key", s->keys_dir);
    argv_push(coord, "--worker-keys");
    argv_push(coord, "%s/workers.allow", s->keys_dir);
    if (clients) {
        argv_push(coord, "--client-keys");
        argv_push(coord, "%s/clients.allow", s->keys_dir);
        LOOM_INFO("the ZeroMQ API at %s is keyed: clients need --curve-server-key %s/coordinator.pub "
                  "--curve-secret %s/client-0.key",
                  zmq_addr, s->keys_dir, s->keys_dir);
    }
    return 0;
}

/* A worker's own identity and key (with serve_cluster_keys' set). */
static void serve_worker_keys(const serve_t *s, int i, argv_list_t *w) {
    argv_push(w, "--id");
    argv_push(w, "worker-%d", i);
    if (!s->keys_dir[0]) return;
    argv_push(w, "--curve-server-key");
    argv_push(w, "%s/coordinator.pub", s->keys_dir);
    argv_push(w, "--curve-secret");
    argv_push(w, "%s/worker-%d.key", s->keys_dir, i);
}

/* Removes the run's key files (secrets do not outlive the run). */
static void serve_remove_keys(const serve_t *s) {
    if (!s->keys_dir[0]) return;
    char path[PATH_MAX];
    const char *fixed[] = {"coordinator.key", "coordinator.pub", "workers.allow", "clients.allow", "client-0.key",
                           "client-0.pub"};
    for (size_t k = 0; k < sizeof fixed / sizeof *fixed; k++) {
        snprintf(path, sizeof path, "%s/%s", s->keys_dir, fixed[k]);
        unlink(path);
    }
    for (int i = 0; i < s->n_workers; i++) {
        snprintf(path, sizeof path, "%s/worker-%d.key", s->keys_dir, i);
        unlink(path);
        snprintf(path, sizeof path, "%s/worker-%d.pub", s->keys_dir, i);
        unlink(path);
    }
    rmdir(s->keys_dir);
}

static pid_t spawn(const serve_t *s, child_t *c) {
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        LOOM_ERROR("cannot start %s: %s", c->name, strerror(errno));
        return -1;
    }
    if (pid == 0) {
        /* the child: its own process group, gone when the supervisor goes */
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent) _exit(1); /* the supervisor died before prctl */
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGPIPE, SIG_DFL);
        execv(c->argv.v[0], c->argv.v);
        fprintf(stderr, "error: cannot run %s: %s\n", c->argv.v[0], strerror(errno));
        _exit(127);
    }
    (void)s;
    c->pid = pid;
    LOOM_DEBUG("started %s (pid %d)", c->name, (int)pid);
    return pid;
}

static void describe_exit(int status, char *out, size_t n) {
    if (WIFEXITED(status)) snprintf(out, n, "exited with status %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status)) snprintf(out, n, "was killed by signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
    else snprintf(out, n, "ended (status 0x%x)", status);
}

static void begin_stop(serve_t *s, int exit_code, const char *why) {
    if (s->state == SERVE_STOPPING) return;
    LOOM_INFO("stopping (%s)", why);
    s->state = SERVE_STOPPING;
    s->exit_code = exit_code;
    if (s->coord.pid > 0) {
        kill(s->coord.pid, SIGTERM);
        s->coord_deadline = loom_now_s() + s->shutdown_timeout_s + COORD_STOP_EXTRA_S;
    }
}

static int workers_running(const serve_t *s) {
    int n = 0;
    for (int i = 0; i < s->n_workers; i++) n += s->workers[i].pid > 0;
    return n;
}

static void on_exit_of(serve_t *s, pid_t pid, int status) {
    char how[96];
    describe_exit(status, how, sizeof how);
    if (pid == s->coord.pid) {
        s->coord.pid = 0;
        if (s->state == SERVE_STOPPING) {
            LOOM_INFO("coordinator %s", how);
            return;
        }
        LOOM_ERROR("the coordinator %s; stopping the workers", how);
        /* the coordinator refusing its options (status 2) is a usage error of serve's */
        int code = s->state == SERVE_STARTING && WIFEXITED(status) && WEXITSTATUS(status) == 2 ? 2 : 1;
        begin_stop(s, code, "the coordinator is gone");
        return;
    }
    for (int i = 0; i < s->n_workers; i++) {
        child_t *w = &s->workers[i];
        if (w->pid != pid) continue;
        w->pid = 0;
        if (s->state == SERVE_STOPPING) {
            LOOM_INFO("%s %s", w->name, how);
            return;
        }
        if (s->state == SERVE_STARTING) {
            LOOM_ERROR("%s %s before the grid was ready", w->name, how);
            begin_stop(s, 1, "a worker failed to start");
            return;
        }
        double now = loom_now_s();
        if (now - w->window_start > RESTART_WINDOW_S) w->window_start = now, w->restarts = 0;
        if (w->restarts >= MAX_RESTARTS) {
            LOOM_ERROR("%s %s; it was restarted %d times in %.0f s, giving up", w->name, how, w->restarts,
                       RESTART_WINDOW_S);
            begin_stop(s, 1, "a worker keeps failing");
            return;
        }
        w->restarts++;
        LOOM_WARN("%s %s; restarting it (restart %d of %d within %.0f s)", w->name, how, w->restarts, MAX_RESTARTS,
                  RESTART_WINDOW_S);
        if (spawn(s, w) < 0) begin_stop(s, 1, "a worker could not be restarted");
        return;
    }
}

/* The supervisor's loop: signals, child exits, readiness, stop deadlines. */
static int supervise(serve_t *s, const char *url, const char *zmq_addr, const char *model) {
    int seen_signals = 0;
    for (;;) {
        int sigs = g_signals;
        if (sigs != seen_signals) {
            if (s->state != SERVE_STOPPING) {
                begin_stop(s, 0, "signal");
            } else if (s->coord.pid > 0) {
                LOOM_INFO("second signal: the coordinator stops at once");
                kill(s->coord.pid, SIGTERM);
                s->coord_deadline = LOOM_MIN(s->coord_deadline, loom_now_s() + COORD_STOP_EXTRA_S);
            }
            seen_signals = sigs;
        }
        int status;
        pid_t pid;
        while ((pid = waitpid(-1, &status, WNOHANG)) > 0) on_exit_of(s, pid, status);
        if (s->state == SERVE_STARTING) {
            struct stat sb;
            if (stat(s->ready_file, &sb) == 0) {
                s->state = SERVE_SERVING;
                LOOM_INFO("serving %s: OpenAI API at %s (ZeroMQ API at %s); %d worker(s)", model, url, zmq_addr,
                          s->n_workers);
            }
        }
        if (s->state == SERVE_STOPPING) {
            double now = loom_now_s();
            if (s->coord.pid > 0 && now > s->coord_deadline) {
                LOOM_WARN("the coordinator did not stop in time; killing it");
                kill(s->coord.pid, SIGKILL);
                s->coord_deadline = now + 3600;
            }
            if (s->coord.pid == 0 && s->worker_deadline == 0) {
                for (int i = 0; i < s->n_workers; i++)
                    if (s->workers[i].pid > 0) kill(s->workers[i].pid, SIGTERM);
                s->worker_deadline = now + WORKER_STOP_S;
            }
            if (s->worker_deadline > 0 && now > s->worker_deadline) {
                for (int i = 0; i < s->n_workers; i++)
                    if (s->workers[i].pid > 0) {
                        LOOM_WARN("%s did not stop in time; killing it", s->workers[i].name);
                        kill(s->workers[i].pid, SIGKILL);
                    }
                s->worker_deadline = now + 3600;
            }
            if (s->coord.pid == 0 && workers_running(s) == 0) return s->exit_code;
        }
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL); /* SIGCHLD and the stop signals cut it short */
    }
}

/* vLLM's option names as loom serve takes them; each value given is handed
 * to loom-coordinator under the same name (it validates them). */
typedef struct fwd_opts {
    const char *max_model_len, *max_num_seqs, *max_batched, *served_name, *quantization, *kv_dtype, *api_key,
        *block_size, *seed, *chat_template, *generation_config, *log_level, *dtype, *max_queue, *kv_memory,
        *recovery_ms, *log_format, *embedding_pooling, *tool_parser, *reasoning_parser;
    const char *kv_offload_size, *kv_offload_backend; /* the host-memory KV tier */
    int trust_request_template, auto_tool_choice;
    const char *spec_method, *spec_k, *ngram_min, *ngram_max; /* speculative decoding */
    const char *spec_model, *spec_quant, *spec_max_seqs, *spec_threads, *spec_device;
    int prefix_on, prefix_off;
    int async_scheduling;
    int expert_parallel; /* Mixture-of-Experts layers: TP ranks split the experts */
    int dp_attention;    /* DeepSeek: each TP rank runs attention for its own sequences */
    int mla_disable;     /* DeepSeek: decompressed keys and values per head instead of the latent */
    char spec_buf[3][32]; /* what --speculative-config gave: numbers, the draft's directory and scheme */
    char spec_model_buf[PATH_MAX], spec_quant_buf[64];
} fwd_opts_t;

/* vLLM's --speculative-config JSON mapped on the speculative flags:
 * method (ngram, draft_model/draft; vLLM infers draft_model from "model"),
 * model, num_speculative_tokens, prompt_lookup_min/max, quantization (the
 * draft's). Anything else (EAGLE, Medusa, MTP heads, draft TP) is refused
 * naming the key or the method. */
static int speculative_config_apply(fwd_opts_t *f, cJSON *j);

static int speculative_config(fwd_opts_t *f, const char *json) {
    cJSON *j = cJSON_Parse(json);
    int r = speculative_config_apply(f, j);
    cJSON_Delete(j);
    return r;
}

static int speculative_config_apply(fwd_opts_t *f, cJSON *j) {
    if (f->spec_method || f->spec_k || f->ngram_min || f->ngram_max || f->spec_model || f->spec_quant) {
        fprintf(stderr, "error: give --speculative-config or the --speculative-*/--ngram-* flags, not both\n");
        return -1;
    }
    if (!cJSON_IsObject(j)) {
        fprintf(stderr, "error: --speculative-config must be a JSON object, like "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'\n");
        return -1;
    }
    static const char *const ints[] = {"num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"};
    const char **int_dst[] = {&f->spec_k, &f->ngram_min, &f->ngram_max};
    for (cJSON *it = j->child; it; it = it->next) {
        size_t i = 0;
        while (i < LOOM_ARRAY_LEN(ints) && strcmp(it->string, ints[i]) != 0) i++;
        if (i < LOOM_ARRAY_LEN(ints)) {
            if (!cJSON_IsNumber(it) || it->valuedouble != (double)(int)it->valuedouble) {
                fprintf(stderr, "error: --speculative-config: %s must be an integer\n", it->string);
                return -1;
            }
            snprintf(f->spec_buf[i], sizeof f->spec_buf[i], "%d", (int)it->valuedouble);
            *int_dst[i] = f->spec_buf[i];
        } else if (!strcmp(it->string, "method") || !strcmp(it->string, "model") ||
                   !strcmp(it->string, "quantization")) {
            if (!cJSON_IsString(it) && !(cJSON_IsNull(it) && strcmp(it->string, "method") != 0)) {
                fprintf(stderr, "error: --speculative-config: %s must be a string\n", it->string);
                return -1;
            }
            if (!strcmp(it->string, "model") && cJSON_IsString(it)) {
                snprintf(f->spec_model_buf, sizeof f->spec_model_buf, "%s", it->valuestring);
                f->spec_model = f->spec_model_buf;
            }
            if (!strcmp(it->string, "quantization") && cJSON_IsString(it)) {
                snprintf(f->spec_quant_buf, sizeof f->spec_quant_buf, "%s", it->valuestring);
                f->spec_quant = f->spec_quant_buf;
            }
        } else {
            fprintf(stderr, "error: --speculative-config: '%s' is not supported (Loom takes method, model, "
                            "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, quantization)\n",
                    it->string);
            return -1;
        }
    }
    cJSON *m = cJSON_GetObjectItemCaseSensitive(j, "method");
    const char *method = cJSON_IsString(m) ? m->valuestring : f->spec_model ? "draft_model" : "";
    if (!strcmp(method, "ngram")) {
        f->spec_method = "ngram";
    } else if (!strcmp(method, "draft_model") || !strcmp(method, "draft")) {
        f->spec_method = "draft";
    } else if (!strcmp(method, "deepseek_mtp") || !strcmp(method, "mtp")) {
        f->spec_method = "mtp";
    } else {
        fprintf(stderr, "error: --speculative-config: method '%s' is not supported (ngram, draft_model with "
                        "\"model\", or deepseek_mtp; Loom's --speculative-quantization gives a quantized self-draft)\n",
                method);
        return -1;
    }
    return 0;
}

int loom_cmd_serve(int argc, char **argv) {
    loom_log_init("serve");
    serve_t s = {.shutdown_timeout_s = 30};
    fwd_opts_t f = {0};
    const char *model = NULL, *host = "127.0.0.1", *device = "cpu", *zmq_listen = NULL;
    int port = 8000, tp = 1, pp = 1, threads = 0, insecure = 0;
    const char *spec_config = NULL;
    loom_opt_t opts[] = {
        {"model", LOOM_OPT_STR, &model, "DIR",
         "the Hugging Face model directory (or give it first: loom serve DIR)", 1, 0, NULL},
        {"host", LOOM_OPT_STR, &host, "HOST",
         "HTTP address to bind (default 127.0.0.1: this machine only; vLLM's default is 0.0.0.0)",
         1, 0, NULL},
        {"port", LOOM_OPT_INT, &port, "PORT",
         "HTTP port (default 8000; 0: any free port, see the log)", 0, 65535, NULL},
        {"tensor-parallel-size", LOOM_OPT_INT, &tp, "N",
         "tensor-parallel ranks per pipeline stage (also -tp; default 1)", 1, 64, NULL},
        {"tp", LOOM_OPT_INT, &tp, "N", "same as --tensor-parallel-size", 1, 64, NULL},
        {"pipeline-parallel-size", LOOM_OPT_INT, &pp, "M", "pipeline stages (also -pp; default 1)",
         1, 64, NULL},
        {"pp", LOOM_OPT_INT, &pp, "M", "same as --pipeline-parallel-size", 1, 64, NULL},
        {"max-model-len", LOOM_OPT_STR, &f.max_model_len, "N",
         "context length (default: the model's)", 1, 0, NULL},
        {"max-num-seqs", LOOM_OPT_STR, &f.max_num_seqs, "N", "most running sequences (default 64)",
         1, 0, NULL},
        {"max-num-batched-tokens", LOOM_OPT_STR, &f.max_batched, "N",
         "most tokens per step (default 512)", 1, 0, NULL},
        {"speculative-method", LOOM_OPT_STR, &f.spec_method, "METHOD",
         "speculative decoding: none (default), ngram, draft or mtp (docs/speculative.md)", 1, 0, NULL},
        {"speculative-model", LOOM_OPT_STR, &f.spec_model, "DIR",
         "method draft: a smaller model with the same vocabulary (default: the target itself)", 1,
         0, NULL},
        {"speculative-quantization", LOOM_OPT_STR, &f.spec_quant, "SCHEME",
         "method draft: quantize the draft on load (int8, q4, ...); alone, a quantized self-draft",
         1, 0, NULL},
        {"speculative-max-seqs", LOOM_OPT_STR, &f.spec_max_seqs, "N",
         "method draft: sequences drafted for at once (default 8)", 1, 0, NULL},
        {"speculative-threads", LOOM_OPT_STR, &f.spec_threads, "N",
         "method draft: CPU threads of the draft (default 1)", 1, 0, NULL},
        {"speculative-device", LOOM_OPT_STR, &f.spec_device, "DEVICE",
         "method draft: the draft's device in the coordinator, cpu or cuda:N", 1, 0, NULL},
        {"speculative-config", LOOM_OPT_STR, &spec_config, "JSON",
         "vLLM's form: {\"method\": \"ngram\"|\"draft_model\"|\"deepseek_mtp\", \"model\": DIR, "
         "\"num_speculative_tokens\": K, \"prompt_lookup_min\": N, \"prompt_lookup_max\": N, "
         "\"quantization\": SCHEME}",
         1, 0, NULL},
        {"num-speculative-tokens", LOOM_OPT_STR, &f.spec_k, "K",
         "most drafted tokens per sequence per step, 1..16 (default 4)", 1, 0, NULL},
        {"ngram-min", LOOM_OPT_STR, &f.ngram_min, "N",
         "shortest suffix the ngram drafter looks up (default 1)", 1, 0, NULL},
        {"ngram-max", LOOM_OPT_STR, &f.ngram_max, "N",
         "longest suffix the ngram drafter looks up (default 4)", 1, 0, NULL},
        {"served-model-name", LOOM_OPT_STR, &f.served_name, "NAME",
         "model id clients use (default: the directory name)", 1, 0, NULL},
        {"dtype", LOOM_OPT_STR, &f.dtype, "TYPE",
         "weight storage: auto (f32), float32, bfloat16, float16/half, or f32, bf16, f16", 1, 0,
         NULL},
        {"quantization", LOOM_OPT_STR, &f.quantization, "SCHEME",
         "quantize weights on load: none, int8, fp8, q4, q4:64, q4:128, q4_min, q4_min:128 "
         "(AWQ/GPTQ checkpoints are read as they are)",
         1, 0, NULL},
        {"q", LOOM_OPT_STR, &f.quantization, "SCHEME", "same as --quantization", 1, 0, NULL},
        {"kv-cache-dtype", LOOM_OPT_STR, &f.kv_dtype, "TYPE",
         "KV cache elements: auto, f32, bf16, int8 (CPU), fp8 (CUDA)", 1, 0, NULL},
        {"block-size", LOOM_OPT_STR, &f.block_size, "N",
         "KV cache block size in tokens (default 16)", 1, 0, NULL},
        {"enable-expert-parallel", LOOM_OPT_FLAG, &f.expert_parallel, NULL,
         "Mixture-of-Experts layers: each TP rank holds whole experts instead of a slice of every "
         "one (loom-coordinator --expert-parallel)",
         1, 0, NULL},
        {"enable-dp-attention", LOOM_OPT_FLAG, &f.dp_attention, NULL,
         "DeepSeek (MLA): each TP rank runs attention for its own sequences and holds only their KV; "
         "implies --enable-expert-parallel (loom-coordinator --enable-dp-attention)",
         1, 0, NULL},
        {"disable-mla", LOOM_OPT_FLAG, &f.mla_disable, NULL,
         "DeepSeek: decompressed keys and values per head in the KV cache and ordinary attention instead of "
         "the latent (vLLM's VLLM_MLA_DISABLE; the coordinator also reads LOOM_MLA_DISABLE=1; "
         "loom-coordinator --disable-mla)",
         1, 0, NULL},
        {"enable-prefix-caching", LOOM_OPT_FLAG, &f.prefix_on, NULL,
         "automatic prefix caching (the default)", 1, 0, NULL},
        {"no-enable-prefix-caching", LOOM_OPT_FLAG, &f.prefix_off, NULL,
         "no automatic prefix caching", 1, 0, NULL},
        {"async-scheduling", LOOM_OPT_FLAG, &f.async_scheduling, NULL,
         "overlapped scheduling: each decode step is planned while the previous one runs (one pipeline stage; "
         "loom-coordinator --async-scheduling)",
         1, 0, NULL},
        {"api-key", LOOM_OPT_STR, &f.api_key, "KEY",
         "require this key (Authorization: Bearer KEY) on /v1/... (default: open, or LOOM_API_KEY)",
         1, 0, NULL},
        {"seed", LOOM_OPT_STR, &f.seed, "N",
         "seeds of requests that bring none are drawn from this one (reproducible runs)", 1, 0,
         NULL},
        {"embedding-pooling", LOOM_OPT_STR, &f.embedding_pooling, "last|mean",
         "/v1/embeddings: the last token's final hidden state (default) or the mean over all "
         "tokens, L2-normalised",
         1, 0, NULL},
        {"chat-template", LOOM_OPT_STR, &f.chat_template, "FILE|NAME",
         "a Jinja chat template file, its text, or a template Loom ships (chatml) (default: the "
         "model's)",
         1, 0, NULL},
        {"trust-request-chat-template", LOOM_OPT_FLAG, &f.trust_request_template, NULL,
         "render a request's own chat_template", 1, 0, NULL},
        {"tool-call-parser", LOOM_OPT_STR, &f.tool_parser, "NAME",
         "the model's tool-call syntax (hermes, llama3_json, mistral, granite, deepseek_v3, "
         "deepseek_v31, pythonic, llama4_pythonic, qwen3_coder, openai; default: from the chat template)",
         1, 0, NULL},
        {"enable-auto-tool-choice", LOOM_OPT_FLAG, &f.auto_tool_choice, NULL,
         "accepted for vLLM compatibility (tool_choice auto is always on)", 1, 0, NULL},
        {"reasoning-parser", LOOM_OPT_STR, &f.reasoning_parser, "NAME",
         "split the reasoning off chat answers: deepseek_r1, qwen3, granite, openai", 1, 0, NULL},
        {"generation-config", LOOM_OPT_STR, &f.generation_config, "auto|vllm|DIR",
         "sampling defaults for requests that leave them out: auto (the model's "
         "generation_config.json), vllm (built-in), or DIR (default auto)",
         1, 0, NULL},
        {"log-level", LOOM_OPT_STR, &f.log_level, "LEVEL",
         "debug, info, warning, error, critical (default info)", 1, 0, NULL},
        {"uvicorn-log-level", LOOM_OPT_STR, &f.log_level, "LEVEL", "same as --log-level", 1, 0,
         NULL},
        {"log-format", LOOM_OPT_STR, &f.log_format, "FMT", "text or json lines", 1, 0, NULL},
        {"max-queue", LOOM_OPT_STR, &f.max_queue, "N",
         "most waiting requests; beyond them HTTP 429 (default 1024)", 1, 0, NULL},
        {"kv-cache-memory", LOOM_OPT_STR, &f.kv_memory, "BYTES",
         "KV pool bytes per worker, e.g. 2G (default: a fraction of free memory)", 1, 0, NULL},
        {"kv-offloading-size", LOOM_OPT_STR, &f.kv_offload_size, "GiB",
         "host memory per worker for KV blocks leaving the pool (the host tier) (default off)", 1, 0, NULL},
        {"kv-offloading-backend", LOOM_OPT_STR, &f.kv_offload_backend, "native",
         "the host tier's implementation: native (the only one)", 1, 0, NULL},
        {"recovery-timeout-ms", LOOM_OPT_STR, &f.recovery_ms, "MS",
         "how long requests wait for a restarted worker (default 10000)", 1, 0, NULL},
        {"shutdown-timeout", LOOM_OPT_INT, &s.shutdown_timeout_s, "S",
         "on SIGTERM/SIGINT, requests in flight may run this long (default 30)", 0, 86400, NULL},
        {"device", LOOM_OPT_STR, &device, "DEV",
         "cpu, or cuda (worker i gets cuda:i) (default cpu)", 1, 0, NULL},
        {"threads", LOOM_OPT_INT, &threads, "N",
         "compute threads per worker (default: cores / workers)", 0, 1024, NULL},
        {"zmq-listen", LOOM_OPT_STR, &zmq_listen, "ADDR",
         "also the loom.v1 ZeroMQ API here (default: a free port on 127.0.0.1, see the log)", 1, 0,
         NULL},
        {"insecure", LOOM_OPT_FLAG, &insecure, NULL,
         "do not key the internal planes (CURVE on the control plane, and on --zmq-listen when "
         "other hosts can reach it); by default every run makes a fresh key set",
         1, 0, NULL},
    };
    /* vLLM's LoRA flags: checked here as the coordinator does, before anything starts */
    loom_lora_serve_opts_t lora;
    loom_lora_serve_opts_init(&lora);
    loom_err_t lora_err = {0};
    if (loom_lora_serve_take_args(&argc, argv, &lora, &lora_err) != LOOM_OK) {
        fprintf(stderr, "error: %s\n", lora_err.msg);
        return 2;
    }
    int first = 2;
    if (argc > 2 && argv[2][0] != '-') model = argv[first++];
    int r = loom_cli_parse_vllm(argc, argv, first, opts, (int)LOOM_ARRAY_LEN(opts), "loom serve MODEL_DIR [options]",
                                "Serves a model with the OpenAI-compatible HTTP API: starts a coordinator and tp x pp\n"
                                "workers on this machine, supervises them (a worker that dies is restarted; the\n"
                                "coordinator dying stops everything) and stops them all on SIGTERM/SIGINT. Takes\n"
                                "vLLM's flag names; see docs/operations.md for the table.\n\n"
                                "LoRA (docs/lora.md): --enable-lora, --lora-modules NAME=PATH|JSON..., --max-loras N\n"
                                "(default 1), --max-lora-rank N (default 16), --max-cpu-loras N,\n"
                                "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True). Every\n"
                                "adapter is checked against the model at start-up; a request's \"model\" names it.");
    if (r) return r < 0 ? 2 : 0;
    if (!model) {
        fprintf(stderr, "error: loom serve needs a model directory: loom serve MODEL_DIR (see --help)\n");
        return 2;
    }
    if (loom_lora_serve_startup(&lora, model, &lora_err) != LOOM_OK) {
        fprintf(stderr, "error: %s\n", lora_err.msg);
        return 2;
    }
    if (spec_config && speculative_config(&f, spec_config) < 0) return 2;
    char cfg_path[PATH_MAX];
    struct stat sb;
    if (!loom_path_join(cfg_path, sizeof cfg_path, model, "config.json") || stat(cfg_path, &sb) != 0 ||
        !S_ISREG(sb.st_mode)) {
        fprintf(stderr, "error: %s/config.json not found: loom serve takes a Hugging Face model directory\n", model);
        return 2;
    }
    if (f.prefix_on && f.prefix_off) {
        fprintf(stderr, "error: --enable-prefix-caching and --no-enable-prefix-caching contradict each other\n");
        return 2;
    }
    int cuda = !strcmp(device, "cuda");
    if (!cuda && strcmp(device, "cpu")) {
        fprintf(stderr, "error: --device must be cpu or cuda, got '%s'\n", device);
        return 2;
    }
    if (find_bin_dir(s.bin_dir, sizeof s.bin_dir) < 0) {
        fprintf(stderr, "error: cannot tell where the loom binaries are; set LOOM_BIN\n");
        return 1;
    }
    char coord_bin[PATH_MAX + 32], worker_bin[PATH_MAX + 32];
    snprintf(coord_bin, sizeof coord_bin, "%s/loom-coordinator", s.bin_dir);
    snprintf(worker_bin, sizeof worker_bin, "%s/loom-worker", s.bin_dir);
    if (access(coord_bin, X_OK) != 0 || access(worker_bin, X_OK) != 0) {
        fprintf(stderr, "error: loom-coordinator and loom-worker must be next to loom (looked in %s; set LOOM_BIN)\n",
                s.bin_dir);
        return 1;
    }
    int ctl_port = free_port(), api_port = zmq_listen ? 0 : free_port();
    if (ctl_port < 0 || api_port < 0) {
        fprintf(stderr, "error: no free port on 127.0.0.1: %s\n", strerror(errno));
        return 1;
    }
    snprintf(s.run_dir, sizeof s.run_dir, "%s/loom-serve-XXXXXX", "/tmp");
    const char *tmp = getenv("TMPDIR");
    if (tmp && tmp[0] && strlen(tmp) < 40) snprintf(s.run_dir, sizeof s.run_dir, "%s/loom-serve-XXXXXX", tmp);
    if (!mkdtemp(s.run_dir)) {
        fprintf(stderr, "error: cannot create a run directory %s: %s\n", s.run_dir, strerror(errno));
        return 1;
    }
    snprintf(s.ready_file, sizeof s.ready_file, "%s/ready", s.run_dir);

    char zmq_addr[300], ctl_addr[64], url[300];
    if (zmq_listen && loom_endpoint_normalize(zmq_listen, zmq_addr, sizeof zmq_addr) < 0) {
        fprintf(stderr, "error: --zmq-listen: '%s' is not an address\n", zmq_listen);
        rmdir(s.run_dir);
        return 2;
    }
    if (!zmq_listen) snprintf(zmq_addr, sizeof zmq_addr, "tcp://127.0.0.1:%d", api_port);
    snprintf(ctl_addr, sizeof ctl_addr, "127.0.0.1:%d", ctl_port); /* the control plane: this machine only */
    snprintf(url, sizeof url, strchr(host, ':') ? "http://[%s]:%d/v1" : "http://%s:%d/v1", host, port);

    child_t *co = &s.coord;
    snprintf(co->name, sizeof co->name, "coordinator");
    argv_list_t *a = &co->argv;
    argv_push(a, "%s", coord_bin);
    argv_push(a, "--model");
    argv_push(a, "%s", model);
    argv_push(a, "--tp");
    argv_push(a, "%d", tp);
    argv_push(a, "--pp");
    argv_push(a, "%d", pp);
    argv_push(a, "--listen");
    argv_push(a, "%s", zmq_addr);
    argv_push(a, "--control");
    argv_push(a, "%s", ctl_addr);
    argv_push(a, "--host");
    argv_push(a, "%s", host);
    argv_push(a, "--port");
    argv_push(a, "%d", port);
    argv_push(a, "--ready-file");
    argv_push(a, "%s", s.ready_file);
    argv_push(a, "--shutdown-timeout");
    argv_push(a, "%d", s.shutdown_timeout_s);
    const struct {
        const char *name, *value;
    } fwd[] = {
        {"max-model-len", f.max_model_len},
        {"max-num-seqs", f.max_num_seqs},
        {"max-num-batched-tokens", f.max_batched},
        {"served-model-name", f.served_name},
        {"quantization", f.quantization},
        {"kv-cache-dtype", f.kv_dtype},
        {"block-size", f.block_size},
        {"seed", f.seed},
        {"chat-template", f.chat_template},
        {"tool-call-parser", f.tool_parser},
        {"reasoning-parser", f.reasoning_parser},
        {"generation-config", f.generation_config},
        {"log-level", f.log_level},
        {"dtype", f.dtype},
        {"max-queue", f.max_queue},
        {"kv-cache-memory", f.kv_memory},
        {"kv-offloading-size", f.kv_offload_size},
        {"kv-offloading-backend", f.kv_offload_backend},
        {"recovery-timeout-ms", f.recovery_ms},
        {"log-format", f.log_format},
        {"embedding-pooling", f.embedding_pooling},
        {"speculative-method", f.spec_method},
        {"num-speculative-tokens", f.spec_k},
        {"ngram-min", f.ngram_min},
        {"ngram-max", f.ngram_max},
        {"speculative-model", f.spec_model},
        {"speculative-quantization", f.spec_quant},
        {"speculative-max-seqs", f.spec_max_seqs},
        {"speculative-threads", f.spec_threads},
        {"speculative-device", f.spec_device},
    };
    for (size_t i = 0; i < LOOM_ARRAY_LEN(fwd); i++)
        if (fwd[i].value) {
            argv_push(a, "--%s", fwd[i].name);
            argv_push(a, "%s", fwd[i].value);
        }
    if (f.prefix_off) argv_push(a, "--no-prefix-cache");
    if (f.async_scheduling) argv_push(a, "--async-scheduling");
    if (f.expert_parallel) argv_push(a, "--expert-parallel");
    if (f.dp_attention) argv_push(a, "--enable-dp-attention");
    if (f.mla_disable) argv_push(a, "--disable-mla");
    if (f.trust_request_template) argv_push(a, "--trust-request-chat-template");
    if (f.auto_tool_choice) argv_push(a, "--enable-auto-tool-choice");
    lora_forward(a, &lora);
    /* the key goes in the environment, not on a command line other users can read in /proc */
    if (f.api_key) setenv("LOOM_API_KEY", f.api_key, 1);

    s.n_workers = tp * pp;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (threads == 0) threads = (int)LOOM_MAX(1, (cores > 0 ? cores : 1) / s.n_workers);
    s.workers = loom_xcalloc((size_t)s.n_workers, sizeof *s.workers);
    if (serve_cluster_keys(&s, insecure, zmq_addr, a) < 0) {
        rmdir(s.run_dir);
        return 1;
    }
    for (int i = 0; i < s.n_workers; i++) {
        child_t *w = &s.workers[i];
        snprintf(w->name, sizeof w->name, "worker %d", i);
        argv_push(&w->argv, "%s", worker_bin);
        argv_push(&w->argv, "--coordinator");
        argv_push(&w->argv, "%s", ctl_addr);
        argv_push(&w->argv, "--threads");
        argv_push(&w->argv, "%d", threads);
        argv_push(&w->argv, "--device");
        if (cuda) argv_push(&w->argv, "cuda:%d", i);
        else argv_push(&w->argv, "cpu");
        if (f.log_format) {
            argv_push(&w->argv, "--log-format");
            argv_push(&w->argv, "%s", f.log_format);
        }
        serve_worker_keys(&s, i, &w->argv);
    }
    if (f.log_level) { /* the workers have no flag for it: LOOM_LOG_LEVEL, in vLLM's words */
        const char *lv = f.log_level;
        if (!strcmp(lv, "warning")) lv = "warn";
        else if (!strcmp(lv, "critical")) lv = "error";
        else if (!strcmp(lv, "trace")) lv = "debug";
        setenv("LOOM_LOG_LEVEL", lv, 1);
    }

    struct sigaction sa = {.sa_handler = on_stop_signal};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    struct sigaction sc = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
    sigaction(SIGCHLD, &sc, NULL);
    signal(SIGPIPE, SIG_IGN);

    LOOM_INFO("starting %s: coordinator and %d worker(s) (tp %d x pp %d, %d thread(s) each, device %s); HTTP on %s",
              model, s.n_workers, tp, pp, threads, device, url);
    int rc;
    if (spawn(&s, co) < 0) {
        rc = 1;
    } else {
        for (int i = 0; i < s.n_workers; i++) {
            s.workers[i].window_start = loom_now_s();
            if (spawn(&s, &s.workers[i]) < 0) {
                begin_stop(&s, 1, "a worker could not be started");
                break;
            }
        }
        rc = supervise(&s, url, zmq_addr, model);
    }
    LOOM_INFO("stopped (exit status %d)", rc);
    unlink(s.ready_file);
    serve_remove_keys(&s);
    rmdir(s.run_dir);
    argv_free(&co->argv);
    for (int i = 0; i < s.n_workers; i++) argv_free(&s.workers[i].argv);
    free(s.workers);
    return rc;
}
