/* Safetensors reader: maps checkpoint files read-only, validates every header
 * entry before exposing it, and copies 2-D blocks out as float so that each
 * worker reads only its own tensor-parallel shard of a weight.
 *
 * File layout: [u64 little-endian header length N][N bytes of JSON][data].
 * The JSON maps tensor names to {dtype, shape, data_offsets}; offsets are
 * relative to the start of the data section. */
#include "common/safetensors.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include "common/json.h"
#include "common/util.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this reader assumes a little-endian host"
#endif

#define ST_MAX_HEADER  (100ull * 1000 * 1000) /* real headers are ~100 KB */
#define ST_MAX_EXACT   9007199254740992.0     /* 2^53: larger JSON numbers lose integers */
#define ST_MAX_NUMEL   (UINT64_MAX / 16)      /* numel * dtype size cannot overflow */
#define ST_INDEX_NAME  "model.safetensors.index.json"
#define ST_SINGLE_NAME "model.safetensors"

typedef struct st_file {
    char *path;
    void *map; /* the whole file, PROT_READ, MAP_PRIVATE */
    size_t map_size;
    const uint8_t *data; /* data section: after the length word and the header */
    size_t data_size;
} st_file_t;

struct loom_st {
    char *source; /* the file or index opened, for "not found in ..." */
    st_file_t *files;
    int n_files;
    loom_st_tensor_t *tensors; /* names are owned; file points at files[k].path */
    int n_tensors, cap_tensors;
    int32_t *slots; /* open addressing by name: tensor index + 1, 0 = empty */
    size_t n_slots; /* power of two, at least twice n_tensors */
    _Atomic uint64_t bytes_read;
};

/* ---- name lookup ---------------------------------------------------------------------------- */

static uint64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

/* The slot holding `name`, or the empty slot where it would go. */
static size_t find_slot(const loom_st_t *st, const char *name) {
    size_t mask = st->n_slots - 1;
    for (size_t i = (size_t)name_hash(name) & mask;; i = (i + 1) & mask) {
        int32_t v = st->slots[i];
        if (v == 0 || !strcmp(st->tensors[v - 1].name, name)) return i;
    }
}

static void hash_grow(loom_st_t *st) {
    free(st->slots);
    st->n_slots *= 2;
    st->slots = loom_xcalloc(st->n_slots, sizeof *st->slots);
    for (int i = 0; i < st->n_tensors; i++)
        st->slots[find_slot(st, st->tensors[i].name)] = i + 1;
}

/* ---- create / destroy ----------------------------------------------------------------------- */

static loom_st_t *st_create(const char *source) {
    loom_st_t *st = loom_xcalloc(1, sizeof *st);
    st->source = loom_xstrdup(source);
    st->n_slots = 64;
    st->slots = loom_xcalloc(st->n_slots, sizeof *st->slots);
    atomic_init(&st->bytes_read, 0);
    return st;
}

void loom_st_close(loom_st_t **st_p) {
    if (!st_p || !*st_p) return;
    loom_st_t *st = *st_p;
    for (int i = 0; i < st->n_files; i++) {
        if (st->files[i].map) munmap(st->files[i].map, st->files[i].map_size);
        free(st->files[i].path);
    }
    for (int i = 0; i < st->n_tensors; i++)
        free((char *)st->tensors[i].name);
    free(st->files);
    free(st->tensors);
    free(st->slots);
    free(st->source);
    free(st);
    *st_p = NULL;
}

/* ---- header parsing ------------------------------------------------------------------------- */

/* A JSON number that is a non-negative integer small enough to be exact. */
static int json_u64(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return 0;
    double d = v->valuedouble;
    if (!(d >= 0 && d <= ST_MAX_EXACT)) return 0; /* also refuses NaN */
    uint64_t u = (uint64_t)d;
    if ((double)u != d) return 0;
    *out = u;
    return 1;
}

