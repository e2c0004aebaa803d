/* kv_transfer_params (kv_transfer.h). */
#include "coordinator/kv_transfer.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/block_hash.h"
#include "common/util.h"

static const cJSON *get(const cJSON *o, const char *k) { return cJSON_GetObjectItemCaseSensitive(o, k); }

/* kv_connector_extra_config's transport, lease_ms, secret_file, insecure, shm, encrypt. */
static loom_status_t parse_extra(const cJSON *x, loom_kv_transfer_config_t *out, loom_err_t *err) {
    out->lease_ms = LOOM_KV_LEASE_MS_DEFAULT;
    if (!x) return LOOM_OK;
    const cJSON *t = get(x, "transport"), *lease = get(x, "lease_ms"), *sf = get(x, "secret_file"),
                *ins = get(x, "insecure"), *shm = get(x, "shm"), *enc = get(x, "encrypt");
    if (t && (!cJSON_IsString(t) || (strcmp(t->valuestring, "dir") && strcmp(t->valuestring, "tcp"))))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--kv-transfer-config: kv_connector_extra_config.transport must be \"dir\" or \"tcp\"");
    out->transport = t && !strcmp(t->valuestring, "tcp") ? LOOM_KV_TRANSPORT_TCP : LOOM_KV_TRANSPORT_DIR;
    if (lease) {
        if (!cJSON_IsNumber(lease) || lease->valuedouble < 1 || lease->valuedouble > 86400000.0)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "--kv-transfer-config: kv_connector_extra_config.lease_ms must be 1 to 86400000");
        out->lease_ms = (int)lease->valuedouble;
    }
    if (sf && (!cJSON_IsString(sf) || !sf->valuestring[0] || strlen(sf->valuestring) >= sizeof out->secret_file))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--kv-transfer-config: kv_connector_extra_config.secret_file must be a file's path");
    if (sf) snprintf(out->secret_file, sizeof out->secret_file, "%s", sf->valuestring);
    if (ins && !cJSON_IsBool(ins))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--kv-transfer-config: kv_connector_extra_config.insecure must be true or false");
    out->insecure = cJSON_IsTrue(ins);
    if (shm && (!cJSON_IsString(shm) || (strcmp(shm->valuestring, "auto") && strcmp(shm->valuestring, "off"))))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--kv-transfer-config: kv_connector_extra_config.shm must be \"auto\" or \"off\"");
    out->shm_off = shm && !strcmp(shm->valuestring, "off");
    if (enc && !cJSON_IsBool(enc))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--kv-transfer-config: kv_connector_extra_config.encrypt must be true or false");
    out->encrypt = cJSON_IsTrue(enc);
    if (out->encrypt && !out->secret_file[0])
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--kv-transfer-config: kv_connector_extra_config.encrypt needs secret_file (the keys "
                            "come from the secret)");
    if (out->transport == LOOM_KV_TRANSPORT_TCP && !out->secret_file[0] && !out->insecure)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--kv-transfer-config: transport tcp needs kv_connector_extra_config.secret_file (a "
                            "secret both replicas hold) or, to run unauthenticated, insecure: true");
    if (out->transport == LOOM_KV_TRANSPORT_DIR && (sf || ins || shm || enc))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--kv-transfer-config: secret_file, insecure, shm and encrypt are for transport tcp");
    return LOOM_OK;
}

loom_status_t loom_kv_transfer_read_secret(loom_kv_transfer_config_t *cfg, loom_err_t *err) {
    uint8_t *secret = cfg->secret;
    const size_t cap = sizeof cfg->secret;
    cfg->secret_len = 0;
    if (!cfg->secret_file[0]) return LOOM_OK;
    FILE *f = fopen(cfg->secret_file, "rb");
    if (!f)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "kv_connector_extra_config.secret_file %s: %s",
                            cfg->secret_file, strerror(errno));
    size_t n = fread(secret, 1, cap, f);
    int more = fgetc(f) != EOF;
    fclose(f);
    while (n > 0 && (secret[n - 1] == '\n' || secret[n - 1] == '\r')) n--;
    if (more)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "kv_connector_extra_config.secret_file %s: longer than %zu bytes", cfg->secret_file, cap);
    if (n < LOOM_KV_SECRET_MIN)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "kv_connector_extra_config.secret_file %s: %zu bytes, a secret needs at least %d",
                            cfg->secret_file, n, LOOM_KV_SECRET_MIN);
    cfg->secret_len = n;
    return LOOM_OK;
}

