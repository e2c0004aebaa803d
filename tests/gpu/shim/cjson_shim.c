/* A small recursive-descent JSON reader behind the cJSON subset declared in
 * cjson/cJSON.h (standalone GPU test build only). Strict JSON: objects,
 * arrays, strings with every escape (\uXXXX and surrogate pairs to UTF-8),
 * numbers, true/false/null; nesting is limited to MAX_DEPTH. */
#include "cjson/cJSON.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 256

typedef struct reader {
    const char *p, *end;
    int depth;
} reader_t;

static void skip_ws(reader_t *r) {
    while (r->p < r->end && (*r->p == ' ' || *r->p == '\t' || *r->p == '\n' || *r->p == '\r')) r->p++;
}

static cJSON *new_item(int type) {
    cJSON *c = calloc(1, sizeof *c);
    if (c) c->type = type;
    return c;
}

void cJSON_Delete(cJSON *item) {
    while (item) {
        cJSON *next = item->next;
        cJSON_Delete(item->child);
        free(item->valuestring);
        free(item->string);
        free(item);
        item = next;
    }
}

static int hex4(const char *s, unsigned *out) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char ch = s[i];
        v <<= 4;
        if (ch >= '0' && ch <= '9') v |= (unsigned)(ch - '0');
        else if (ch >= 'a' && ch <= 'f') v |= (unsigned)(ch - 'a' + 10);
        else if (ch >= 'A' && ch <= 'F') v |= (unsigned)(ch - 'A' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

static size_t put_utf8(char *o, unsigned cp) {
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xc0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xe0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (char)(0xf0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    o[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* At the opening quote; returns a NUL-terminated copy, or NULL. */
static char *parse_string(reader_t *r) {
    const char *s = ++r->p;
    size_t cap = 0;
    while (s + cap < r->end && s[cap] != '"') cap += s[cap] == '\\' ? 2 : 1;
    if (s + cap >= r->end) return NULL;
    char *out = malloc(cap + 1), *o = out; /* escapes only shrink */
    if (!out) return NULL;
    while (r->p < r->end && *r->p != '"') {
        unsigned char ch = (unsigned char)*r->p;
        if (ch < 0x20) goto fail;
        if (ch != '\\') {
            *o++ = (char)ch;
            r->p++;
            continue;
        }
        if (r->end - r->p < 2) goto fail;
        char e = r->p[1];
        r->p += 2;
        switch (e) {
        case '"': *o++ = '"'; break;
        case '\\': *o++ = '\\'; break;
        case '/': *o++ = '/'; break;
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'n': *o++ = '\n'; break;
        case 'r': *o++ = '\r'; break;
        case 't': *o++ = '\t'; break;
        case 'u': {
            unsigned cp, lo;
            if (r->end - r->p < 4 || !hex4(r->p, &cp)) goto fail;
            r->p += 4;
            if (cp >= 0xd800 && cp < 0xdc00) { /* a surrogate pair */
                if (r->end - r->p < 6 || r->p[0] != '\\' || r->p[1] != 'u' || !hex4(r->p + 2, &lo) || lo < 0xdc00 ||
                    lo >= 0xe000)
                    goto fail;
                r->p += 6;
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            } else if (cp >= 0xdc00 && cp < 0xe000) {
                goto fail;
            }
            o += put_utf8(o, cp);
            break;
        }
        default: goto fail;
        }
    }
    if (r->p >= r->end) goto fail;
    r->p++; /* closing quote */
    *o = '\0';
    return out;
fail:
    free(out);
    return NULL;
}

static cJSON *parse_value(reader_t *r);

static int parse_number(reader_t *r, cJSON *item) {
    const char *s = r->p;
    if (s < r->end && *s == '-') s++;
    if (s >= r->end || *s < '0' || *s > '9') return 0;
    if (*s == '0') s++;
    else
        while (s < r->end && *s >= '0' && *s <= '9') s++;
    if (s < r->end && *s == '.') {
        s++;
        if (s >= r->end || *s < '0' || *s > '9') return 0;
        while (s < r->end && *s >= '0' && *s <= '9') s++;
    }
    if (s < r->end && (*s == 'e' || *s == 'E')) {
        s++;
        if (s < r->end && (*s == '+' || *s == '-')) s++;
        if (s >= r->end || *s < '0' || *s > '9') return 0;
        while (s < r->end && *s >= '0' && *s <= '9') s++;
    }
    size_t len = (size_t)(s - r->p);
    char buf[64];
    if (len >= sizeof buf) return 0;
    memcpy(buf, r->p, len);
    buf[len] = '\0';
    item->valuedouble = strtod(buf, NULL);
    double d = item->valuedouble;
    item->valueint = d >= 2147483647.0 ? 2147483647 : d <= -2147483648.0 ? (-2147483647 - 1) : (int)d;
    r->p = s;
    return 1;
}

static int literal(reader_t *r, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(r->end - r->p) < n || memcmp(r->p, word, n) != 0) return 0;
    r->p += n;
    return 1;
}

/* Elements of an array or members of an object, after the opening bracket. */
static int parse_children(reader_t *r, cJSON *parent, char close, int members) {
    cJSON *last = NULL;
    skip_ws(r);
    if (r->p < r->end && *r->p == close) {
        r->p++;
        return 1;
    }
    for (;;) {
        char *name = NULL;
        skip_ws(r);
        if (members) {
            if (r->p >= r->end || *r->p != '"' || !(name = parse_string(r))) return 0;
            skip_ws(r);
            if (r->p >= r->end || *r->p != ':') {
                free(name);
                return 0;
            }
            r->p++;
        }
        cJSON *child = parse_value(r);
        if (!child) {
            free(name);
            return 0;
        }
        child->string = name;
        if (last) {
            last->next = child;
            child->prev = last;
        } else {
            parent->child = child;
        }
        last = child;
        skip_ws(r);
        if (r->p < r->end && *r->p == ',') {
            r->p++;
            continue;
        }
        if (r->p < r->end && *r->p == close) {
            r->p++;
            return 1;
        }
        return 0;
    }
}

static cJSON *parse_value(reader_t *r) {
    skip_ws(r);
    if (r->p >= r->end) return NULL;
    cJSON *item = NULL;
    char ch = *r->p;
    if (ch == '{' || ch == '[') {
        if (++r->depth > MAX_DEPTH) return NULL;
        item = new_item(ch == '{' ? cJSON_Object : cJSON_Array);
        r->p++;
        if (!item || !parse_children(r, item, ch == '{' ? '}' : ']', ch == '{')) goto fail;
        r->depth--;
        return item;
    }
    if (ch == '"') {
        item = new_item(cJSON_String);
        if (!item || !(item->valuestring = parse_string(r))) goto fail;
        return item;
    }
    if (literal(r, "true")) return new_item(cJSON_True);
    if (literal(r, "false")) return new_item(cJSON_False);
    if (literal(r, "null")) return new_item(cJSON_NULL);
    item = new_item(cJSON_Number);
    if (item && parse_number(r, item)) return item;
fail:
    cJSON_Delete(item);
    return NULL;
}

static cJSON *parse(const char *value, size_t len, const char **end_out, int require_end) {
    reader_t r = {.p = value, .end = value + len, .depth = 0};
    cJSON *root = parse_value(&r);
    if (root && require_end) {
        skip_ws(&r);
        if (r.p != r.end) {
            cJSON_Delete(root);
            root = NULL;
        }
    }
    if (end_out) *end_out = r.p;
    return root;
}

cJSON *cJSON_ParseWithOpts(const char *value, const char **return_parse_end, cJSON_bool require_null_terminated) {
    if (!value) return NULL;
    return parse(value, strlen(value), return_parse_end, require_null_terminated);
}

cJSON *cJSON_ParseWithLength(const char *value, size_t length) {
    if (!value) return NULL;
    return parse(value, length, NULL, 0);
}

cJSON *cJSON_Parse(const char *value) {
    return cJSON_ParseWithOpts(value, NULL, 0);
}

cJSON *cJSON_GetObjectItemCaseSensitive(const cJSON *object, const char *name) {
    if (!object || !name || object->type != cJSON_Object) return NULL;
    for (cJSON *c = object->child; c; c = c->next)
        if (c->string && !strcmp(c->string, name)) return c;
    return NULL;
}

cJSON *cJSON_GetArrayItem(const cJSON *array, int index) {
    if (!array || index < 0) return NULL;
    cJSON *c = array->child;
    while (c && index-- > 0) c = c->next;
    return c;
}

int cJSON_GetArraySize(const cJSON *array) {
    int n = 0;
    if (array)
        for (const cJSON *c = array->child; c; c = c->next) n++;
    return n;
}

cJSON_bool cJSON_IsInvalid(const cJSON *item) {
    return item && item->type == cJSON_Invalid;
}
cJSON_bool cJSON_IsFalse(const cJSON *item) {
    return item && item->type == cJSON_False;
}
cJSON_bool cJSON_IsTrue(const cJSON *item) {
    return item && item->type == cJSON_True;
}
cJSON_bool cJSON_IsBool(const cJSON *item) {
    return item && (item->type == cJSON_True || item->type == cJSON_False);
}
cJSON_bool cJSON_IsNull(const cJSON *item) {
    return item && item->type == cJSON_NULL;
}
cJSON_bool cJSON_IsNumber(const cJSON *item) {
    return item && item->type == cJSON_Number;
}
cJSON_bool cJSON_IsString(const cJSON *item) {
    return item && item->type == cJSON_String;
}
cJSON_bool cJSON_IsArray(const cJSON *item) {
    return item && item->type == cJSON_Array;
}
cJSON_bool cJSON_IsObject(const cJSON *item) {
    return item && item->type == cJSON_Object;
}

static char *dup_str(const char *s) {
    if (!s) return NULL;
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

cJSON *cJSON_Duplicate(const cJSON *item, cJSON_bool recurse) {
    if (!item) return NULL;
    cJSON *d = new_item(item->type);
    if (!d) return NULL;
    d->valueint = item->valueint;
    d->valuedouble = item->valuedouble;
    if ((item->valuestring && !(d->valuestring = dup_str(item->valuestring))) ||
        (item->string && !(d->string = dup_str(item->string))))
        goto fail;
    if (recurse) {
        cJSON *tail = NULL;
        for (const cJSON *c = item->child; c; c = c->next) {
            cJSON *k = cJSON_Duplicate(c, 1);
            if (!k) goto fail;
            if (tail) {
                tail->next = k;
                k->prev = tail;
            } else {
                d->child = k;
            }
            tail = k;
        }
    }
    return d;
fail:
    cJSON_Delete(d);
    return NULL;
}

cJSON *cJSON_CreateString(const char *string) {
    cJSON *c = new_item(cJSON_String);
    if (c && !(c->valuestring = dup_str(string ? string : ""))) {
        free(c);
        return NULL;
    }
    return c;
}

cJSON_bool cJSON_AddItemToObject(cJSON *object, const char *name, cJSON *item) {
    if (!object || !name || !item || item == object) return 0;
    char *key = dup_str(name);
    if (!key) return 0;
    free(item->string);
    item->string = key;
    item->next = NULL;
    cJSON *c = object->child;
    if (!c) {
        object->child = item;
        item->prev = NULL;
        return 1;
    }
    while (c->next) c = c->next;
    c->next = item;
    item->prev = c;
    return 1;
}

void cJSON_DeleteItemFromObjectCaseSensitive(cJSON *object, const char *name) {
    cJSON *c = cJSON_GetObjectItemCaseSensitive(object, name);
    if (!c) return;
    if (c->prev) c->prev->next = c->next;
    else object->child = c->next;
    if (c->next) c->next->prev = c->prev;
    c->next = c->prev = NULL;
    cJSON_Delete(c);
}