static void format_shape(char *out, size_t n, int n_dims, const int64_t *shape) {
    size_t used = 0;
    out[0] = '\0';
    used += (size_t)snprintf(out, n, "[");
    for (int i = 0; i < n_dims && used < n; i++)
        used +=
            (size_t)snprintf(out + used, n - used, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (used < n) snprintf(out + used, n - used, "]");
}

typedef struct span {
    uint64_t begin, end;
    int tensor;
} span_t;

static int span_cmp(const void *a, const void *b) {
    const span_t *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* Validates one header entry and appends it as a tensor of file `f`. */
static loom_status_t add_entry(loom_st_t *st, const st_file_t *f, const cJSON *e, span_t *span,
                               loom_err_t *err) {
    const char *path = f->path, *name = e->string;
    if (!cJSON_IsObject(e))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: tensor '%s': entry is not a JSON object",
                            path, name);

    const cJSON *jdt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *jshape = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *joff = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    const char *missing = !jdt ? "dtype" : !jshape ? "shape" : !joff ? "data_offsets" : NULL;
    if (missing)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: tensor '%s': missing \"%s\"", path, name,
                            missing);

    loom_dtype_t dt;
    if (!cJSON_IsString(jdt))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: tensor '%s': dtype must be a string", path,
                            name);
    if (!loom_dtype_from_name(jdt->valuestring, &dt))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: tensor '%s': unknown dtype '%s'", path, name,
                            jdt->valuestring);

    if (!cJSON_IsArray(jshape))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: tensor '%s': shape must be an array", path,
                            name);
    int n_dims = cJSON_GetArraySize(jshape);
    if (n_dims > LOOM_ST_MAX_DIMS)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: tensor '%s': %d dimensions, at most %d",
                            path, name, n_dims, LOOM_ST_MAX_DIMS);
    int64_t shape[LOOM_ST_MAX_DIMS];
    uint64_t numel = 1;
    int d = 0;
    const cJSON *jd;
    cJSON_ArrayForEach(jd, jshape) {
        uint64_t v;
        if (!json_u64(jd, &v))
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "%s: tensor '%s': shape[%d] is not a non-negative integer", path,
                                name, d);
        if (v != 0 && numel > ST_MAX_NUMEL / v)
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "%s: tensor '%s': shape has too many elements", path, name);
        numel *= v;
        shape[d++] = (int64_t)v;
    }

    uint64_t off[2];
    if (!cJSON_IsArray(joff) || cJSON_GetArraySize(joff) != 2 ||
        !json_u64(cJSON_GetArrayItem(joff, 0), &off[0]) ||
        !json_u64(cJSON_GetArrayItem(joff, 1), &off[1]))
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%s: tensor '%s': data_offsets must be [begin, end] with non-negative "
                            "integers",
                            path, name);
    if (off[0] > off[1])
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%s: tensor '%s': data_offsets [%llu, %llu] has begin after end", path,
                            name, (unsigned long long)off[0], (unsigned long long)off[1]);
    if (off[1] > f->data_size)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%s: tensor '%s': data_offsets end %llu is past the data section (%zu "
                            "bytes; file truncated?)",
                            path, name, (unsigned long long)off[1], f->data_size);
    uint64_t nbytes = numel * loom_dtype_size(dt);
    if (off[1] - off[0] != nbytes) {
        char s[128];
        format_shape(s, sizeof s, n_dims, shape);
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%s: tensor '%s': data_offsets span %llu bytes, but %s %s needs %llu",
                            path, name, (unsigned long long)(off[1] - off[0]), loom_dtype_name(dt),
                            s, (unsigned long long)nbytes);
    }

    size_t slot = find_slot(st, name);
    if (st->slots[slot]) {
        const char *other = st->tensors[st->slots[slot] - 1].file;
        if (other == f->path)
            return loom_err_set(err, LOOM_ERR_FORMAT, "%s: tensor '%s' appears twice in the header",
                                path, name);
        return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' appears in both %s and %s", name,
                            other, path);
    }
    if (st->n_tensors == st->cap_tensors) {
        st->cap_tensors = st->cap_tensors ? 2 * st->cap_tensors : 256;
        st->tensors = loom_xrealloc(st->tensors, (size_t)st->cap_tensors * sizeof *st->tensors);
    }
    loom_st_tensor_t *t = &st->tensors[st->n_tensors];
    memset(t, 0, sizeof *t);
    t->name = loom_xstrdup(name);
    t->dtype = dt;
    t->n_dims = n_dims;
    memcpy(t->shape, shape, (size_t)n_dims * sizeof *shape);
    t->data = f->data + off[0];
    t->nbytes = (size_t)nbytes;
    t->file = f->path;
    *span = (span_t){off[0], off[1], st->n_tensors};
    st->n_tensors++;
    st->slots[slot] = st->n_tensors;
    if ((size_t)st->n_tensors * 2 > st->n_slots) hash_grow(st);
    return LOOM_OK;
}

