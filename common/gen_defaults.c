/* generation_config.json -> default sampling parameters (see gen_defaults.h). */
#include "common/gen_defaults.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/json.h"
#include "common/util.h"

static loom_status_t number(const cJSON *root, const char *key, double lo, double hi, const char *path, int *has,
                            double *v, loom_err_t *err) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!x || cJSON_IsNull(x)) return LOOM_OK;
    if (!cJSON_IsNumber(x) || !isfinite(x->valuedouble) || x->valuedouble < lo || x->valuedouble > hi)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s must be a number in [%g, %g]", path, key, lo, hi);
    *has = 1;
    *v = x->valuedouble;
    return LOOM_OK;
}

loom_status_t loom_gen_defaults_load(const char *dir, loom_gen_defaults_t *out, loom_err_t *err) {
    memset(out, 0, sizeof *out);
    char path[4096];
    struct stat sb;
    if (!loom_path_join(path, sizeof path, dir, "generation_config.json"))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: path too long", dir);
    if (stat(path, &sb) != 0) return LOOM_OK;
    char *text;
    size_t len;
    LOOM_CHECK(loom_read_file(path, &text, &len, err));
    size_t bad_at;
    cJSON *root = loom_json_parse_strict(text, len, &bad_at);
    free(text);
    if (!root) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: not valid JSON (at byte %zu)", path, bad_at);
    loom_status_t s = LOOM_OK;
    double v = 0;
    if (!cJSON_IsObject(root)) {
        s = loom_err_set(err, LOOM_ERR_FORMAT, "%s: not a JSON object", path);
        goto done;
    }
    /* do_sample false means greedy in Hugging Face's generate() */
    const cJSON *ds = cJSON_GetObjectItemCaseSensitive(root, "do_sample");
    int greedy = cJSON_IsBool(ds) && cJSON_IsFalse(ds);
    if ((s = number(root, "temperature", 0, 2, path, &out->has_temperature, &v, err)) < 0) goto done;
    out->temperature = (float)v;
    if ((s = number(root, "top_p", 1e-9, 1, path, &out->has_top_p, &v, err)) < 0) goto done;
    out->top_p = (float)v;
    if ((s = number(root, "top_k", 0, 1 << 30, path, &out->has_top_k, &v, err)) < 0) goto done;
    out->top_k = (int)v;
    if ((s = number(root, "max_new_tokens", 1, 1 << 30, path, &out->has_max_tokens, &v, err)) < 0) goto done;
    out->max_tokens = (int)v;
    if (greedy) out->has_temperature = 1, out->temperature = 0;
    static const char *const k_unapplied[] = {"repetition_penalty", "min_p", "presence_penalty", "frequency_penalty"};
    size_t o = 0;
    for (size_t i = 0; i < LOOM_ARRAY_LEN(k_unapplied); i++) {
        const cJSON *x = cJSON_GetObjectItemCaseSensitive(root, k_unapplied[i]);
        if (!cJSON_IsNumber(x)) continue;
        int w = snprintf(out->ignored + o, sizeof out->ignored - o, "%s%s", o ? ", " : "", k_unapplied[i]);
        if (w > 0 && o + (size_t)w < sizeof out->ignored) o += (size_t)w;
    }
done:
    cJSON_Delete(root);
    return s;
}
