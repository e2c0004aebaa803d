/* `loom quantize IN OUT`: writes a quantized copy of a Hugging Face
 * checkpoint that workers mmap and slice directly (docs/model-format.md):
 * every linear's weight becomes `<name>.qweight` codes with `.scales` (and
 * `.mins`) in the canonical layout of kernels/quant.h; norms, embeddings and
 * biases are copied as they are. A tied LM head is stored quantized as
 * `lm_head` next to the float embedding. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "client/commands.h"
#include "common/cli.h"
#include "common/log.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/util.h"
#include "kernels/quant.h"
#include "worker/engine/arch.h"
#include "worker/model.h"

typedef enum { PART_COPY, PART_CODES, PART_SCALES, PART_MINS } part_kind_t;

/* One tensor of the output file. */
typedef struct out_tensor {
    char name[300];
    part_kind_t kind;
    const loom_st_tensor_t *src; /* copied tensor, or the float linear quantized */
    loom_quant_spec_t spec;      /* quantized parts: the scheme of their linear */
    loom_dtype_t dtype;
    int n_dims;
    int64_t shape[LOOM_ST_MAX_DIMS];
    size_t nbytes;
} out_tensor_t;

/* A linear's float weight: a `.weight` the family's tensor-names table
 * (worker/arch/) lists as a linear under this config -- the one table the
 * loader and the checkpoint check read too. The router and Qwen2-MoE's
 * shared_expert_gate are plain tensors there (the loader reads them as
 * floats), so they stay float. */
static int is_linear(const loom_arch_t *a, const loom_model_config_t *cfg, const char *name) {
    size_t n = strlen(name);
    int linear = 0;
    return n > 7 && !strcmp(name + n - 7, ".weight") && loom_arch_tensor_used(a, cfg, name, &linear) && linear;
}

/* Adds the qweight, scales (and mins) entries of one linear. */
static int add_linear(out_tensor_t *out, int n, const char *prefix, const loom_st_tensor_t *src,
                      const loom_quant_spec_t *want) {
    int64_t rows = src->shape[0], cols = src->shape[1];
    loom_quant_spec_t q = *want;
    if (q.quant == LOOM_QUANT_Q4 && cols % q.group) {
        LOOM_WARN("%s: 4-bit group %d does not divide its %lld input columns; quantizing it as int8", prefix,
                  q.group, (long long)cols);
        q = (loom_quant_spec_t){.quant = LOOM_QUANT_INT8};
    }
    int64_t groups = q.quant == LOOM_QUANT_Q4 ? cols / q.group : 1;
    int k = 0;
    out_tensor_t *t = &out[n + k++];
    snprintf(t->name, sizeof t->name, "%s.qweight", prefix);
    t->kind = PART_CODES;
    t->dtype = q.quant == LOOM_QUANT_INT8 ? LOOM_DT_I8 : q.quant == LOOM_QUANT_FP8 ? LOOM_DT_F8_E4M3 : LOOM_DT_U8;
    t->shape[1] = q.quant == LOOM_QUANT_Q4 ? cols / 2 : cols;
    for (int part = 0; part < (q.with_min ? 2 : 1); part++) {
        t = &out[n + k++];
        snprintf(t->name, sizeof t->name, "%s.%s", prefix, part ? "mins" : "scales");
        t->kind = part ? PART_MINS : PART_SCALES;
        t->dtype = LOOM_DT_F32;
        t->shape[1] = groups;
    }
    for (int i = 0; i < k; i++) {
        t = &out[n + i];
        t->src = src;
        t->spec = q;
        t->n_dims = 2;
        t->shape[0] = rows;
        t->nbytes = (size_t)(t->shape[0] * t->shape[1]) * loom_dtype_size(t->dtype);
    }
    return k;
}

static int copy_file(const char *from, const char *to) {
    FILE *in = fopen(from, "rb");
    if (!in) return errno == ENOENT ? 0 : -1;
    FILE *out = fopen(to, "wb");
    if (!out) {
        fclose(in);
        return -1;
    }
    char buf[65536];
    size_t n;
    int rc = 0;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0)
        if (fwrite(buf, 1, n, out) != n) rc = -1;
    fclose(in);
    if (fclose(out)) rc = -1;
    return rc;
}

/* config.json with quantization_config {"quant_method": "loom", ...}. */
static int write_config(const char *in, const char *out, const char *scheme, const loom_quant_spec_t *q) {
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", in);
    size_t len;
    char *text = NULL;
    if (loom_read_file(path, &text, &len, NULL) < 0) return -1;
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (!root) return -1;
    cJSON_DeleteItemFromObjectCaseSensitive(root, "quantization_config");
    cJSON *qc = cJSON_AddObjectToObject(root, "quantization_config");
    cJSON_AddStringToObject(qc, "quant_method", "loom");
    cJSON_AddStringToObject(qc, "scheme", scheme);
    cJSON_AddNumberToObject(qc, "bits", q->quant == LOOM_QUANT_Q4 ? 4 : 8);
    cJSON_AddNumberToObject(qc, "group_size", q->quant == LOOM_QUANT_Q4 ? q->group : -1);
    cJSON_AddBoolToObject(qc, "zero_point", q->with_min);
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    snprintf(path, sizeof path, "%s/config.json", out);
    FILE *f = fopen(path, "w");
    int rc = f && fputs(s, f) >= 0 && fputc('\n', f) != EOF ? 0 : -1;
    if (f && fclose(f)) rc = -1;
    free(s);
    return rc;
}