loom_status_t loom_kv_transfer_config_parse(const char *json, loom_kv_transfer_config_t *out, loom_err_t *err) {
    memset(out, 0, sizeof *out);
    cJSON *o = cJSON_Parse(json);
    loom_status_t st = LOOM_OK;
    if (!cJSON_IsObject(o)) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--kv-transfer-config is not a JSON object: %s", json);
        goto done;
    }
    const cJSON *c = get(o, "kv_connector"), *role = get(o, "kv_role"), *x = get(o, "kv_connector_extra_config");
    const cJSON *pol = get(o, "kv_load_failure_policy");
    if (!pol && cJSON_IsObject(x)) pol = get(x, "kv_load_failure_policy");
    if (!cJSON_IsString(c) || (strcmp(c->valuestring, "LoomConnector") && strcmp(c->valuestring, "LoomDirConnector"))) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                          "--kv-transfer-config: kv_connector must be \"LoomConnector\"");
        goto done;
    }
    const char *r = cJSON_IsString(role) ? role->valuestring : "kv_both";
    out->producer = !strcmp(r, "kv_producer") || !strcmp(r, "kv_both");
    out->consumer = !strcmp(r, "kv_consumer") || !strcmp(r, "kv_both");
    if (!out->producer && !out->consumer) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                          "--kv-transfer-config: kv_role must be kv_producer, kv_consumer or kv_both, not %s", r);
        goto done;
    }
    if (pol && (!cJSON_IsString(pol) || !loom_kv_load_policy_parse(pol->valuestring, &out->policy))) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                          "--kv-transfer-config: kv_load_failure_policy must be \"recompute\" or \"fail\"");
        goto done;
    }
    st = parse_extra(cJSON_IsObject(x) ? x : NULL, out, err);
done:
    cJSON_Delete(o);
    return st;
}

void loom_kv_transfer_engine_id(uint64_t tier_id, char out[64]) {
    snprintf(out, 64, "loom-%016" PRIx64, tier_id);
}

static int flag(const cJSON *o, const char *k) {
    const cJSON *x = get(o, k);
    return cJSON_IsTrue(x);
}

/* A list of hex chain hashes (remote_block_ids on dir, remote_block_hashes
 * on tcp), each that of the prompt's block i. */
static loom_status_t parse_blocks(const cJSON *ids, const char *field, const int32_t *prompt, int n_prompt,
                                  int block_size, uint64_t seed, loom_kv_transfer_req_t *out, loom_err_t *err) {
    if (!ids) return LOOM_OK;
    int n = cJSON_GetArraySize(ids), room = (n_prompt - 1) / block_size;
    if (!cJSON_IsArray(ids) || n > room)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "kv_transfer_params.%s must list at most %d blocks of this prompt", field, room);
    out->blocks = loom_xcalloc((size_t)(n > 0 ? n : 1), sizeof *out->blocks);
    uint64_t h = seed;
    int i = 0;
    for (const cJSON *b = ids->child; b; b = b->next, i++) {
        h = loom_kv_chain_hash(h, prompt + (size_t)i * block_size, block_size);
        char *end = NULL;
        uint64_t v = cJSON_IsString(b) ? strtoull(b->valuestring, &end, 16) : 0;
        if (!end || *end || v != h)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "kv_transfer_params.%s[%d] is not block %d of this prompt", field, i, i);
        out->blocks[i] = v;
    }
    out->n_blocks = n;
    return LOOM_OK;
}

/* Transport tcp: remote_block_hashes checked as above, remote_block_ids the
 * prefill's pool ids (as many), where to pull from and the hold's id. */
