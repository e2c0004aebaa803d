/* Subcommands of the `loom` command-line tool. Each returns the exit code. */
#ifndef LOOM_COMMANDS_H
#define LOOM_COMMANDS_H

#include <stdlib.h>

int loom_cmd_serve(int argc, char **argv);    /* cmd_serve.c: coordinator + workers, supervised */
int loom_cmd_run(int argc, char **argv);      /* cmd_run.c: the model in this process */
int loom_cmd_quantize(int argc, char **argv); /* cmd_quantize.c: a quantized copy of a checkpoint */
int loom_cmd_perplexity(int argc, char **argv); /* cmd_perplexity.c: a storage scheme's quality */
int loom_cmd_generate(int argc, char **argv); /* cmd_generate.c: a completion from a cluster */
int loom_cmd_health(int argc, char **argv);
int loom_cmd_stats(int argc, char **argv);
int loom_cmd_embed(int argc, char **argv);    /* cmd_generate.c: a text's embedding from a cluster */
int loom_cmd_bench(int argc, char **argv);    /* cmd_bench.c: the serving load generator */
int loom_cmd_keygen(int argc, char **argv);   /* cmd_keygen.c: CURVE key pairs and allow-lists */
int loom_cmd_info(int argc, char **argv);     /* cmd_info.c: backends, devices, what each runs */

/* The options every command that talks to a coordinator has (common/cli.h
 * loom_opt_t entries). */
#define LOOM_CMD_OPT_ADDR(var)                                                                     \
    {"addr", LOOM_OPT_STR, &(var), "ADDR",                                                         \
     "coordinator address, tcp://host:port or host:port (default $LOOM_ADDR)", 1, 0, NULL}
#define LOOM_CMD_OPT_API_KEY(var)                                                                  \
    {"api-key", LOOM_OPT_STR, &(var), "KEY", "API key, when the server requires one", 1, 0, NULL}

/* CURVE keys for a coordinator started with --client-keys. The flags win
 * over the environment: they are put in it, where the client library reads
 * them (client/loom_client.h). */
#define LOOM_CMD_OPT_CURVE(server_var, secret_var)                                                 \
    {"curve-server-key", LOOM_OPT_STR, &(server_var), "FILE",                                      \
     "the coordinator's CURVE public key (default $LOOM_CURVE_SERVER_KEY: a file or the Z85 key)", \
     1, 0, NULL},                                                                                  \
    {"curve-secret", LOOM_OPT_STR, &(secret_var), "FILE",                                          \
     "this client's CURVE secret key, listed in the coordinator's --client-keys (default "         \
     "$LOOM_CURVE_SECRET)", 1, 0, NULL}

static inline void loom_cmd_curve_env(const char *server, const char *secret) {
    if (server) setenv("LOOM_CURVE_SERVER_KEY", server, 1);
    if (secret) setenv("LOOM_CURVE_SECRET", secret, 1);
}

#endif
