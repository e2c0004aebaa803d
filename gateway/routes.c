/* The gateway's other routes (gateway_impl.h): /v1/models, /health,
 * /version, /tokenize, /detokenize, /metrics and /v1/embeddings. */
#include "gateway/gateway_impl.h"

/* ---- the other routes ---- */

/* GET /v1/models: the base model, then the LoRA adapters served now
 * (vLLM's "parent" and "root"); /v1/models/{id}: one of them. */
enum MHD_Result handle_models(req_t *q, const char *one) {
    loom_model_info_t *m;
    int n;
    loom_err_t err = {0};
    if (list_models_now(q->h, &m, &n, &err) < 0) return respond_status(q, err.code, err.msg);
    if (n < 1) {
        free(m);
        return respond_status(q, LOOM_ERR_UNAVAILABLE, "the coordinator lists no model");
    }
    enum MHD_Result res;
    if (one) {
        int i = 0;
        while (i < n && strcmp(one, m[i].id) != 0) i++;
        if (i == n) {
            int adapters = n > 1;
            res = adapters ? respond_error(q, 404, "invalid_request_error", "model", "model_not_found",
                                           "The model `%.300s` does not exist.", one)
                           : respond_error(q, 404, "invalid_request_error", "model", "model_not_found",
                                           "The model '%.300s' does not exist; this server serves '%s'", one, m[0].id);
        } else {
            res = respond_json(q, MHD_HTTP_OK, model_json(q->h, &m[i]));
        }
        free(m);
        return res;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(o, "data");
    for (int i = 0; i < n; i++) cJSON_AddItemToArray(data, model_json(q->h, &m[i]));
    free(m);
    return respond_json(q, MHD_HTTP_OK, o);
}

enum MHD_Result handle_health(req_t *q) {
    loom_health_t hl;
    loom_err_t err = {0};
    loom_client_t *c = NULL;
    if (atomic_load(&q->h->draining)) { /* the reactor is gone or going */
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "status", "unavailable");
        cJSON_AddStringToObject(o, "state", "draining");
        cJSON_AddStringToObject(o, "message", "draining: shutting down");
        return respond_json(q, MHD_HTTP_SERVICE_UNAVAILABLE, o);
    }
    char why[300];
    if (q->h->liveness_fn && !q->h->liveness_fn(q->h->liveness_ctx, why, sizeof why)) {
        /* a stalled reactor would not answer */
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "status", "unavailable");
        cJSON_AddStringToObject(o, "state", "stalled");
        cJSON_AddStringToObject(o, "message", why);
        return respond_json(q, MHD_HTTP_SERVICE_UNAVAILABLE, o);
    }
    loom_status_t st = probe_client(q->h, &c, &err);
    if (st == LOOM_OK) st = loom_client_health(c, &hl, &err);
    loom_client_close(&c);
    cJSON *o = cJSON_CreateObject();
    if (st < 0) {
        cJSON_AddStringToObject(o, "status", "unavailable");
        cJSON_AddStringToObject(o, "message", err.msg);
        return respond_json(q, MHD_HTTP_SERVICE_UNAVAILABLE, o);
    }
    cJSON_AddStringToObject(o, "status", hl.ready ? "ok" : "unavailable");
    cJSON_AddStringToObject(o, "state", hl.state);
    cJSON_AddNumberToObject(o, "workers_ready", hl.workers_ready);
    cJSON_AddNumberToObject(o, "workers_expected", hl.workers_expected);
    cJSON_AddStringToObject(o, "message", hl.message);
    return respond_json(q, hl.ready ? MHD_HTTP_OK : MHD_HTTP_SERVICE_UNAVAILABLE, o);
}

enum MHD_Result handle_version(req_t *q) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "version", LOOM_VERSION);
    return respond_json(q, MHD_HTTP_OK, o);
}

