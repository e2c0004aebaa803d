/* `loom info`: what this build can run before a model is loaded: the
 * compiled backends, the devices visible, and per backend the model types
 * it runs and the capabilities it lacks -- the same tables loom_model_load
 * refuses a family by (a family's needs, worker/engine/arch.h; a backend's
 * capabilities, kernels/backend.h). */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "client/commands.h"
#include "common/cli.h"
#include "common/util.h"
#include "kernels/backend.h"
#include "worker/engine/arch.h"

/* A model type on a backend: "yes" (every config runs), "depends" (configs
 * that need one of `maybe` are refused), "no" (every config is refused). */
static const char *verdict(uint32_t caps, const loom_arch_type_t *t) {
    if (t->always & ~caps) return "no";
    return t->maybe & ~caps ? "depends" : "yes";
}

static void print_caps(const char *label, uint32_t set) {
    printf("%s", label);
    int first = 1;
    for (int i = 0; i < LOOM_CAP_COUNT; i++)
        if (set & (1u << i)) {
            printf("%s%s", first ? "" : ", ", loom_cap_name(1u << i));
            first = 0;
        }
    printf("%s\n", first ? "none" : "");
}

static cJSON *caps_json(uint32_t set) {
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; i < LOOM_CAP_COUNT; i++)
        if (set & (1u << i)) cJSON_AddItemToArray(a, cJSON_CreateString(loom_cap_key(1u << i)));
    return a;
}

int loom_cmd_info(int argc, char **argv) {
    int json = 0;
    loom_opt_t opts[] = {
        {"json", LOOM_OPT_FLAG, &json, NULL, "print one JSON object instead of text", 1, 0, NULL},
    };
    int r = loom_cli_parse(argc, argv, 2, opts, (int)LOOM_ARRAY_LEN(opts), "loom info [--json]",
                           "Lists the backends compiled into this build, the devices visible, and per\n"
                           "backend the model types it runs and the capabilities it lacks: a model type\n"
                           "marked 'no' is refused at load on that backend, 'depends' is refused when its\n"
                           "config needs what is listed (e.g. a sliding_window).");
    if (r) return r < 0 ? 2 : 0;
    static const struct {
        loom_device_kind_t kind;
        const char *name;
    } kinds[] = {{LOOM_DEVICE_CPU, "cpu"}, {LOOM_DEVICE_CUDA, "cuda"}};
    uint32_t all = (1u << LOOM_CAP_COUNT) - 1;
    cJSON *root = cJSON_CreateObject(), *jb = cJSON_AddArrayToObject(root, "backends");
    for (size_t k = 0; k < LOOM_ARRAY_LEN(kinds); k++) {
        int compiled = loom_backend_compiled(kinds[k].kind);
        uint32_t caps = loom_backend_kind_caps(kinds[k].kind);
        int devices = kinds[k].kind == LOOM_DEVICE_CPU ? 1 : loom_backend_device_count();
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        char devs[96];
        if (kinds[k].kind == LOOM_DEVICE_CPU)
            snprintf(devs, sizeof devs, "%ld cores", cores);
        else if (!compiled)
            snprintf(devs, sizeof devs, "not compiled in (rebuild with -DLOOM_CUDA=ON)");
        else if (devices == 0)
            snprintf(devs, sizeof devs, "no CUDA device");
        else
            snprintf(devs, sizeof devs, "%d device(s): cuda:0 .. cuda:%d", devices, devices - 1);
        cJSON *b = cJSON_CreateObject();
        cJSON_AddItemToArray(jb, b);
        cJSON_AddStringToObject(b, "name", kinds[k].name);
        cJSON_AddBoolToObject(b, "compiled", compiled);
        cJSON_AddNumberToObject(b, "devices", compiled ? devices : 0);
        cJSON_AddStringToObject(b, "device_status", devs);
        if (!json) printf("%s: %s\n", kinds[k].name, devs);
        if (!compiled) continue;
        cJSON_AddItemToObject(b, "capabilities", caps_json(caps));
        cJSON_AddItemToObject(b, "lacks", caps_json(all & ~caps));
        if (!json) {
            print_caps("  has:   ", caps);
            print_caps("  lacks: ", all & ~caps);
        }
        cJSON *jf = cJSON_AddArrayToObject(b, "model_types");
        for (int i = 0; i < loom_arch_count(); i++) {
            const loom_arch_t *a = loom_arch_at(i);
            for (const loom_arch_type_t *t = a->types; t->model_type; t++) {
                const char *v = verdict(caps, t);
                cJSON *f = cJSON_CreateObject();
                cJSON_AddItemToArray(jf, f);
                cJSON_AddStringToObject(f, "model_type", t->model_type);
                cJSON_AddStringToObject(f, "family", a->name);
                cJSON_AddStringToObject(f, "runs", v);
                cJSON_AddItemToObject(f, "lacks", caps_json(t->always & ~caps));
                cJSON_AddItemToObject(f, "lacks_for_some_configs", caps_json(t->maybe & ~caps));
                if (json) continue;
                /* refused: what every config needs; else what some configs need */
                uint32_t miss = t->always & ~caps ? t->always & ~caps : t->maybe & ~caps;
                printf("  %-12s %s", t->model_type, v);
                for (int c = 0, first = 1; c < LOOM_CAP_COUNT; c++)
                    if (miss & (1u << c)) {
                        printf("%s%s", first ? (t->always & ~caps ? ": lacks " : ": refused for configs that need ")
                                             : ", ",
                               loom_cap_name(1u << c));
                        first = 0;
                    }
                printf("\n");
            }
        }
    }
    if (json) {
        char *s = cJSON_PrintUnformatted(root);
        printf("%s\n", s);
        cJSON_free(s);
    }
    cJSON_Delete(root);
    return 0;
}
