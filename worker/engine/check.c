/* The checkpoint check, before a shard allocates anything: config.json's
 * layer count and embedding shape against the checkpoint, and every tensor
 * one the family reads (its tensor-names table, worker/arch/) or one safe
 * to leave unread; and the renaming of a multimodal checkpoint's text
 * model onto the names the loader reads. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "worker/engine/model_impl.h"

/* A multimodal checkpoint's vision tower and projector, which a text model leaves unread. */
static const char *const k_vision_prefixes[] = {"vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                                                "model.multi_modal_projector."};

/* Tensors safe to skip: RoPE tables some exporters store (Loom computes
 * them), and the vision half of a multimodal checkpoint served as text. */
static int tensor_allowed_unused(const loom_model_config_t *c, const char *name) {
    const char *p = strstr(name, "rotary_emb.inv_freq");
    if (p && p[strlen("rotary_emb.inv_freq")] == 0) return 1;
    for (size_t i = 0; c->multimodal && i < LOOM_ARRAY_LEN(k_vision_prefixes); i++)
        if (!strncmp(name, k_vision_prefixes[i], strlen(k_vision_prefixes[i]))) return 1;
    if (c->deepseek && c->n_nextn_layers > 0 && !strncmp(name, "model.layers.", 13)) {
        /* DeepSeek-V3's MTP modules, stored after the last layer (num_nextn_predict_layers): not run */
        long li = strtol(name + 13, NULL, 10);
        if (li >= c->n_layers && li < (long)c->n_layers + c->n_nextn_layers) return 1;
    }
    return 0;
}

loom_status_t loom_model_map_tensor_names(const loom_model_config_t *c, loom_st_t *st, loom_err_t *err) {
    static const char *const maps[][2] = {
        {"language_model.model.", "model."},      /* Transformers < 4.52 */
        {"language_model.lm_head.", "lm_head."},
        {"model.language_model.", "model."},      /* Transformers >= 4.52 */
    };
    if (!c->multimodal) return LOOM_OK;
    int total = 0, vision = 0;
    for (size_t i = 0; i < LOOM_ARRAY_LEN(maps); i++) {
        int n = 0;
        LOOM_CHECK(loom_st_rename_prefix(st, maps[i][0], maps[i][1], &n, err));
        total += n;
    }
    for (int i = 0; i < loom_st_count(st); i++) vision += tensor_allowed_unused(c, loom_st_at(st, i)->name);
    LOOM_INFO("multimodal checkpoint: serving its text model (%d tensors renamed), %d vision tensors left unread",
              total, vision);
    return LOOM_OK;
}

/* Checks config.json against the checkpoint before the shard allocates
 * anything: the layer count, the embedding's shape, and that every tensor is
 * one this architecture reads (the first that is not is named: a checkpoint
 * relabelled to a model_type with fewer tensors fails here). */
loom_status_t loom_model_check_checkpoint(const loom_model_config_t *c, const loom_st_t *st, loom_err_t *err) {
    const loom_arch_t *a = loom_arch_find(c->model_type);
    if (!a) return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "no model family serves model_type '%s'", c->model_type);
    char embed[128];
    loom_arch_tensor_name(a, c, -1, LOOM_TN_EMBED, -1, embed, sizeof embed);
    const loom_st_tensor_t *e = loom_st_find(st, embed);
    if (!e) return loom_err_set(err, LOOM_ERR_FORMAT, "the checkpoint has no tensor '%s'", embed);
    if (e->n_dims != 2 || e->shape[0] != c->vocab_size || e->shape[1] != c->dim)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "tensor '%s' in %s has shape [%lld, %lld]; config.json says "
                            "vocab_size %d, hidden_size %d",
                            embed, e->file, (long long)e->shape[0], (long long)(e->n_dims > 1 ? e->shape[1] : 0),
                            c->vocab_size, c->dim);
    long long layers = 0; /* 1 + the highest layer index present */
    for (int i = 0; i < loom_st_count(st); i++) {
        const loom_st_tensor_t *t = loom_st_at(st, i);
        const char *name = t->name;
        if (tensor_allowed_unused(c, name)) continue;
        if (!strncmp(name, "model.layers.", 13)) {
            char *end;
            long long li = strtoll(name + 13, &end, 10);
            if (end == name + 13 || *end != '.' || li < 0)
                return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s: no layer index", name, t->file);
            if (li >= c->n_layers)
                return loom_err_set(err, LOOM_ERR_FORMAT,
                                    "tensor '%s' in %s is in layer %lld, but config.json's num_hidden_layers is %d",
                                    name, t->file, li, c->n_layers);
            if (li + 1 > layers) layers = li + 1;
            if (!loom_arch_tensor_used(a, c, name, NULL))
                return loom_err_set(err, LOOM_ERR_FORMAT,
                                    "tensor '%s' in %s is not used by a %s model (is config.json's model_type "
                                    "right?)",
                                    name, t->file, c->model_type);
            continue;
        }
        if (!loom_arch_tensor_used(a, c, name, NULL))
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "tensor '%s' in %s is not used by a %s model (is config.json's model_type right?)",
                                name, t->file, c->model_type);
    }
    if (layers != c->n_layers)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "config.json's num_hidden_layers is %d but the checkpoint has tensors for %lld layers",
                            c->n_layers, layers);
    return LOOM_OK;
}
