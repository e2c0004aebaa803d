/* The standalone GPU build on a machine without libsodium: the tcp data
 * plane (whose links authenticate with it) is left out and says so. */
#include "worker/comm_impl.h"

loom_status_t loom_comm_tcp_create(const loom_comm_config_t *cfg, loom_comm_t **out, loom_err_t *err) {
    (void)cfg;
    *out = NULL;
    return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                        "the tcp data plane is not in this build (it needs libsodium); use shm or nccl");
}
