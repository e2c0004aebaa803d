/* Stop strings over streamed text. Generated text may hold NUL bytes (a
 * decoded <0x00>), so both functions take lengths and never stop at a NUL. */
#ifndef LOOM_STOP_H
#define LOOM_STOP_H

#include <stddef.h>

/* Where the earliest occurrence of any of the n stop strings starts in
 * text[0, len), or -1 when none occurs. Empty stop strings are ignored. */
long loom_stop_find(char *const *stops, int n, const char *text, size_t len);

/* The length of the stop string loom_stop_find reported at pos (the first
 * of the n that occurs there), 0 when none does. */
size_t loom_stop_len_at(char *const *stops, int n, const char *text, size_t len, size_t pos);

/* How many leading bytes of text[0, len) can be sent now: all but the
 * longest suffix that is a proper prefix of some stop string (it may yet
 * become one), cut back to a whole UTF-8 character. */
size_t loom_stop_safe_prefix(char *const *stops, int n, const char *text, size_t len);

#endif