/* Two tensors must not share bytes (empty tensors take none). */
static loom_status_t check_overlaps(const loom_st_t *st, const st_file_t *f, span_t *spans, int n,
                                    loom_err_t *err) {
    qsort(spans, (size_t)n, sizeof *spans, span_cmp);
    int prev = -1;
    for (int i = 0; i < n; i++) {
        if (spans[i].begin == spans[i].end) continue;
        if (prev >= 0 && spans[i].begin < spans[prev].end)
            return loom_err_set(
                err, LOOM_ERR_FORMAT, "%s: tensors '%s' and '%s' overlap in the data section",
                f->path, st->tensors[spans[prev].tensor].name, st->tensors[spans[i].tensor].name);
        prev = i;
    }
    return LOOM_OK;
}

static loom_status_t parse_header(loom_st_t *st, st_file_t *f, loom_err_t *err) {
    const uint8_t *p = f->map;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | p[i];
    if (hlen > ST_MAX_HEADER)
        return loom_err_set(
            err, LOOM_ERR_FORMAT,
            "%s: header length %llu is absurd (over 100 MB); not a safetensors file?", f->path,
            (unsigned long long)hlen);
    if (hlen > f->map_size - 8)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%s: header length %llu runs past the end of the file (%zu bytes; "
                            "truncated?)",
                            f->path, (unsigned long long)hlen, f->map_size);
    f->data = p + 8 + hlen;
    f->data_size = f->map_size - 8 - (size_t)hlen;

    size_t bad_at;
    cJSON *root = loom_json_parse_strict((const char *)p + 8, (size_t)hlen, &bad_at);
    if (!root)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%s: header is not valid JSON (at byte %zu of %llu)", f->path, bad_at,
                            (unsigned long long)hlen);
    loom_status_t s = LOOM_OK;
    span_t *spans = NULL;
    int n = 0;
    if (!cJSON_IsObject(root)) {
        s = loom_err_set(err, LOOM_ERR_FORMAT, "%s: header is JSON but not an object", f->path);
        goto out_json;
    }
    spans = loom_xmalloc((size_t)(cJSON_GetArraySize(root) + 1) * sizeof *spans);
    const cJSON *e;
    cJSON_ArrayForEach(e, root) {
        if (!strcmp(e->string, "__metadata__")) continue;
        s = add_entry(st, f, e, &spans[n], err);
        if (s < 0) goto out_spans;
        n++;
    }
    s = check_overlaps(st, f, spans, n, err);
out_spans:
    free(spans);
out_json:
    cJSON_Delete(root);
    return s;
}

/* ---- files ---------------------------------------------------------------------------------- */

/* Maps `path` and adds its tensors. */
static loom_status_t add_file(loom_st_t *st, const char *path, loom_err_t *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return loom_err_set(err, LOOM_ERR_IO, "%s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return loom_err_set(err, LOOM_ERR_IO, "%s: stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return loom_err_set(err, LOOM_ERR_IO, "%s: not a regular file", path);
    }
    if (sb.st_size < 8) {
        close(fd);
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%s: file is %lld bytes, too short for the 8-byte header length", path,
                            (long long)sb.st_size);
    }
    /* No MADV_WILLNEED: a tensor-parallel worker touches only its slice of
     * each weight, and prefetching would read every rank's share. */
    void *map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return loom_err_set(err, LOOM_ERR_IO, "%s: mmap: %s", path, strerror(e));

    st->files = loom_xrealloc(st->files, (size_t)(st->n_files + 1) * sizeof *st->files);
    st_file_t *f = &st->files[st->n_files++];
    f->path = loom_xstrdup(path);
    f->map = map;
    f->map_size = (size_t)sb.st_size;
    f->data = NULL;
    f->data_size = 0;
    return parse_header(st, f, err);
}

loom_status_t loom_st_open_file(const char *path, loom_st_t **out, loom_err_t *err) {
    *out = NULL;
    loom_st_t *st = st_create(path);
    loom_status_t s = add_file(st, path, err);
    if (s < 0) {
        loom_st_close(&st);
        return s;
    }
    *out = st;
    return LOOM_OK;
}

/* A shard name from an index must stay inside the checkpoint directory. */
static int shard_name_ok(const char *name) {
    return name[0] && !strchr(name, '/') && !strstr(name, "..") && strcmp(name, ".");
}

