/* Network addresses as users type them: "host:port" is read as
 * tcp://host:port; an address with a scheme (tcp://, ipc://, inproc://) is
 * used as it is. Every option that takes a ZeroMQ address goes through this. */
#ifndef LOOM_ENDPOINT_H
#define LOOM_ENDPOINT_H

#include <stddef.h>

/* Writes the ZeroMQ endpoint for addr into out (n bytes). Returns 0, or -1
 * when addr is empty or the result does not fit (out then holds ""). */
int loom_endpoint_normalize(const char *addr, char *out, size_t n);

#endif
