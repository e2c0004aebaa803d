/* The gateway's LoRA part (docs/lora.md, docs/http-api.md): a request's
 * "model" naming an adapter, /v1/models listing the adapters (vLLM's parent
 * and root), and vLLM's POST /v1/load_lora_adapter and
 * /v1/unload_lora_adapter. The served adapters change at run time, so they
 * are asked for (ListModels) when a request names a model other than the
 * base, never cached. */
#include "gateway/gateway_impl.h"

#define MAX_MODELS 257 /* the base and the coordinator's registry (lora_reactor.c) */

/* The coordinator's status text without the client's "CODE: " prefix. */
static const char *bare(const char *msg) {
    const char *c = strstr(msg, ": ");
    return c && c - msg < 24 ? c + 2 : msg;
}

int list_models_now(const loom_http_t *h, loom_model_info_t **out, int *n, loom_err_t *err) {
    loom_client_t *c = NULL;
    *out = NULL;
    *n = 0;
    if (probe_client(h, &c, err) < 0) return -1;
    loom_model_info_t *m = loom_xcalloc(MAX_MODELS, sizeof *m);
    int total = 0;
    loom_status_t st = loom_client_list_models(c, m, MAX_MODELS, &total, err);
    loom_client_close(&c);
    if (st < 0) {
        free(m);
        return -1;
    }
    *out = m;
    *n = total < MAX_MODELS ? total : MAX_MODELS;
    return 0;
}

int model_lookup(req_t *q, const loom_model_info_t *base, const char *model, loom_status_t *st, char *msg,
                 size_t cap) {
    if (!model || !model[0] || !strcmp(model, base->id)) return 1;
    loom_model_info_t *m;
    int n;
    loom_err_t err = {0};
    if (list_models_now(q->h, &m, &n, &err) < 0) {
        *st = err.code;
        snprintf(msg, cap, "%s", err.msg);
        return -1;
    }
    /* SGLang's "base:adapter" names the adapter too */
    size_t bl = strlen(base->id);
    const char *name = !strncmp(model, base->id, bl) && model[bl] == ':' ? model + bl + 1 : model;
    int found = 0, adapters = 0;
    for (int i = 0; i < n; i++) {
        adapters += m[i].parent[0] != 0;
        found |= m[i].parent[0] && !strcmp(m[i].id, name);
    }
    free(m);
    if (found) return 2;
    *st = LOOM_ERR_NOT_FOUND;
    if (adapters) snprintf(msg, cap, "The model `%.300s` does not exist.", model); /* vLLM's, with LoRA on */
    else snprintf(msg, cap, "The model '%.300s' does not exist; this server serves '%s'", model, base->id);
    return 0;
}

cJSON *model_json(const loom_http_t *h, const loom_model_info_t *m) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", m->id);
    cJSON_AddStringToObject(o, "object", "model");
    cJSON_AddNumberToObject(o, "created", (double)h->started);
    cJSON_AddStringToObject(o, "owned_by", "loom");
    if (m->parent[0]) {
        cJSON_AddStringToObject(o, "root", m->root);
        cJSON_AddStringToObject(o, "parent", m->parent);
    }
    cJSON_AddNumberToObject(o, "max_model_len", m->context_length);
    cJSON_AddNumberToObject(o, "vocab_size", m->vocab_size);
    return o;
}

/* POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
 * /v1/unload_lora_adapter {"lora_name"}: vLLM's plain-text success
 * message, or an OpenAI error body (400, or 404 for an unknown adapter). */
enum MHD_Result handle_lora_update(req_t *q, int load) {
    char msg[1200];
    cJSON *root = loom_http_parse_json_body(q->body.p, q->body.len, msg, sizeof msg);
    if (!root) return respond_error(q, 400, "invalid_request_error", NULL, NULL, "%s", msg);
    const cJSON *x;
    const char *name = NULL, *path = NULL;
    enum MHD_Result res;
    cJSON_ArrayForEach(x, root) {
        int is_name = !strcmp(x->string, "lora_name"), is_path = load && !strcmp(x->string, "lora_path");
        if (!is_name && !is_path && strcmp(x->string, "load_inplace")) {
            res = respond_error(q, 400, "invalid_request_error", x->string, NULL, "%.64s is not a field of %s",
                                x->string, q->path);
            goto done;
        }
        if ((is_name || is_path) && !cJSON_IsString(x)) {
            res = respond_error(q, 400, "invalid_request_error", x->string, NULL, "%s must be a string", x->string);
            goto done;
        }
        if (is_name) name = x->valuestring;
        if (is_path) path = x->valuestring;
    }
    if (!name || !name[0] || (load && (!path || !path[0]))) {
        res = respond_error(q, 400, "invalid_request_error", load ? "lora_path" : "lora_name", NULL,
                            load ? "both 'lora_name' and 'lora_path' must be provided."
                                 : "'lora_name' must be provided.");
        goto done;
    }
    loom_client_t *c = NULL;
    loom_err_t err = {0};
    /* a load waits for its adapter's read (the coordinator's adapter pool), an unload is answered at once */
    loom_client_options_t o = {.timeout_ms = load ? LORA_LOAD_TIMEOUT_MS : PROBE_TIMEOUT_MS,
                               .api_key = q->h->api_key, .zmq_context = q->h->zctx};
    loom_status_t st = loom_client_connect(q->h->inproc, &o, &c, &err);
    if (st == LOOM_OK)
        st = load ? loom_client_load_lora_adapter(c, name, path, msg, sizeof msg, &err)
                  : loom_client_unload_lora_adapter(c, name, msg, sizeof msg, &err);
    loom_client_close(&c);
    if (st < 0) {
        unsigned http;
        const char *type, *code;
        status_http(st, &http, &type, &code);
        if (st == LOOM_ERR_NOT_FOUND) code = "NotFoundError"; /* vLLM's, for an unknown adapter */
        res = respond_error(q, http, type, "lora_name", code, "%s", bare(err.msg));
        goto done;
    }
    res = respond(q, MHD_HTTP_OK, "text/plain; charset=utf-8", loom_xstrdup(msg), strlen(msg));
done:
    cJSON_Delete(root);
    return res;
}