/* The JSON object body of a POST, or NULL after answering 400. */
static cJSON *json_body(req_t *q, enum MHD_Result *res) {
    char msg[600];
    cJSON *root = loom_http_parse_json_body(q->body.p, q->body.len, msg, sizeof msg);
    if (!root) *res = respond_error(q, 400, "invalid_request_error", NULL, NULL, "%s", msg);
    return root;
}

/* Only these fields, and "model" naming the served model. */
static int check_plain_fields(req_t *q, const cJSON *o, const char *const *names, size_t n, perr_t *e,
                              loom_model_info_t *mi, loom_err_t *err, int *status_err) {
    const cJSON *x;
    cJSON_ArrayForEach(x, o) {
        size_t i = 0;
        while (i < n && strcmp(names[i], x->string) != 0) i++;
        if (i == n && strcmp(x->string, "model") != 0)
            return bad(e, x->string, "%.64s is not a field of %s", x->string, q->path);
    }
    if (served_model(q, mi, err) < 0) {
        *status_err = 1;
        return -1;
    }
    x = field(o, "model");
    if (x && (!cJSON_IsString(x) || (x->valuestring[0] && strcmp(x->valuestring, mi->id) != 0)))
        return bad(e, "model", "The model '%.300s' does not exist; this server serves '%s'",
                   cJSON_IsString(x) ? x->valuestring : "?", mi->id);
    return 0;
}

/* POST /tokenize {"prompt", "add_special_tokens"} or {"messages",
 * "add_generation_prompt"}: {"count", "max_model_len", "tokens"}, the ids
 * the coordinator would compute for that prompt (as in vLLM). */
enum MHD_Result handle_tokenize(req_t *q) {
    enum MHD_Result res;
    cJSON *root = json_body(q, &res);
    if (!root) return res;
    static const char *const names[] = {"prompt", "add_special_tokens", "messages", "add_generation_prompt",
                                        "tools", "chat_template_kwargs", "continue_final_message", "documents",
                                        "reasoning_effort", "chat_template", "tool_choice"};
    perr_t e = {0};
    loom_err_t err = {0};
    loom_model_info_t mi;
    gen_t g = {0};
    int status_err = 0, r, add_special = 1;
    int32_t *ids = NULL;
    int n_ids = 0, cap = 0;
    if (check_plain_fields(q, root, names, LOOM_ARRAY_LEN(names), &e, &mi, &err, &status_err) < 0) {
        res = status_err ? respond_status(q, err.code, err.msg)
                         : respond_error(q, e.param[0] && !strcmp(e.param, "model") ? 404 : 400,
                                         "invalid_request_error", e.param, NULL, "%s", e.msg);
        goto done;
    }
    int chat = field(root, "messages") != NULL;
    if (chat && field(root, "prompt")) {
        res = respond_error(q, 400, "invalid_request_error", "prompt", NULL, "send either prompt or messages");
        goto done;
    }
    if (chat && !q->h->tmpl) {
        res = respond_error(q, 400, "invalid_request_error", "messages", "no_chat_template",
                            "this model has no chat template");
        goto done;
    }
    const char *text;
    if (chat) {
        if (parse_messages(q->h->tmpl, q->h->tok, q->h->special_in_content, root, &g, &e) < 0) goto bad_field;
        text = g.prompt;
        add_special = 0; /* the template wrote BOS and the special tokens */
    } else {
        const cJSON *p = field(root, "prompt");
        if (!cJSON_IsString(p)) {
            bad(&e, "prompt", "prompt must be a string");
            goto bad_field;
        }
        text = p->valuestring;
        if ((r = opt_bool(root, "add_special_tokens", &add_special, &e)) < 0) goto bad_field;
    }
    if (!q->h->tok) {
        res = respond_error(q, 503, "server_error", NULL, "service_unavailable", "no tokenizer loaded");
        goto done;
    }
    if (chat && g.p.prompt_ids) { /* encoded already, content as plain text */
        n_ids = (int)g.p.n_prompt_ids;
        ids = loom_xmalloc((size_t)(n_ids > 0 ? n_ids : 1) * sizeof *ids);
        memcpy(ids, g.p.prompt_ids, (size_t)n_ids * sizeof *ids);
    } else if (loom_tokenizer_encode(q->h->tok, text, strlen(text), add_special, !add_special, &ids, &n_ids, &cap,
                                     &err) < 0) {
        res = respond_error(q, 400, "invalid_request_error", chat ? "messages" : "prompt", NULL,
                            "cannot tokenize: %s", err.msg);
        goto done;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "count", n_ids);
    cJSON_AddNumberToObject(o, "max_model_len", mi.context_length);
    cJSON *arr = cJSON_AddArrayToObject(o, "tokens");
    for (int i = 0; i < n_ids; i++) cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
    res = respond_json(q, MHD_HTTP_OK, o);
    goto done;
bad_field:
    res = respond_error(q, 400, "invalid_request_error", e.param[0] ? e.param : NULL, NULL, "%s", e.msg);
done:
    free(ids);
    gen_free(&g);
    cJSON_Delete(root);
    return res;
}