static loom_status_t parse_tcp(const cJSON *o, const int32_t *prompt, int n_prompt, int block_size, uint64_t seed,
                               loom_kv_transfer_req_t *out, loom_err_t *err) {
    loom_status_t st = parse_blocks(get(o, "remote_block_hashes"), "remote_block_hashes", prompt, n_prompt,
                                    block_size, seed, out, err);
    if (st < 0) return st;
    const cJSON *ids = get(o, "remote_block_ids"), *host = get(o, "remote_host"), *port = get(o, "remote_port");
    const cJSON *xid = get(o, "loom_transfer_id"), *tp = get(o, "tp_size");
    if (out->n_blocks == 0 && (!ids || (cJSON_IsArray(ids) && cJSON_GetArraySize(ids) == 0)))
        return LOOM_OK; /* a prompt shorter than a block: nothing to pull */
    if (!cJSON_IsArray(ids) || cJSON_GetArraySize(ids) != out->n_blocks)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "kv_transfer_params.remote_block_ids must list as many blocks as remote_block_hashes (%d)",
                            out->n_blocks);
    out->pool_blocks = loom_xcalloc((size_t)(out->n_blocks > 0 ? out->n_blocks : 1), sizeof *out->pool_blocks);
    int i = 0;
    for (const cJSON *b = ids->child; b; b = b->next, i++) {
        double v = cJSON_IsNumber(b) ? b->valuedouble : -1;
        if (v < 0 || v > INT32_MAX || v != (double)(int32_t)v)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "kv_transfer_params.remote_block_ids[%d] is not a block id", i);
        out->pool_blocks[i] = (int32_t)v;
    }
    const cJSON *ranks = get(o, "loom_remote_ranks");
    if (ranks) { /* every rank's KV service */
        size_t at = 0;
        int r = 0;
        if (!cJSON_IsArray(ranks) || cJSON_GetArraySize(ranks) < 1)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "kv_transfer_params.loom_remote_ranks must list "
                                "addresses");
        for (const cJSON *a = ranks->child; a; a = a->next, r++) {
            if (!cJSON_IsString(a) || !a->valuestring[0] || strchr(a->valuestring, ','))
                return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                    "kv_transfer_params.loom_remote_ranks[%d] is not an address", r);
            int w = snprintf(out->addrs + at, sizeof out->addrs - at, "%s%s", r ? "," : "", a->valuestring);
            if (w < 0 || (size_t)w >= sizeof out->addrs - at)
                return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "kv_transfer_params.loom_remote_ranks is too "
                                    "long");
            at += (size_t)w;
        }
    } else {
        if (!cJSON_IsString(host) || !host->valuestring[0] || strlen(host->valuestring) > 255)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "kv_transfer_params.remote_host is missing");
        if (!cJSON_IsNumber(port) || port->valuedouble < 1 || port->valuedouble > 65535)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "kv_transfer_params.remote_port is not a port");
        snprintf(out->addrs, sizeof out->addrs, strchr(host->valuestring, ':') ? "tcp://[%s]:%d" : "tcp://%s:%d",
                 host->valuestring, (int)port->valuedouble);
    }
    char *end = NULL;
    out->transfer_id = cJSON_IsString(xid) ? strtoull(xid->valuestring, &end, 16) : 0;
    if (!end || *end || !out->transfer_id)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "kv_transfer_params.loom_transfer_id is missing (the prefill ran on transport dir?)");
    out->tp_size = cJSON_IsNumber(tp) && tp->valuedouble >= 1 && tp->valuedouble <= 1024 ? (int)tp->valuedouble : 0;
    if (!out->tp_size)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "kv_transfer_params.tp_size is missing");
    return LOOM_OK;
}

loom_status_t loom_kv_transfer_parse(const char *json, const loom_kv_transfer_config_t *cfg, const char *engine_id,
                                     const int32_t *prompt, int n_prompt, int block_size, uint64_t seed,
                                     loom_kv_transfer_req_t *out, loom_err_t *err) {
    memset(out, 0, sizeof *out);
    if (!cfg || (!cfg->producer && !cfg->consumer))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "kv_transfer_params: this replica was started without --kv-transfer-config");
    cJSON *o = cJSON_Parse(json);
    loom_status_t st = LOOM_OK;
    if (!cJSON_IsObject(o)) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "kv_transfer_params must be a JSON object");
        goto done;
    }
    out->remote_decode = flag(o, "do_remote_decode");
    out->remote_prefill = flag(o, "do_remote_prefill");
    if (out->remote_decode && out->remote_prefill) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                          "kv_transfer_params: do_remote_decode and do_remote_prefill are both set");
    } else if (out->remote_decode && !cfg->producer) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                          "kv_transfer_params.do_remote_decode: this replica's kv_role is kv_consumer");
    } else if (out->remote_prefill) {
        const cJSON *e = get(o, "remote_engine_id");
        if (!cfg->consumer)
            st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                              "kv_transfer_params.do_remote_prefill: this replica's kv_role is kv_producer");
        else if (cfg->transport == LOOM_KV_TRANSPORT_TCP)
            st = parse_tcp(o, prompt, n_prompt, block_size, seed, out, err);
        else if (!cJSON_IsString(e) || strcmp(e->valuestring, engine_id))
            st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                              "kv_transfer_params.remote_engine_id %s is not this replica's (%s): the prefill ran on "
                              "another model, grid or KV tier",
                              cJSON_IsString(e) ? e->valuestring : "(missing)", engine_id);
        else
            st = parse_blocks(get(o, "remote_block_ids"), "remote_block_ids", prompt, n_prompt, block_size, seed, out,
                              err);
        if (cJSON_IsString(e)) snprintf(out->engine_id, sizeof out->engine_id, "%s", e->valuestring);
    }