static loom_status_t open_index(const char *dir, const char *index_path, loom_st_t **out,
                                loom_err_t *err) {
    char *text;
    size_t len;
    LOOM_CHECK(loom_read_file(index_path, &text, &len, err));
    size_t bad_at;
    cJSON *root = loom_json_parse_strict(text, len, &bad_at);
    free(text);
    if (!root)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: not valid JSON (at byte %zu)", index_path,
                            bad_at);

    loom_status_t s = LOOM_OK;
    loom_st_t *st = NULL;
    const char **names = NULL;
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm) || !wm->child) {
        s = loom_err_set(err, LOOM_ERR_FORMAT,
                         "%s: \"weight_map\" is missing, empty or not an object", index_path);
        goto out;
    }

    /* Distinct shard files, in order of first mention. */
    int n_names = 0;
    names = loom_xmalloc((size_t)cJSON_GetArraySize(wm) * sizeof *names);
    const cJSON *e;
    cJSON_ArrayForEach(e, wm) {
        if (!cJSON_IsString(e)) {
            s = loom_err_set(err, LOOM_ERR_FORMAT, "%s: weight_map['%s'] is not a string",
                             index_path, e->string);
            goto out;
        }
        if (!shard_name_ok(e->valuestring)) {
            s = loom_err_set(err, LOOM_ERR_FORMAT,
                             "%s: weight_map['%s'] names '%s', which is not a plain file name in "
                             "the checkpoint directory; refusing it",
                             index_path, e->string, e->valuestring);
            goto out;
        }
        int k = 0;
        while (k < n_names && strcmp(names[k], e->valuestring))
            k++;
        if (k == n_names) names[n_names++] = e->valuestring;
    }

    st = st_create(index_path);
    char path[4096];
    for (int k = 0; k < n_names; k++) {
        if (!loom_path_join(path, sizeof path, dir, names[k])) {
            s = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s/%s: path too long", dir, names[k]);
            goto out;
        }
        s = add_file(st, path, err);
        if (s < 0) goto out;
    }

    /* Every weight must be where the index says it is. */
    cJSON_ArrayForEach(e, wm) {
        int k = 0;
        while (strcmp(names[k], e->valuestring))
            k++;
        const loom_st_tensor_t *t = loom_st_find(st, e->string);
        if (!t) {
            s = loom_err_set(err, LOOM_ERR_FORMAT,
                             "%s: weight_map puts tensor '%s' in %s, but that file has no such "
                             "tensor",
                             index_path, e->string, names[k]);
            goto out;
        }
        if (t->file != st->files[k].path) {
            s = loom_err_set(err, LOOM_ERR_FORMAT,
                             "%s: weight_map puts tensor '%s' in %s, but it is in %s", index_path,
                             e->string, names[k], t->file);
            goto out;
        }
    }
    *out = st;
    st = NULL;
out:
    loom_st_close(&st);
    free(names);
    cJSON_Delete(root);
    return s;
}

static int path_exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

static int has_suffix(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && !strcmp(s + n - m, suffix);
}

loom_status_t loom_st_open_dir(const char *dir, loom_st_t **out, loom_err_t *err) {
    *out = NULL;
    char path[4096];
    if (!loom_path_join(path, sizeof path, dir, ST_INDEX_NAME))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: path too long", dir);
    if (path_exists(path)) return open_index(dir, path, out, err);
    loom_path_join(path, sizeof path, dir, ST_SINGLE_NAME);
    if (path_exists(path)) return loom_st_open_file(path, out, err);

    DIR *d = opendir(dir);
    if (!d) return loom_err_set(err, LOOM_ERR_IO, "%s: %s", dir, strerror(errno));
    char found[256] = "";
    int n_found = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.' || !has_suffix(de->d_name, ".safetensors")) continue;
        if (n_found++ == 0) snprintf(found, sizeof found, "%s", de->d_name);
    }
    closedir(d);
    if (n_found == 0)
        return loom_err_set(err, LOOM_ERR_NOT_FOUND, "no safetensors file in %s", dir);
    if (n_found > 1)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%d safetensors files in %s but no %s to say how they fit together",
                            n_found, dir, ST_INDEX_NAME);
    if (!loom_path_join(path, sizeof path, dir, found))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: path too long", dir);
    return loom_st_open_file(path, out, err);
}

/* ---- lookup --------------------------------------------------------------------------------- */

int loom_st_count(const loom_st_t *st) {
    return st ? st->n_tensors : 0;
}

