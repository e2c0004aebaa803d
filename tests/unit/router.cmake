# The router's prefix index and replica scores (router/prefix_index.c); it
# checks the index against the coordinator's KV ledger, so links both.
loom_add_test(test_prefix_index SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_prefix_index.c LIBS loom_router_core loom_coord_core
              LABELS unit TIMEOUT 30)
# The response cache and tenant limits (router/response_cache.c, router/tenants.c).
loom_add_test(test_router_limits SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_router_limits.c LIBS loom_router_core
              LABELS unit TIMEOUT 30)