/* POST /detokenize {"tokens": [ids]}: {"prompt": text}, special tokens
 * written out (as in vLLM). */
enum MHD_Result handle_detokenize(req_t *q) {
    enum MHD_Result res;
    cJSON *root = json_body(q, &res);
    if (!root) return res;
    static const char *const names[] = {"tokens"};
    perr_t e = {0};
    loom_err_t err = {0};
    loom_model_info_t mi;
    int status_err = 0;
    int32_t *ids = NULL;
    if (check_plain_fields(q, root, names, LOOM_ARRAY_LEN(names), &e, &mi, &err, &status_err) < 0) {
        res = status_err ? respond_status(q, err.code, err.msg)
                         : respond_error(q, e.param[0] && !strcmp(e.param, "model") ? 404 : 400,
                                         "invalid_request_error", e.param, NULL, "%s", e.msg);
        goto done;
    }
    const cJSON *t = field(root, "tokens");
    if (!cJSON_IsArray(t)) {
        res = respond_error(q, 400, "invalid_request_error", "tokens", NULL, "tokens must be an array of token ids");
        goto done;
    }
    int n = cJSON_GetArraySize(t), k = 0;
    ids = loom_xmalloc((size_t)(n > 0 ? n : 1) * sizeof *ids);
    const cJSON *x;
    cJSON_ArrayForEach(x, t) {
        if (!cJSON_IsNumber(x) || x->valuedouble != floor(x->valuedouble) || x->valuedouble < 0 ||
            x->valuedouble >= mi.vocab_size) {
            res = respond_error(q, 400, "invalid_request_error", "tokens", NULL,
                                "tokens[%d] is not a token id in [0, %d)", k, mi.vocab_size);
            goto done;
        }
        ids[k++] = (int32_t)x->valuedouble;
    }
    if (!q->h->tok) {
        res = respond_error(q, 503, "server_error", NULL, "service_unavailable", "no tokenizer loaded");
        goto done;
    }
    size_t text_len = 0;
    char *text = loom_tokenizer_decode(q->h->tok, ids, n, 0, &text_len);
    if (!text) {
        res = respond_error(q, 500, "server_error", NULL, "internal_error", "cannot decode these tokens");
        goto done;
    }
    cJSON *o = cJSON_CreateObject();
    char *clean = text_dup(text, text_len);
    cJSON_AddStringToObject(o, "prompt", clean);
    free(clean);
    free(text);
    res = respond_json(q, MHD_HTTP_OK, o);
done:
    free(ids);
    cJSON_Delete(root);
    return res;
}