const loom_st_tensor_t *loom_st_at(const loom_st_t *st, int i) {
    if (!st || i < 0 || i >= st->n_tensors) return NULL;
    return &st->tensors[i];
}

static char *renamed(const char *name, size_t nf, const char *to) {
    size_t nt = strlen(to);
    char *out = loom_xmalloc(nt + strlen(name + nf) + 1);
    memcpy(out, to, nt);
    strcpy(out + nt, name + nf);
    return out;
}

loom_status_t loom_st_rename_prefix(loom_st_t *st, const char *from, const char *to, int *n_renamed,
                                    loom_err_t *err) {
    size_t nf = strlen(from);
    int n = 0;
    if (n_renamed) *n_renamed = 0;
    for (int i = 0; i < st->n_tensors; i++) { /* all or nothing: every new name free first */
        const char *name = st->tensors[i].name;
        if (strncmp(name, from, nf)) continue;
        char *to_name = renamed(name, nf, to);
        int taken = loom_st_find(st, to_name) != NULL;
        loom_status_t s = taken ? loom_err_set(err, LOOM_ERR_FORMAT,
                                               "%s holds both '%s' and '%s', which name the same tensor",
                                               st->source, name, to_name)
                                : LOOM_OK;
        free(to_name);
        if (s < 0) return s;
        n++;
    }
    if (!n) return LOOM_OK;
    for (int i = 0; i < st->n_tensors; i++) {
        loom_st_tensor_t *t = &st->tensors[i];
        if (strncmp(t->name, from, nf)) continue;
        char *to_name = renamed(t->name, nf, to);
        free((char *)t->name);
        t->name = to_name;
    }
    memset(st->slots, 0, st->n_slots * sizeof *st->slots); /* the names moved: rebuild the table */
    for (int i = 0; i < st->n_tensors; i++)
        st->slots[find_slot(st, st->tensors[i].name)] = i + 1;
    if (n_renamed) *n_renamed = n;
    return LOOM_OK;
}

const loom_st_tensor_t *loom_st_find(const loom_st_t *st, const char *name) {
    if (!st || !name) return NULL;
    int32_t v = st->slots[find_slot(st, name)];
    return v ? &st->tensors[v - 1] : NULL;
}

static int is_float_dtype(loom_dtype_t dt) {
    return dt == LOOM_DT_F32 || dt == LOOM_DT_F16 || dt == LOOM_DT_BF16;
}

/* loom_st_get and loom_st_get_dtype: dt < 0 accepts the float dtypes. */
static loom_status_t get_checked(const loom_st_t *st, const char *name, int dt, int n_dims,
                                 const int64_t *shape, const loom_st_tensor_t **out,
                                 loom_err_t *err) {
    LOOM_ASSERT(st && name && out);
    *out = NULL;
    const loom_st_tensor_t *t = loom_st_find(st, name);
    if (!t)
        return loom_err_set(err, LOOM_ERR_NOT_FOUND, "tensor '%s' not found in %s", name,
                            st->source);
    if (dt < 0 && !is_float_dtype(t->dtype))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "tensor '%s' in %s has dtype %s; Loom reads F32, F16 and BF16 weights",
                            name, t->file, loom_dtype_name(t->dtype));
    if (dt >= 0 && (int)t->dtype != dt)
        return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s has dtype %s, expected %s",
                            name, t->file, loom_dtype_name(t->dtype),
                            loom_dtype_name((loom_dtype_t)dt));
    int same = n_dims == t->n_dims;
    for (int i = 0; same && i < n_dims; i++)
        same = shape[i] == t->shape[i];
    if (!same) {
        char have[160], want[160];
        format_shape(have, sizeof have, t->n_dims, t->shape);
        format_shape(want, sizeof want, n_dims < 0 ? 0 : LOOM_MIN(n_dims, LOOM_ST_MAX_DIMS), shape);
        return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s has shape %s, expected %s",
                            name, t->file, have, want);
    }
    *out = t;
    return LOOM_OK;
}

loom_status_t loom_st_get(const loom_st_t *st, const char *name, int n_dims, const int64_t *shape,
                          const loom_st_tensor_t **out, loom_err_t *err) {
    return get_checked(st, name, -1, n_dims, shape, out, err);
}

loom_status_t loom_st_get_dtype(const loom_st_t *st, const char *name, loom_dtype_t dtype,
                                int n_dims, const int64_t *shape, const loom_st_tensor_t **out,
                                loom_err_t *err) {
    return get_checked(st, name, (int)dtype, n_dims, shape, out, err);
}