int loom_cmd_quantize(int argc, char **argv) {
    const char *scheme = "q4";
    loom_opt_t opts[] = {
        {"quantization", LOOM_OPT_STR, &scheme, "SCHEME", "int8, fp8, q4, q4:64, q4:128, q4_min, q4_min:64, q4_min:128 (default q4)", 1, 0, NULL},
    };
    /* IN and OUT come first, then the options */
    int first = 2;
    while (first < argc && first < 4 && argv[first][0] != '-') first++;
    const char *in = first > 2 ? argv[2] : NULL, *out_dir = first > 3 ? argv[3] : NULL;
    int r = loom_cli_parse(argc, argv, first, opts, (int)LOOM_ARRAY_LEN(opts),
                           "loom quantize IN OUT [--quantization SCHEME]",
                           "Writes OUT/model.safetensors with every linear of the checkpoint in IN quantized (codes,\n"
                           "scales and mins in Loom's layout), and copies config.json (with a quantization_config)\n"
                           "and the tokenizer files. Workers load OUT like any model directory.");
    if (r) return r < 0 ? 2 : 0;
    if (!in || !out_dir) {
        fprintf(stderr, "error: loom quantize needs IN and OUT directories (see loom quantize --help)\n");
        return 2;
    }
    loom_quant_spec_t q;
    if (!loom_quant_spec_parse(scheme, &q) || q.quant == LOOM_QUANT_NONE) {
        fprintf(stderr, "error: --quantization must be int8, fp8, q4, q4:64, q4:128, q4_min, q4_min:64 or q4_min:128, got '%s'\n", scheme);
        return 2;
    }
    loom_err_t err = {0};
    loom_model_config_t cfg;
    loom_st_t *st = NULL;
    if (loom_model_config_load(in, &cfg, &err) < 0 || loom_st_open_dir(in, &st, &err) < 0 ||
        loom_model_map_tensor_names(&cfg, st, &err) < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        loom_st_close(&st);
        return 1;
    }
    const loom_arch_t *arch = loom_arch_find(cfg.model_type);
    if (!arch) { /* the config parser knows no model_type without a family */
        fprintf(stderr, "error: no model family serves model_type '%s'\n", cfg.model_type);
        loom_st_close(&st);
        return 1;
    }
    if (cfg.ckpt_quant != LOOM_CKPT_FLOAT) {
        fprintf(stderr, "error: %s is already quantized (quantization_config in config.json)\n", in);
        loom_st_close(&st);
        return 1;
    }
    if (cfg.gpt_oss) { /* its experts are 3-D tensors (and most of the bytes): quantized on load
                          instead */
        fprintf(
            stderr,
            "error: %s is a gpt_oss checkpoint; `loom quantize` does not rewrite its experts (3-D "
            "mlp.experts.* tensors); serve it with --quantization int8 or q4, which quantizes them "
            "on load\n",
            in);
        loom_st_close(&st);
        return 1;
    }
    if (mkdir(out_dir, 0755) && errno != EEXIST) {
        fprintf(stderr, "error: cannot create %s: %s\n", out_dir, strerror(errno));
        loom_st_close(&st);
        return 1;
    }

    int n_in = loom_st_count(st), n = 0;
    out_tensor_t *tab = loom_xcalloc((size_t)(3 * n_in + 3), sizeof *tab);
    char prefix[300];
    for (int i = 0; i < n_in; i++) {
        const loom_st_tensor_t *t = loom_st_at(st, i);
        if (is_linear(arch, &cfg, t->name) && t->n_dims == 2) {
            snprintf(prefix, sizeof prefix, "%.*s", (int)(strlen(t->name) - strlen(".weight")), t->name);
            n += add_linear(tab, n, prefix, t, &q);
            continue;
        }
        out_tensor_t *o = &tab[n++];
        snprintf(o->name, sizeof o->name, "%s", t->name);
        o->kind = PART_COPY;
        o->src = t;
        o->dtype = t->dtype;
        o->n_dims = t->n_dims;
        memcpy(o->shape, t->shape, sizeof o->shape);
        o->nbytes = t->nbytes;
    }
    char embed[128], head[128], head_w[140];
    loom_arch_tensor_name(arch, &cfg, -1, LOOM_TN_EMBED, -1, embed, sizeof embed);
    loom_arch_tensor_name(arch, &cfg, -1, LOOM_TN_LM_HEAD, -1, head, sizeof head);
    snprintf(head_w, sizeof head_w, "%s.weight", head);
    const loom_st_tensor_t *emb = loom_st_find(st, embed);
    if (cfg.tie_embeddings && emb && emb->n_dims == 2 && !loom_st_find(st, head_w))
        n += add_linear(tab, n, head, emb, &q);

    /* header: names -> dtype, shape, offsets; metadata names the scheme */
    cJSON *hdr = cJSON_CreateObject();
    cJSON *meta = cJSON_AddObjectToObject(hdr, "__metadata__");
    cJSON_AddStringToObject(meta, "format", "pt");
    cJSON_AddStringToObject(meta, "quantization", scheme);
    char gbuf[16];
    snprintf(gbuf, sizeof gbuf, "%d", q.quant == LOOM_QUANT_Q4 ? q.group : -1);
    cJSON_AddStringToObject(meta, "group_size", gbuf);
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        cJSON *e = cJSON_AddObjectToObject(hdr, tab[i].name);
        cJSON_AddStringToObject(e, "dtype", loom_dtype_name(tab[i].dtype));
        cJSON *shape = cJSON_AddArrayToObject(e, "shape");
        for (int d = 0; d < tab[i].n_dims; d++) cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)tab[i].shape[d]));
        cJSON *offs = cJSON_AddArrayToObject(e, "data_offsets");
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)off));
        off += tab[i].nbytes;
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)off));
    }
    char *json = cJSON_PrintUnformatted(hdr);
    cJSON_Delete(hdr);
    size_t hlen = strlen(json), padded = (hlen + 7) / 8 * 8;

    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors", out_dir);
    FILE *f = fopen(path, "wb");
    int rc = 0;
    if (!f) {
        fprintf(stderr, "error: cannot write %s: %s\n", path, strerror(errno));
        rc = 1;
        goto done;
    }
    uint8_t len8[8];
    for (int b = 0; b < 8; b++) len8[b] = (uint8_t)((uint64_t)padded >> (8 * b));
    int ok = fwrite(len8, 1, 8, f) == 8 && fwrite(json, 1, hlen, f) == hlen;
    for (size_t p = hlen; ok && p < padded; p++) ok = fputc(' ', f) != EOF;

    loom_qtensor_t qt = {0};
    float *buf = NULL;
    size_t n_bytes_q = 0, n_bytes_f = 0;
    for (int i = 0; ok && i < n; i++) {
        out_tensor_t *o = &tab[i];
        if (o->kind == PART_COPY) {
            ok = fwrite(o->src->data, 1, o->nbytes, f) == o->nbytes;
            continue;
        }
        if (o->kind == PART_CODES) {
            int64_t rows = o->src->shape[0], cols = o->src->shape[1];
            loom_qtensor_free(&qt);
            buf = loom_xrealloc(buf, (size_t)(rows * cols) * sizeof(float));
            if (loom_st_read_f32(st, o->src, 0, rows, 0, cols, buf, &err) < 0 ||
                loom_quantize(&o->spec, buf, rows, cols, &qt, &err) < 0) {
                fprintf(stderr, "error: %s: %s\n", o->name, err.msg);
                rc = 1;
                break;
            }
            n_bytes_f += (size_t)(rows * cols) * sizeof(float);
            n_bytes_q += loom_qtensor_bytes(&qt);
        }
        const void *src = o->kind == PART_CODES ? qt.q : o->kind == PART_SCALES ? (void *)qt.scales : (void *)qt.mins;
        ok = fwrite(src, 1, o->nbytes, f) == o->nbytes;
    }
    loom_qtensor_free(&qt);
    free(buf);
    if (fclose(f)) ok = 0;
    if (!rc && !ok) {
        fprintf(stderr, "error: writing %s failed: %s\n", path, strerror(errno));
        rc = 1;
    }
    if (!rc && write_config(in, out_dir, scheme, &q) < 0) {
        fprintf(stderr, "error: cannot write %s/config.json\n", out_dir);
        rc = 1;
    }
    static const char *const k_copy[] = {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
                                         "special_tokens_map.json", "tokenizer.model"};
    for (size_t i = 0; !rc && i < LOOM_ARRAY_LEN(k_copy); i++) {
        char from[4200];
        snprintf(from, sizeof from, "%s/%s", in, k_copy[i]);
        snprintf(path, sizeof path, "%s/%s", out_dir, k_copy[i]);
        if (copy_file(from, path) < 0) {
            fprintf(stderr, "error: cannot copy %s to %s\n", from, path);
            rc = 1;
        }
    }
    if (!rc)
        printf("%s: %d tensors; linears %.1f MB -> %.1f MB (%s)\n", out_dir, n, (double)n_bytes_f / 1e6,
               (double)n_bytes_q / 1e6, scheme);
done:
    free(json);
    free(tab);
    loom_st_close(&st);
    return rc;
}