done:
    cJSON_Delete(o);
    if (st < 0) loom_kv_transfer_req_free(out);
    return st;
}

void loom_kv_transfer_req_free(loom_kv_transfer_req_t *r) {
    free(r->blocks);
    free(r->pool_blocks);
    r->blocks = NULL;
    r->pool_blocks = NULL;
    r->n_blocks = 0;
}

char *loom_kv_transfer_params(const char *engine_id, const int32_t *prompt, int n_prompt, int block_size,
                              uint64_t seed, const char *host, int port, uint64_t request_id, int tp_size) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddBoolToObject(o, "do_remote_decode", 0);
    cJSON_AddBoolToObject(o, "do_remote_prefill", 1);
    cJSON_AddStringToObject(o, "remote_engine_id", engine_id);
    cJSON *ids = cJSON_AddArrayToObject(o, "remote_block_ids");
    uint64_t h = seed;
    char hex[24];
    for (int i = 0; i < (n_prompt - 1) / block_size; i++) {
        h = loom_kv_chain_hash(h, prompt + (size_t)i * block_size, block_size);
        snprintf(hex, sizeof hex, "%016" PRIx64, h);
        cJSON_AddItemToArray(ids, cJSON_CreateString(hex));
    }
    cJSON_AddStringToObject(o, "remote_host", host ? host : "");
    cJSON_AddNumberToObject(o, "remote_port", port);
    snprintf(hex, sizeof hex, "%" PRIu64, request_id);
    cJSON_AddStringToObject(o, "remote_request_id", hex);
    cJSON_AddNumberToObject(o, "tp_size", tp_size);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

/* "tcp://host:port" (or "[v6]:port") of the first address in addrs into host and port. */
static void first_addr(const char *addrs, char *host, size_t cap, int *port) {
    const char *a = strncmp(addrs, "tcp://", 6) ? addrs : addrs + 6, *end = strchr(a, ',');
    size_t len = end ? (size_t)(end - a) : strlen(a);
    const char *colon = memrchr(a, ':', len);
    *port = colon ? atoi(colon + 1) : 0;
    size_t hl = colon ? (size_t)(colon - a) : 0;
    if (hl >= 2 && a[0] == '[' && a[hl - 1] == ']') { /* [v6] */
        a++;
        hl -= 2;
    }
    snprintf(host, cap, "%.*s", (int)LOOM_MIN(hl, cap - 1), a);
}

char *loom_kv_transfer_params_tcp(const char *engine_id, const int32_t *prompt, const int32_t *blocks, int n,
                                  int block_size, uint64_t seed, const char *addrs, uint64_t request_id,
                                  uint64_t transfer_id, int tp_size) {
    char host[256];
    int port = 0;
    first_addr(addrs, host, sizeof host, &port);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddBoolToObject(o, "do_remote_decode", 0);
    cJSON_AddBoolToObject(o, "do_remote_prefill", 1);
    cJSON_AddStringToObject(o, "remote_engine_id", engine_id);
    cJSON *ids = cJSON_AddArrayToObject(o, "remote_block_ids");
    cJSON *hashes = cJSON_AddArrayToObject(o, "remote_block_hashes");
    uint64_t h = seed;
    char hex[24];
    for (int i = 0; i < n; i++) {
        cJSON_AddItemToArray(ids, cJSON_CreateNumber(blocks[i]));
        h = loom_kv_chain_hash(h, prompt + (size_t)i * block_size, block_size);
        snprintf(hex, sizeof hex, "%016" PRIx64, h);
        cJSON_AddItemToArray(hashes, cJSON_CreateString(hex));
    }
    cJSON_AddStringToObject(o, "remote_host", host);
    cJSON_AddNumberToObject(o, "remote_port", port);
    cJSON *ranks = cJSON_AddArrayToObject(o, "loom_remote_ranks");
    for (const char *a = addrs; *a;) {
        const char *end = strchr(a, ',');
        size_t len = end ? (size_t)(end - a) : strlen(a);
        char one[512];
        snprintf(one, sizeof one, "%.*s", (int)LOOM_MIN(len, sizeof one - 1), a);
        cJSON_AddItemToArray(ranks, cJSON_CreateString(one));
        a += len + (end ? 1 : 0);
    }
    snprintf(hex, sizeof hex, "%" PRIu64, request_id);
    cJSON_AddStringToObject(o, "remote_request_id", hex);
    snprintf(hex, sizeof hex, "%016" PRIx64, transfer_id);
    cJSON_AddStringToObject(o, "loom_transfer_id", hex);
    cJSON_AddNumberToObject(o, "tp_size", tp_size);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}
