# /metrics against dashboards (test_metrics.py): vLLM's series with vLLM's
# types, labels and buckets; every expression of vLLM's example Grafana
# dashboard and of deploy/grafana/loom.json resolves after traffic; Loom's
# names pass promtool's naming rules. Sorted after integration.cmake, whose
# loom_add_it it uses.
loom_add_it(it_metrics test_metrics.py)