enum MHD_Result handle_metrics(req_t *q) {
    size_t len = 0;
    char *text = q->h->metrics_fn ? q->h->metrics_fn(q->h->metrics_ctx, &len) : NULL;
    if (!text) return respond_error(q, 500, "server_error", NULL, "internal_error", "cannot render the metrics");
    return respond(q, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", text, len);
}

/* ---- /v1/embeddings ---- */

#define MAX_EMBED_INPUTS 2048 /* as the coordinator's Embed */

/* One input of /v1/embeddings: a string, or an array of token ids. */
static int embed_input(const cJSON *x, int i, loom_embed_input_t *in, int32_t **owned, perr_t *e) {
    if (cJSON_IsString(x)) {
        if (!x->valuestring[0]) return bad(e, "input", "input %d is an empty string", i);
        in->text = x->valuestring;
        return 0;
    }
    if (!cJSON_IsArray(x)) return bad(e, "input", "input %d must be a string or an array of token ids", i);
    int n = cJSON_GetArraySize(x);
    if (n == 0) return bad(e, "input", "input %d is an empty list of token ids", i);
    int32_t *ids = loom_xmalloc((size_t)n * sizeof *ids);
    int k = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, x) {
        if (!is_token_id(t)) {
            free(ids);
            return bad(e, "input", "input %d: token ids must be non-negative integers", i);
        }
        ids[k++] = (int32_t)t->valuedouble;
    }
    *owned = ids;
    in->ids = ids;
    in->n_ids = n;
    return 0;
}

/* OpenAI's input: a string, an array of strings, an array of token ids, or
 * an array of token-id arrays. Returns the number of inputs, -1 on error. */
static int embed_inputs(const cJSON *x, loom_embed_input_t **ins, int32_t ***owned, int *n_alloc, perr_t *e) {
    *ins = NULL;
    *owned = NULL;
    *n_alloc = 0;
    if (!x || cJSON_IsNull(x)) return bad(e, "input", "input is required");
    int n = 1, flat = !cJSON_IsArray(x) || (cJSON_GetArraySize(x) > 0 && cJSON_IsNumber(cJSON_GetArrayItem(x, 0)));
    if (!flat) n = cJSON_GetArraySize(x);
    if (n == 0) return bad(e, "input", "input is empty: give a string, token ids, or a non-empty list of them");
    if (n > MAX_EMBED_INPUTS)
        return bad(e, "input", "input has %d items; at most %d are allowed", n, MAX_EMBED_INPUTS);
    *ins = loom_xcalloc((size_t)n, sizeof **ins);
    *owned = loom_xcalloc((size_t)n, sizeof **owned);
    *n_alloc = n;
    if (flat) return embed_input(x, 0, &(*ins)[0], &(*owned)[0], e) < 0 ? -1 : 1;
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, x) {
        if (embed_input(it, i, &(*ins)[i], &(*owned)[i], e) < 0) return -1;
        i++;
    }
    return n;
}

/* POST /v1/embeddings {"input", "model", "encoding_format", "dimensions",
 * "user"}: OpenAI's list of embeddings (float arrays, or base64 of the
 * little-endian float32 values), computed by the coordinator's Embed. */
