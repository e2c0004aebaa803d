/* The `loom` command-line tool: run a model locally, or talk to a cluster. */
#include <stdio.h>
#include <string.h>

#include "client/commands.h"
#include "common/cpu_check.h"
#include "common/log.h"
#include "kernels/cpu/backend_cpu.h"

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
    int computes; /* runs a model in this process (prefill uses OpenBLAS) */
} k_commands[] = {
    {"serve", loom_cmd_serve, "serve a model over the OpenAI HTTP API: coordinator + workers on this machine", 0},
    {"run", loom_cmd_run, "load a model in this process and stream a completion", 1},
    {"quantize", loom_cmd_quantize, "write a quantized copy of a model directory (int8, fp8, q4 ...)", 0},
    {"perplexity", loom_cmd_perplexity, "perplexity, KL and top-1 agreement of a weight / KV cache scheme", 1},
    {"generate", loom_cmd_generate, "stream a completion from a running cluster", 0},
    {"health", loom_cmd_health, "ask a cluster whether it is ready", 0},
    {"stats", loom_cmd_stats, "show a cluster's scheduler and KV cache statistics", 0},
    {"embed", loom_cmd_embed, "print a text's embedding from a running cluster", 0},
    {"bench", loom_cmd_bench, "load-test a cluster (Poisson arrivals; TTFT, TPOT, throughput)", 0},
    {"keygen", loom_cmd_keygen, "make CURVE key pairs and allow-lists for a cluster's planes", 0},
    {"info", loom_cmd_info, "list the backends, the devices and which model types each backend runs", 0},
};

static void usage(void) {
    printf("usage: loom <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
        printf("  %-10s %s\n", k_commands[i].name, k_commands[i].help);
    printf("\nRun `loom <command> --help` for the options of each command.\n");
}

int main(int argc, char **argv) {
    loom_cpu_check_or_exit("loom");
    loom_log_init("loom");
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage();
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
        if (!strcmp(argv[1], k_commands[i].name)) {
            if (k_commands[i].computes) loom_cpu_blas_check(argv); /* it may re-execute */
            return k_commands[i].fn(argc, argv);
        }
    fprintf(stderr, "error: unknown command '%s' (see loom --help)\n", argv[1]);
    return 2;
}
