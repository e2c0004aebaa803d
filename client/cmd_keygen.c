/* `loom keygen`: CURVE key pairs for the control plane and the client API,
 * and the allow-lists the coordinator checks them against. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "client/commands.h"
#include "common/cli.h"
#include "common/keys.h"
#include "common/util.h"

int loom_cmd_keygen(int argc, char **argv) {
    const char *dir = ".", *name = NULL, *allow = NULL, *prefix = "worker-";
    int cluster = 0, workers = 0, clients = 0, force = 0;
    loom_opt_t opts[] = {
        {"dir", LOOM_OPT_STR, &dir, "DIR", "where to write the files (default: the current directory)", 1, 0, NULL},
        {"name", LOOM_OPT_STR, &name, "NAME", "make one key pair: DIR/NAME.key (secret, mode 0600) and DIR/NAME.pub", 1, 0, NULL},
        {"allow", LOOM_OPT_STR, &allow, "FILE", "with --name: also append 'NAME PUBLIC_KEY' to this allow-list", 1, 0, NULL},
        {"cluster", LOOM_OPT_FLAG, &cluster, NULL, "make a cluster's key set: coordinator.key/.pub, --workers worker pairs listed in workers.allow, --clients client pairs in clients.allow", 1, 0, NULL},
        {"workers", LOOM_OPT_INT, &workers, "N", "with --cluster: worker key pairs, named PREFIX0..PREFIX(N-1) like the workers' --id (default 0: add them with --name NAME --allow workers.allow)", 0, 65536, NULL},
        {"worker-prefix", LOOM_OPT_STR, &prefix, "PREFIX", "with --cluster: worker key names (default worker-)", 1, 0, NULL},
        {"clients", LOOM_OPT_INT, &clients, "M", "with --cluster: client key pairs client-0.. in clients.allow (default 0: no client keys)", 0, 65536, NULL},
        {"force", LOOM_OPT_FLAG, &force, NULL, "replace existing secret keys", 1, 0, NULL},
    };
    int r = loom_cli_parse(argc, argv, 2, opts, (int)LOOM_ARRAY_LEN(opts),
                           "loom keygen --name NAME [--dir DIR] [--allow FILE]\n"
                           "       loom keygen --cluster --workers N [--clients M] [--dir DIR]",
                           "Makes CURVE key pairs (Z85 text) for the coordinator, its workers and its clients.\n"
                           "The coordinator takes --curve-secret coordinator.key --worker-keys workers.allow\n"
                           "[--client-keys clients.allow]; a worker takes --curve-server-key coordinator.pub\n"
                           "--curve-secret worker-I.key; a client the same with its client key. An allow-list\n"
                           "has one 'NAME PUBLIC_KEY' line per peer.");
    if (r) return r < 0 ? 2 : 0;
    if (!!cluster == !!name) {
        fprintf(stderr, "error: give --name NAME or --cluster (see loom keygen --help)\n");
        return 2;
    }
    loom_err_t err = {0};
    if (cluster) {
        if (loom_keys_make_set(dir, workers, prefix, clients, 0, force, &err) < 0) {
            fprintf(stderr, "error: %s\n", err.msg);
            return 1;
        }
        printf("%s: coordinator.key/.pub, %d worker key pair(s) in workers.allow%s\n", dir, workers,
               clients ? ", client key pair(s) in clients.allow" : "");
        return 0;
    }
    loom_keypair_t kp;
    if (loom_keys_generate(&kp, &err) < 0 || loom_keys_write(dir, name, &kp, force, &err) < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    if (allow) {
        FILE *f = fopen(allow, "a");
        if (!f || fprintf(f, "%s %s\n", name, kp.public_z85) < 0) {
            fprintf(stderr, "error: cannot append to %s\n", allow);
            if (f) fclose(f);
            return 1;
        }
        fclose(f);
    }
    printf("%s\n", kp.public_z85);
    return 0;
}
