/* The coordinator's HTTP gateway: the gateway library (gateway/http.h)
 * started in front of this process's reactor, its /metrics rendered from
 * the server's metrics. */
#ifndef LOOM_COORD_GATEWAY_H
#define LOOM_COORD_GATEWAY_H

#include "common/status.h"
#include "coordinator/server.h"
#include "gateway/http.h"

/* Starts the gateway on srv's inproc endpoint (loom_http_start_at). Call
 * after loom_server_create; requests wait until loom_server_run turns. */
loom_status_t loom_http_start(loom_server_t *srv, const loom_http_config_t *cfg, loom_http_t **out, loom_err_t *err);

#endif
