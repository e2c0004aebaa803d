/* Shared bits of the libFuzzer targets (tests/fuzz, docs/fuzzing.md). Each
 * target defines LLVMFuzzerTestOneInput; a property a target checks beyond
 * "no sanitizer report" fails through FUZZ_ASSERT, which aborts so that
 * libFuzzer saves the input. */
#ifndef LOOM_FUZZ_H
#define LOOM_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/log.h"
#include "common/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

#define FUZZ_ASSERT(cond)                                                                          \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "fuzz property failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__);      \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* Quiet logs: the targets feed garbage on purpose. */
static inline void fuzz_quiet(void) {
    loom_log_set_level(LOOM_LOG_OFF);
}

/* A real tokenizer for the targets that tokenize (stories260K: <s>, </s>
 * special): $LOOM_FUZZ_MODEL, else the models directory known at build time.
 * NULL when neither is there (the target then skips tokenizing). */
static inline loom_tokenizer_t *fuzz_tokenizer(void) {
    const char *dir = getenv("LOOM_FUZZ_MODEL");
#ifdef LOOM_FUZZ_MODEL_DIR
    if (!dir) dir = LOOM_FUZZ_MODEL_DIR;
#endif
    loom_tokenizer_t *tok = NULL;
    loom_err_t err = {0};
    if (dir && loom_tokenizer_load(dir, &tok, &err) < 0) {
        fprintf(stderr, "fuzz: no tokenizer in %s (%s): not tokenizing\n", dir, err.msg);
        tok = NULL;
    }
    return tok;
}

/* Whether a decoded protobuf message, or one nested in it, kept unknown
 * fields. protobuf-c 1.4.1 accepts a field number 0 written as a
 * non-minimal varint tag and keeps it as unknown; packed again it is a
 * one-byte tag 0, which it then refuses. Such input is not a Loom message
 * either way; the round-trip property holds for messages without them. */
#include <protobuf-c/protobuf-c.h>
static inline int fuzz_pb_has_unknown(const ProtobufCMessage *m) {
    if (!m) return 0;
    if (m->n_unknown_fields) return 1;
    const ProtobufCMessageDescriptor *d = m->descriptor;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->type != PROTOBUF_C_TYPE_MESSAGE) continue;
        const char *base = (const char *)m;
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = *(const size_t *)(base + f->quantifier_offset);
            ProtobufCMessage *const *v = *(ProtobufCMessage *const *const *)(base + f->offset);
            for (size_t k = 0; k < n; k++)
                if (fuzz_pb_has_unknown(v[k])) return 1;
        } else {
            if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
                uint32_t which = *(const uint32_t *)(base + f->quantifier_offset);
                if (which != f->id) continue;
            }
            if (fuzz_pb_has_unknown(*(ProtobufCMessage *const *)(base + f->offset))) return 1;
        }
    }
    return 0;
}

#endif
