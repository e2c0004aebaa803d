/* A stand-in for <cjson/cJSON.h> in the standalone GPU test build, which
 * must build with the CUDA toolkit alone: the subset of the cJSON API that
 * common/safetensors.c and common/model_config.c use (parse, free, look-up,
 * type tests, iteration, and the few edits model_config.c makes: duplicate,
 * replace a member, create a string), implemented in ../cjson_shim.c. The regular build
 * links the real cJSON. */
#ifndef LOOM_TEST_CJSON_SHIM_H
#define LOOM_TEST_CJSON_SHIM_H

#include <stddef.h>

#define cJSON_Invalid 0
#define cJSON_False   (1 << 0)
#define cJSON_True    (1 << 1)
#define cJSON_NULL    (1 << 2)
#define cJSON_Number  (1 << 3)
#define cJSON_String  (1 << 4)
#define cJSON_Array   (1 << 5)
#define cJSON_Object  (1 << 6)

typedef int cJSON_bool;

typedef struct cJSON {
    struct cJSON *next, *prev;
    struct cJSON *child; /* first element of an array or member of an object */
    int type;
    char *valuestring;
    int valueint;
    double valuedouble;
    char *string; /* member name inside an object */
} cJSON;

/* Parses one JSON value. *return_parse_end (when not NULL) points after the
 * value, or at the error. require_null_terminated: nothing may follow. */
cJSON *cJSON_ParseWithOpts(const char *value, const char **return_parse_end, cJSON_bool require_null_terminated);
cJSON *cJSON_ParseWithLength(const char *value, size_t length);
cJSON *cJSON_Parse(const char *value);
void cJSON_Delete(cJSON *item);

cJSON *cJSON_GetObjectItemCaseSensitive(const cJSON *object, const char *name);
cJSON *cJSON_GetArrayItem(const cJSON *array, int index);
int cJSON_GetArraySize(const cJSON *array);

/* Deep copy when recurse, else the item alone (no children). */
cJSON *cJSON_Duplicate(const cJSON *item, cJSON_bool recurse);
cJSON *cJSON_CreateString(const char *string);
/* Appends item under name (copied); the object owns item afterwards. */
cJSON_bool cJSON_AddItemToObject(cJSON *object, const char *name, cJSON *item);
/* Unlinks and frees the first member called name, if any. */
void cJSON_DeleteItemFromObjectCaseSensitive(cJSON *object, const char *name);

cJSON_bool cJSON_IsInvalid(const cJSON *item);
cJSON_bool cJSON_IsFalse(const cJSON *item);
cJSON_bool cJSON_IsTrue(const cJSON *item);
cJSON_bool cJSON_IsBool(const cJSON *item);
cJSON_bool cJSON_IsNull(const cJSON *item);
cJSON_bool cJSON_IsNumber(const cJSON *item);
cJSON_bool cJSON_IsString(const cJSON *item);
cJSON_bool cJSON_IsArray(const cJSON *item);
cJSON_bool cJSON_IsObject(const cJSON *item);

#define cJSON_ArrayForEach(element, array)                                                         \
    for ((element) = (array) != NULL ? (array)->child : NULL; (element) != NULL; (element) = (element)->next)

#endif
