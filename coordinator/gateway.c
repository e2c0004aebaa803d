/* The coordinator's HTTP gateway (gateway.h): the reactor's inproc endpoint
 * and its metrics handed to the gateway library. */
#include "coordinator/gateway.h"

#include "coordinator/metrics.h"

static char *render_metrics(void *ctx, size_t *len) {
    return loom_metrics_render(loom_server_metrics((loom_server_t *)ctx), len);
}

static int liveness(void *ctx, char *msg, size_t cap) {
    return loom_server_liveness((const loom_server_t *)ctx, msg, cap);
}

loom_status_t loom_http_start(loom_server_t *srv, const loom_http_config_t *cfg, loom_http_t **out, loom_err_t *err) {
    loom_http_endpoint_t ep = {.zmq_context = loom_server_zmq_context(srv),
                               .inproc_addr = loom_server_inproc_addr(srv),
                               .metrics = render_metrics,
                               .metrics_ctx = srv,
                               .liveness = liveness,
                               .liveness_ctx = srv,
                               .max_queue = loom_server_max_queue(srv)};
    return loom_http_start_at(&ep, cfg, out, err);
}