enum MHD_Result handle_embeddings(req_t *q) {
    enum MHD_Result res;
    cJSON *root = json_body(q, &res);
    if (!root) return res;
    static const char *const known[] = {"input", "model", "encoding_format", "dimensions", "user"};
    perr_t e = {0};
    loom_err_t err = {0};
    loom_model_info_t mi;
    loom_embed_input_t *ins = NULL;
    int32_t **owned = NULL;
    int n = 0, n_alloc = 0, b64 = 0;
    double dims = 0;
    loom_embed_result_t out = {0};
    if (!cJSON_IsObject(root)) {
        res = respond_error(q, 400, "invalid_request_error", NULL, NULL, "the body must be a JSON object");
        goto done;
    }
    const cJSON *x;
    cJSON_ArrayForEach(x, root) {
        size_t i = 0;
        while (i < LOOM_ARRAY_LEN(known) && strcmp(known[i], x->string) != 0) i++;
        if (i == LOOM_ARRAY_LEN(known)) ignore_field(q, x->string);
    }
    if (served_model(q, &mi, &err) < 0) {
        res = respond_status(q, err.code, err.msg);
        goto done;
    }
    x = field(root, "model");
    if (x && !cJSON_IsNull(x) && (!cJSON_IsString(x) || (x->valuestring[0] && strcmp(x->valuestring, mi.id) != 0))) {
        res = respond_error(q, 404, "invalid_request_error", "model", "model_not_found",
                            "The model '%.300s' does not exist; this server serves '%s'",
                            cJSON_IsString(x) ? x->valuestring : "?", mi.id);
        goto done;
    }
    x = field(root, "encoding_format");
    if (x && !cJSON_IsNull(x)) {
        if (!cJSON_IsString(x) || (strcmp(x->valuestring, "float") && strcmp(x->valuestring, "base64"))) {
            bad(&e, "encoding_format", "encoding_format must be \"float\" or \"base64\"");
            goto bad_field;
        }
        b64 = !strcmp(x->valuestring, "base64");
    }
    if (opt_int(root, "dimensions", 1, 1 << 20, &dims, &e) < 0) goto bad_field;
    if ((n = embed_inputs(field(root, "input"), &ins, &owned, &n_alloc, &e)) < 0) goto bad_field;
    if (ensure_client(q, &err) < 0 || loom_client_embed(q->conn->client, NULL, ins, n, q->xid, &out, &err) < 0) {
        if (err.code == LOOM_ERR_INVALID_ARGUMENT)
            res = respond_error(q, 400, "invalid_request_error", "input", NULL, "%s", err.msg);
        else res = respond_status(q, err.code, err.msg);
        goto done;
    }
    if (dims > 0 && (int)dims != out.dim) {
        bad(&e, "dimensions", "dimensions %d is not supported: this model's embeddings have %d", (int)dims, out.dim);
        goto bad_field;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(o, "data");
    char *b = b64 ? loom_xmalloc(4 * (((size_t)out.dim * 4 + 2) / 3) + 1) : NULL;
    for (int i = 0; i < out.n; i++) {
        const float *v = out.values + (size_t)i * out.dim;
        cJSON *d = cJSON_CreateObject();
        cJSON_AddStringToObject(d, "object", "embedding");
        cJSON_AddNumberToObject(d, "index", i);
        if (b64) {
            uint8_t *le = loom_xmalloc((size_t)out.dim * 4);
            for (int j = 0; j < out.dim; j++) {
                uint32_t u;
                memcpy(&u, &v[j], 4);
                for (int k = 0; k < 4; k++) le[(size_t)j * 4 + k] = (uint8_t)(u >> (8 * k));
            }
            loom_b64_encode(le, (size_t)out.dim * 4, b);
            free(le);
            cJSON_AddStringToObject(d, "embedding", b);
        } else {
            cJSON *arr = cJSON_AddArrayToObject(d, "embedding");
            for (int j = 0; j < out.dim; j++) cJSON_AddItemToArray(arr, cJSON_CreateNumber((double)v[j]));
        }
        cJSON_AddItemToArray(data, d);
    }
    free(b);
    cJSON_AddStringToObject(o, "model", mi.id);
    cJSON *u = cJSON_AddObjectToObject(o, "usage");
    cJSON_AddNumberToObject(u, "prompt_tokens", out.prompt_tokens);
    cJSON_AddNumberToObject(u, "total_tokens", out.prompt_tokens);
    res = respond_json(q, MHD_HTTP_OK, o);
    goto done;
bad_field:
    res = respond_error(q, 400, "invalid_request_error", e.param[0] ? e.param : NULL, NULL, "%s", e.msg);
done:
    for (int i = 0; i < n_alloc; i++) free(owned[i]);
    free(owned);
    free(ins);
    loom_embed_result_free(&out);
    cJSON_Delete(root);
    return res;
}