/* ---- reading -------------------------------------------------------------------------------- */

static void f16_to_f32_row(const uint8_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(src + 2 * i));
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
#endif
    for (; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, 2);
        dst[i] = loom_f16_to_f32(h);
    }
}

static void bf16_to_f32_row(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) { /* plain shifts: the compiler vectorises this */
        uint16_t h;
        memcpy(&h, src + 2 * i, 2);
        uint32_t u = (uint32_t)h << 16;
        memcpy(dst + i, &u, 4);
    }
}

/* Checks that a block lies inside the tensor; the tensor's column count in *cols_out. */
static loom_status_t check_block(const loom_st_tensor_t *t, int64_t row0, int64_t nrows, int64_t col0,
                                 int64_t ncols, int64_t *cols_out, loom_err_t *err) {
    /* Leading dimensions fold into rows; numel was bounded on open. */
    int64_t cols = t->n_dims ? t->shape[t->n_dims - 1] : 1, rows = 1;
    for (int i = 0; i + 1 < t->n_dims; i++)
        rows *= t->shape[i];
    *cols_out = cols;
    if (row0 < 0 || nrows < 0 || row0 > rows || nrows > rows - row0 || col0 < 0 || ncols < 0 ||
        col0 > cols || ncols > cols - col0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "tensor '%s' in %s: block rows [%lld, +%lld) x cols [%lld, +%lld) is "
                            "outside its %lld x %lld",
                            t->name, t->file, (long long)row0, (long long)nrows, (long long)col0,
                            (long long)ncols, (long long)rows, (long long)cols);
    return LOOM_OK;
}

loom_status_t loom_st_read_raw(loom_st_t *st, const loom_st_tensor_t *t, int64_t row0, int64_t nrows,
                               int64_t col0, int64_t ncols, void *dst, loom_err_t *err) {
    LOOM_ASSERT(st && t);
    int64_t cols;
    LOOM_CHECK(check_block(t, row0, nrows, col0, ncols, &cols, err));
    if (nrows == 0 || ncols == 0) return LOOM_OK;
    LOOM_ASSERT(dst);
    size_t esz = loom_dtype_size(t->dtype), row_bytes = (size_t)ncols * esz;
    const uint8_t *base = t->data;
    for (int64_t r = 0; r < nrows; r++)
        memcpy((uint8_t *)dst + (size_t)r * row_bytes, base + (size_t)((row0 + r) * cols + col0) * esz, row_bytes);
    atomic_fetch_add_explicit(&st->bytes_read, (uint64_t)nrows * row_bytes, memory_order_relaxed);
    return LOOM_OK;
}

loom_status_t loom_st_read_f32(loom_st_t *st, const loom_st_tensor_t *t, int64_t row0,
                               int64_t nrows, int64_t col0, int64_t ncols, float *dst,
                               loom_err_t *err) {
    LOOM_ASSERT(st && t);
    if (!is_float_dtype(t->dtype))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "tensor '%s' in %s has dtype %s; Loom reads F32, F16 and BF16 weights",
                            t->name, t->file, loom_dtype_name(t->dtype));
    int64_t cols;
    LOOM_CHECK(check_block(t, row0, nrows, col0, ncols, &cols, err));
    if (nrows == 0 || ncols == 0) return LOOM_OK;
    LOOM_ASSERT(dst);

    size_t esz = loom_dtype_size(t->dtype);
    const uint8_t *base = t->data;
    for (int64_t r = 0; r < nrows; r++) {
        const uint8_t *src = base + (size_t)((row0 + r) * cols + col0) * esz;
        float *d = dst + r * ncols;
        switch (t->dtype) {
        case LOOM_DT_F32:
            memcpy(d, src, (size_t)ncols * 4);
            break;
        case LOOM_DT_F16:
            f16_to_f32_row(src, d, ncols);
            break;
        default:
            bf16_to_f32_row(src, d, ncols);
            break;
        }
    }
    atomic_fetch_add_explicit(&st->bytes_read, (uint64_t)nrows * (uint64_t)ncols * esz,
                              memory_order_relaxed);
    return LOOM_OK;
}

uint64_t loom_st_bytes_read(const loom_st_t *st) {
    return st ? atomic_load_explicit(&st->bytes_read, memory_order_relaxed) : 0;
}
