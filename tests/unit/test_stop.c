/* Stop strings over streamed text: the earliest stop wins, matches are found
 * past NUL bytes, and the safe prefix holds back a possible stop string's
 * start and never splits a UTF-8 character. */
#include <string.h>

#include "coordinator/stop.h"
#include "tests/test.h"

static void test_find(void) {
    char *stops[] = {"b", "a", "zz"};
    CHECK(loom_stop_find(stops, 3, "xab", 3) == 1); /* "a" at 1 beats "b" at 2 */
    CHECK(loom_stop_find(stops, 3, "xyz", 3) == -1);
    CHECK(loom_stop_find(stops, 0, "ab", 2) == -1);
    const char nul[] = "once\0upon zz";
    CHECK(loom_stop_find(stops + 2, 1, nul, sizeof nul - 1) == 10); /* past the NUL */
    CHECK(loom_stop_find(stops + 2, 1, nul, 11) == -1);             /* length bounds the search */
    char *empty[] = {"", "on"};
    CHECK(loom_stop_find(empty, 2, "upon", 4) == 2);
    char *over[] = {"the end", "end"}; /* overlapping: the earlier start wins */
    CHECK(loom_stop_find(over, 2, "at the end", 10) == 3);
}

static void test_safe_prefix(void) {
    char *stops[] = {"The End"};
    CHECK(loom_stop_safe_prefix(stops, 1, "and The E", 9) == 4); /* "The E" may become a stop */
    CHECK(loom_stop_safe_prefix(stops, 1, "and so", 6) == 6);
    CHECK(loom_stop_safe_prefix(stops, 0, "The", 3) == 3);
    const char nul[] = "a\0b The";
    CHECK(loom_stop_safe_prefix(stops, 1, nul, sizeof nul - 1) == 4); /* the NUL is sent, "The" held */
    /* "é" is 0xc3 0xa9: a stop starting with 0xa9 must not split it */
    char *tail[] = {"\xa9x"};
    CHECK(loom_stop_safe_prefix(tail, 1, "caf\xc3\xa9", 5) == 3);
}

int main(void) {
    RUN(test_find);
    RUN(test_safe_prefix);
    return test_summary();
}
