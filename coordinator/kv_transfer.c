/* kv_transfer_params (kv_transfer.h). */
#include "coordinator/kv_transfer.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/block_hash.h"
#include "common/util.h"

static const cJSON *get(const cJSON *o, const char *k) { return cJSON_GetObjectItemCaseSensitive(o, k); }

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
                          "--kv-transfer-config: kv_connector must be \"LoomConnector\" (the shared directory tier)");
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
    if (pol && (!cJSON_IsString(pol) || !loom_kv_load_policy_parse(pol->valuestring, &out->policy)))
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                          "--kv-transfer-config: kv_load_failure_policy must be \"recompute\" or \"fail\"");
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

/* remote_block_ids: hex chain hashes, each that of the prompt's block i. */
static loom_status_t parse_blocks(const cJSON *ids, const int32_t *prompt, int n_prompt, int block_size,
                                  uint64_t seed, loom_kv_transfer_req_t *out, loom_err_t *err) {
    if (!ids) return LOOM_OK;
    int n = cJSON_GetArraySize(ids), room = (n_prompt - 1) / block_size;
    if (!cJSON_IsArray(ids) || n > room)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "kv_transfer_params.remote_block_ids must list at most %d blocks of this prompt", room);
    out->blocks = loom_xcalloc((size_t)(n > 0 ? n : 1), sizeof *out->blocks);
    uint64_t h = seed;
    int i = 0;
    for (const cJSON *b = ids->child; b; b = b->next, i++) {
        h = loom_kv_chain_hash(h, prompt + (size_t)i * block_size, block_size);
        char *end = NULL;
        uint64_t v = cJSON_IsString(b) ? strtoull(b->valuestring, &end, 16) : 0;
        if (!end || *end || v != h)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "kv_transfer_params.remote_block_ids[%d] is not block %d of this prompt", i, i);
        out->blocks[i] = v;
    }
    out->n_blocks = n;
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
        else if (!cJSON_IsString(e) || strcmp(e->valuestring, engine_id))
            st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                              "kv_transfer_params.remote_engine_id %s is not this replica's (%s): the prefill ran on "
                              "another model, grid or KV tier",
                              cJSON_IsString(e) ? e->valuestring : "(missing)", engine_id);
        else
            st = parse_blocks(get(o, "remote_block_ids"), prompt, n_prompt, block_size, seed, out, err);
        if (cJSON_IsString(e)) snprintf(out->engine_id, sizeof out->engine_id, "%s", e->valuestring);
    }
done:
    cJSON_Delete(o);
    if (st < 0) loom_kv_transfer_req_free(out);
    return st;
}

void loom_kv_transfer_req_free(loom_kv_transfer_req_t *r) {
    free(r->blocks);
    r->blocks = NULL;
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
