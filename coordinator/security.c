/* CURVE on the coordinator's two sockets (coordinator/security.h). */
#include "coordinator/security.h"

#include <string.h>
#include <sys/random.h>
#include <zmq.h>

#include "common/keys.h"
#include "common/log.h"

loom_status_t loom_coord_security_check(const loom_coord_security_t *cfg, const char *listen, const char *control,
                                        loom_err_t *err) {
    const char *secret = loom_key_source(cfg->curve_secret, "LOOM_CURVE_SECRET");
    const char *workers = loom_key_source(cfg->worker_keys, "LOOM_WORKER_KEYS");
    const char *clients = loom_key_source(cfg->client_keys, "LOOM_CLIENT_KEYS");
    if ((workers || clients) && !secret)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--worker-keys/--client-keys need the coordinator's own key: --curve-secret FILE "
                            "(or LOOM_CURVE_SECRET); make one with 'loom keygen'");
    if (secret && !workers && !clients)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--curve-secret needs an allow-list to check peers against: --worker-keys FILE "
                            "and/or --client-keys FILE");
    if (!clients && !cfg->insecure_api && !loom_endpoint_is_local(listen))
        return loom_zap_api_rule(listen, 0, 0, "the client API", err); /* the refusal */
    if (workers || cfg->insecure) return LOOM_OK;
    if (!loom_endpoint_is_local(control))
        return loom_err_set(err, LOOM_ERR_UNAUTHENTICATED,
                            "the control plane binds %s, which other hosts can reach, without keys: any of them "
                            "could register as a worker, see every prompt's tokens and choose the output. Give "
                            "--curve-secret FILE --worker-keys FILE ('loom keygen --cluster' makes them; "
                            "deploy/local/launch.sh and 'loom serve' do), or --insecure to run it unkeyed",
                            control);
    return loom_err_set(err, LOOM_ERR_UNAUTHENTICATED,
                        "the control plane (%s) is not keyed: any process on this host could register as a "
                        "worker, see every prompt's tokens and choose the output. Give --curve-secret FILE "
                        "--worker-keys FILE ('loom keygen --cluster' makes them; deploy/local/launch.sh and "
                        "'loom serve' do), or --insecure to run it unkeyed",
                        control);
}

loom_status_t loom_coord_security_setup(const loom_coord_security_t *cfg, void *zctx, void *api, void *ctl,
                                        void *events, const char *listen, const char *control, loom_zap_t **zap,
                                        loom_zap_t **ctl_zap, loom_err_t *err) {
    *zap = *ctl_zap = NULL;
    LOOM_CHECK(loom_coord_security_check(cfg, listen, control, err));
    const char *secret = loom_key_source(cfg->curve_secret, "LOOM_CURVE_SECRET");
    const char *workers = loom_key_source(cfg->worker_keys, "LOOM_WORKER_KEYS");
    const char *clients = loom_key_source(cfg->client_keys, "LOOM_CLIENT_KEYS");
    int ctl_local = loom_endpoint_is_local(control);
    LOOM_CHECK(loom_zap_api_rule(listen, clients != NULL, cfg->insecure_api, "the client API", err)); /* its warning */
    loom_keypair_t kp;
    if (secret) LOOM_CHECK(loom_keypair_read(secret, "the coordinator's secret key (--curve-secret)", &kp, err));
    if (workers || clients) {
        loom_zap_t *z = NULL;
        LOOM_CHECK(loom_zap_create(zctx, &z, err));
        loom_status_t st = LOOM_OK;
        if (workers) st = loom_zap_secure(z, ctl, LOOM_ZAP_CONTROL, "worker", &kp, workers, err);
        if (st >= 0 && clients) st = loom_zap_secure(z, api, LOOM_ZAP_API, "client", &kp, clients, err);
        if (st >= 0 && clients && events)
            st = loom_zap_secure(z, events, LOOM_ZAP_EVENTS, "KV-events subscriber", &kp, clients, err);
        if (st >= 0) st = loom_zap_start(z, err);
        if (st < 0) {
            loom_zap_stop(&z);
            return st;
        }
        *zap = z;
        if (workers) {
            /* a routing id is bound to a key: no connection takes over another's.
             * A worker that comes back under its id then needs its old
             * connection gone: ZMTP heartbeats close a silent one (a host cut
             * off, a peer that died without a FIN) within 2 s. */
            int zero = 0, ivl = 500, timeout = 2000;
            zmq_setsockopt(ctl, ZMQ_ROUTER_HANDOVER, &zero, sizeof zero);
            zmq_setsockopt(ctl, ZMQ_HEARTBEAT_IVL, &ivl, sizeof ivl);
            zmq_setsockopt(ctl, ZMQ_HEARTBEAT_TIMEOUT, &timeout, sizeof timeout);
            *ctl_zap = z;
        }
        LOOM_INFO("CURVE: control plane %s, client API %s%s (server key %.8s...)",
                  workers ? "keyed (workers from --worker-keys)" : "NOT keyed",
                  clients ? "keyed (clients from --client-keys)" : "not keyed",
                  clients && events ? ", KV events keyed (the same clients)" : "", kp.public_z85);
    }
    if (!workers && ctl_local) /* --insecure: loom_coord_security_check refuses it otherwise */
        LOOM_WARN("--insecure: the control plane (%s) is not keyed: any process on this host can register as a "
                  "worker and see every prompt's tokens. deploy/local/launch.sh and 'loom serve' key it "
                  "(--curve-secret and --worker-keys)",
                  control);
    if (!workers && !ctl_local)
        LOOM_WARN("*** SECURITY: the control plane binds %s without keys: any host that reaches it can register "
                  "as a worker, see every prompt's tokens and choose the output. Give --curve-secret and "
                  "--worker-keys (deploy/local/launch.sh does). ***",
                  control);
    if (cfg->encrypt_data && !workers)
        LOOM_WARN("--encrypt-data-plane without --worker-keys: each epoch's data-plane secret, and so the frame "
                  "keys, cross the unkeyed control plane in clear");
    return LOOM_OK;
}

void loom_coord_epoch_secret(uint8_t *out, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = getrandom(out + got, n - got, 0);
        LOOM_ASSERT(r > 0); /* getrandom(2) on Linux >= 3.17 only fails for bad arguments */
        got += (size_t)r;
    }
}
