"""Deployment files stay true to the binaries and to Kubernetes.

Every manifest in deploy/k8s is checked against the real Kubernetes API
schemas, twice: Debian's python3-kubernetes models (their attribute maps list
every field of every kind, so an unknown or misspelt key is caught anywhere in
a manifest) and the npm kubernetes-models validators (types, enums and
required fields of the current API). Then what makes a cluster form, drain
and fail over: workers reach the coordinator while it is unready, one
coordinator at a time, probes and resources everywhere, the API key Secret
required, disruption budgets and network policies that select real pods, an
autoscaler on a gauge Loom exports, and only options the binaries have.
The router (loom-router.yaml) is keyed both ways, probed on its --probe-listen
/ready and /health (a listener of their own), and
autoscaled.
The worker's --health-file, which the worker probes read, is tested on real
processes. The images build targets that exist.
"""
import copy
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BIN, ROOT, STORIES, Failure, check, free_port_pair, generate, run_tests  # noqa: E402

K8S = os.path.join(ROOT, "deploy", "k8s")
HERE = os.path.dirname(os.path.abspath(__file__))
CONTROL_PORT = 5556
WORKLOADS = ("Deployment", "StatefulSet", "LeaderWorkerSet")

# LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) is a custom resource, absent
# from the core schemas: its own fields are checked against this
# transcription of its API reference (lws.sigs.k8s.io, LeaderWorkerSetSpec),
# its pod templates against the core PodTemplateSpec schema. A tuple lists
# the allowed values; "PodTemplateSpec" names a core schema.
LWS_SPEC = {
    "replicas": int,
    "startupPolicy": ("LeaderCreated", "LeaderReady"),
    "rolloutStrategy": {
        "type": ("RollingUpdate",),
        "rollingUpdateConfiguration": {"partition": int, "maxUnavailable": (int, str), "maxSurge": (int, str)},
    },
    "networkConfig": {"subdomainPolicy": ("Shared", "UniquePerReplica")},
    "leaderWorkerTemplate": {
        "leaderTemplate": "PodTemplateSpec",
        "workerTemplate": "PodTemplateSpec",
        "size": int,
        "restartPolicy": ("Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"),
        "subGroupPolicy": {"subGroupPolicyType": ("LeaderWorker", "LeaderExcluded"), "subGroupSize": int},
        "volumeClaimTemplates": "list[V1PersistentVolumeClaim]",
        "persistentVolumeClaimRetentionPolicy": "V1StatefulSetPersistentVolumeClaimRetentionPolicy",
    },
}
LWS_REQUIRED = ("leaderWorkerTemplate", "leaderWorkerTemplate.workerTemplate")


def load_manifests():
    import yaml
    out = {}
    for path in sorted(glob.glob(os.path.join(K8S, "*.yaml"))):
        with open(path) as f:
            out[os.path.basename(path)] = [d for d in yaml.safe_load_all(f) if d]
    check(len(out) >= 4, "expected the CPU, GPU, LeaderWorkerSet and router manifests in %s, found %s" % (K8S, list(out)))
    return out


def options(binary):
    out = subprocess.run([os.path.join(BIN, binary), "--help"], capture_output=True, text=True, timeout=30).stdout
    return set(re.findall(r"^\s+(--[a-z0-9-]+)", out, re.M))


# ---- schema checks ---------------------------------------------------------

def model_class(name):
    try:
        import kubernetes.client.models as models
    except ImportError:
        raise Failure("the schema check needs Debian's python3-kubernetes (scripts/setup-debian.sh)")
    return getattr(models, name, None)


def core_model(api_version, kind):
    """The python3-kubernetes model of a core kind, e.g. apps/v1 Deployment -> V1Deployment."""
    name = api_version.split("/")[-1].capitalize() + kind
    if model_class(name) is None and api_version == "autoscaling/v2":
        # python3-kubernetes 22 (API 1.22) predates autoscaling/v2, which
        # took v2beta2's fields unchanged
        name = "V2beta2" + kind
    return name if model_class(name) is not None else None


def walk_model(value, typ, path, errs):
    """Reports every key that the schema `typ` (a python3-kubernetes type
    string) does not define, and objects or lists where the schema has none."""
    if typ.startswith("list["):
        if not isinstance(value, list):
            errs.append("%s: expected a list (%s)" % (path, typ))
            return
        for i, v in enumerate(value):
            walk_model(v, typ[5:-1], "%s[%d]" % (path, i), errs)
    elif typ.startswith("dict("):
        if not isinstance(value, dict):
            errs.append("%s: expected a map (%s)" % (path, typ))
            return
        inner = typ[typ.index(",") + 1:-1].strip()
        for k, v in value.items():
            walk_model(v, inner, "%s.%s" % (path, k), errs)
    elif model_class(typ) is not None:
        cls = model_class(typ)
        if not isinstance(value, dict):
            errs.append("%s: expected an object (%s)" % (path, typ))
            return
        fields = {j: p for p, j in cls.attribute_map.items()}
        for k, v in value.items():
            if k not in fields:
                errs.append("%s.%s: unknown field (%s has no such field)" % (path, k, typ))
            else:
                walk_model(v, cls.openapi_types[fields[k]], "%s.%s" % (path, k), errs)
    elif typ in ("str", "int", "bool", "float", "object", "datetime"):
        if typ in ("str", "int", "bool", "float") and isinstance(value, (dict, list)):
            errs.append("%s: expected a %s" % (path, typ))
    else:
        errs.append("%s: no schema %s" % (path, typ))


def walk_lws(value, schema, path, errs, templates):
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            errs.append("%s: expected an object" % path)
            return
        for k, v in value.items():
            if k not in schema:
                errs.append("%s.%s: unknown field (LeaderWorkerSet has no such field)" % (path, k))
            else:
                walk_lws(v, schema[k], "%s.%s" % (path, k), errs, templates)
    elif schema == "PodTemplateSpec":
        walk_model(value, "V1PodTemplateSpec", path, errs)
        templates.append((path, value))
    elif isinstance(schema, str):
        walk_model(value, schema, path, errs)
    elif isinstance(schema, tuple) and all(isinstance(s, str) for s in schema):
        if value not in schema:
            errs.append("%s: %r is not one of %s" % (path, value, ", ".join(schema)))
    elif isinstance(schema, tuple):
        if not isinstance(value, schema) or isinstance(value, bool):
            errs.append("%s: %r has the wrong type" % (path, value))
    elif not isinstance(value, schema) or isinstance(value, bool):
        errs.append("%s: %r is not a %s" % (path, value, schema.__name__))


def schema_errors(manifests):
    """Every schema violation in the manifests: unknown fields from the
    python3-kubernetes models, the rest from the kubernetes-models validators."""
    errs, npm_items = [], []
    for name, docs in manifests.items():
        for i, d in enumerate(docs):
            where = "%s[%d] %s/%s" % (name, i, d.get("kind"), d.get("metadata", {}).get("name"))
            api, kind = d.get("apiVersion", ""), d.get("kind", "")
            if api == "leaderworkerset.x-k8s.io/v1" and kind == "LeaderWorkerSet":
                templates = []
                for k, v in d.items():
                    if k == "metadata":
                        walk_model(v, "V1ObjectMeta", where + " metadata", errs)
                    elif k == "spec":
                        walk_lws(v, LWS_SPEC, where + " spec", errs, templates)
                    elif k not in ("apiVersion", "kind"):
                        errs.append("%s: unknown field %s" % (where, k))
                for req in LWS_REQUIRED:
                    node = d.get("spec", {})
                    for part in req.split("."):
                        node = node.get(part) if isinstance(node, dict) else None
                    if node is None:
                        errs.append("%s: spec.%s is required" % (where, req))
                npm_items += [{"where": p, "model": "v1/PodTemplateSpec", "object": t} for p, t in templates]
                continue
            model = core_model(api, kind)
            if model is None:
                errs.append("%s: %s %s is not a Kubernetes kind" % (where, api, kind))
                continue
            walk_model(d, model, where, errs)
            group = api if "/" in api else "v1"
            npm_items.append({"where": where, "model": "%s/%s" % (group, kind), "object": d})
    p = subprocess.run(["node", os.path.join(HERE, "k8s_schema.mjs")], input=json.dumps(npm_items),
                       capture_output=True, text=True, timeout=120)
    check(p.returncode == 0, "k8s_schema.mjs failed (npm ci --prefix tests/reference?): %s" % p.stderr)
    errs += ["%s: %s" % (e["where"], e["error"]) for e in json.loads(p.stdout)]
    return errs


def test_k8s_manifests_follow_the_schemas():
    errs = schema_errors(load_manifests())
    check(not errs, "schema errors:\n  " + "\n  ".join(errs))


def test_k8s_schema_check_catches_mistakes():
    """The schema check fails on what kubectl would refuse or silently drop."""
    manifests = load_manifests()
    base = manifests["loom.yaml"]

    def broken(change):
        docs = copy.deepcopy(base)
        change(docs)
        return schema_errors({"loom.yaml": docs})

    def workload(docs, kind):
        return next(d for d in docs if d["kind"] == kind)

    def container(docs, kind):
        return workload(docs, kind)["spec"]["template"]["spec"]["containers"][0]

    cases = [
        ("a misspelt probe field", "livenessProbe.paht: unknown field",
         lambda docs: container(docs, "StatefulSet")["livenessProbe"].update(paht="/x")),
        ("an unknown container field", "imagePullPolcy: unknown field",
         lambda docs: container(docs, "Deployment").update(imagePullPolcy="Always")),
        ("publishNotReadyAddresses at the wrong level", "control.publishNotReadyAddresses: unknown field",
         lambda docs: next(d for d in docs if d["metadata"]["name"] == "loom-coordinator-control")
         .update(publishNotReadyAddresses=True)),
        ("a string where an integer belongs", "spec/replicas must be integer",
         lambda docs: workload(docs, "StatefulSet")["spec"].update(replicas="five")),
        ("a strategy Kubernetes does not know", "strategy/type must be equal to one of the allowed values",
         lambda docs: workload(docs, "Deployment")["spec"]["strategy"].update(type="Replace")),
        ("a container without a name", "must have required property name",
         lambda docs: container(docs, "Deployment").pop("name")),
    ]
    for what, needle, change in cases:
        errs = broken(change)
        check(any(needle in e for e in errs), "%s was not caught: %s" % (what, errs))
    # the LeaderWorkerSet's own fields, and the core fields inside its templates
    lws = copy.deepcopy(manifests["loom-lws.yaml"])
    group = next(d for d in lws if d["kind"] == "LeaderWorkerSet")
    group["spec"]["leaderWorkerTemplate"]["groupSize"] = 6
    group["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Never"
    group["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["resource"] = {}
    errs = schema_errors({"loom-lws.yaml": lws})
    for needle in ("leaderWorkerTemplate.groupSize: unknown field", "restartPolicy: 'Never' is not one of",
                   "containers[0].resource: unknown field"):
        check(any(needle in e for e in errs), "LeaderWorkerSet mistake %s was not caught: %s" % (needle, errs))


# ---- what the manifests must say --------------------------------------------

def pod_templates(doc):
    """(where, pod template) of a workload: Deployment, StatefulSet, LeaderWorkerSet."""
    spec = doc.get("spec", {})
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return [("template", spec["template"])]
    if doc["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        return [(k, lwt[k]) for k in ("leaderTemplate", "workerTemplate") if k in lwt]
    return []


def selects(selector, labels):
    """Whether a matchLabels selector picks pods with these labels (an empty one picks all)."""
    return all(labels.get(k) == v for k, v in (selector or {}).items())


def arg_map(container):
    return dict(a.split("=", 1) if "=" in a else (a, "") for a in container.get("args", []))


def loom_containers(docs):
    """(doc, template, container, binary) for every loom-* container."""
    for d in docs:
        for _, t in pod_templates(d):
            for c in t["spec"].get("containers", []):
                cmd = c.get("command", [""])[0]
                if cmd.startswith("loom"):
                    yield d, t, c, cmd


def is_router_manifest(docs):
    """A file of routers only (loom-router.yaml): no grid of its own."""
    cmds = {cmd for _, _, _, cmd in loom_containers(docs)}
    return cmds == {"loom-router"}


def rules_binaries(manifests):
    """Every option the manifests pass exists in the binary's --help."""
    known = {b: options(b) for b in ("loom-coordinator", "loom-worker", "loom-router")}
    for name, docs in manifests.items():
        grid = workers = None
        for d, t, c, cmd in loom_containers(docs):
            check(cmd in known, "%s: unknown binary %s" % (name, cmd))
            for a in c.get("args", []):
                opt = a.split("=", 1)[0]
                check(opt in known[cmd], "%s has no option %s (deploy/k8s/%s)" % (cmd, opt, name))
            args = arg_map(c)
            if cmd == "loom-coordinator":
                grid = int(args.get("--tp", 1)) * int(args.get("--pp", 1))
                grace = t["spec"].get("terminationGracePeriodSeconds", 30)
                check("--shutdown-timeout" in args and grace > int(args["--shutdown-timeout"]),
                      "%s: terminationGracePeriodSeconds %s must exceed --shutdown-timeout %s"
                      % (name, grace, args.get("--shutdown-timeout")))
            if cmd == "loom-worker":
                workers = (d["spec"]["replicas"] if d["kind"] == "StatefulSet"
                           else d["spec"]["leaderWorkerTemplate"]["size"] - 1)
        if is_router_manifest(docs):
            continue
        check(grid is not None and workers is not None and workers >= grid,
              "%s: %s workers for a grid of %s" % (name, workers, grid))


def rules_containers(manifests):
    for name, docs in manifests.items():
        for d in docs:
            for where, t in pod_templates(d):
                for c in t["spec"].get("containers", []):
                    what = "%s %s/%s %s container %s" % (name, d["kind"], d["metadata"]["name"], where, c["name"])
                    check("readinessProbe" in c and "livenessProbe" in c, what + ": needs readiness and liveness probes")
                    res = c.get("resources", {})
                    check(res.get("requests", {}).get("cpu") and res.get("requests", {}).get("memory")
                          and res.get("limits", {}).get("memory"), what + ": needs cpu/memory requests and a memory limit")
                    for e in c.get("env", []):
                        ref = e.get("valueFrom", {}).get("secretKeyRef")
                        check(not ref or ref.get("optional") is not True, what + ": Secret %s is optional" % e["name"])
                    cmd = c.get("command", [""])[0]
                    if cmd in ("loom-coordinator", "loom-router"):
                        env = {e["name"]: e for e in c.get("env", [])}
                        check("LOOM_API_KEY" in env and "secretKeyRef" in env["LOOM_API_KEY"].get("valueFrom", {}),
                              what + ": LOOM_API_KEY must come from a Secret")
                        check(t["spec"].get("terminationGracePeriodSeconds"), what + ": set terminationGracePeriodSeconds")
                    if cmd == "loom-worker":
                        # exec probes read the file the worker writes
                        health = arg_map(c).get("--health-file")
                        check(health, what + ": needs --health-file for its probes")
                        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                            check(health in " ".join(c.get(probe, {}).get("exec", {}).get("command", [])),
                                  "%s: %s does not read %s" % (what, probe, health))
                        limits = c["resources"].get("limits", {})
                        if "cuda" in arg_map(c).get("--device", ""):
                            check(limits.get("nvidia.com/gpu") == "1", what + ": a CUDA worker needs nvidia.com/gpu: 1")
                            check(any(tol.get("key") == "nvidia.com/gpu" for tol in t["spec"].get("tolerations", [])),
                                  what + ": a CUDA worker must tolerate the nvidia.com/gpu taint")


def rules_security(manifests):
    """Both ZeroMQ planes are keyed (CURVE) from Secret volumes, and every
    worker presents a key named after its --id."""
    for name, docs in manifests.items():
        for d, t, c, cmd in loom_containers(docs):
            args = arg_map(c)
            what = "%s %s container %s" % (name, d["metadata"]["name"], c["name"])
            want = {"loom-coordinator": ("--curve-secret", "--worker-keys", "--client-keys"),
                    # both ways: a client of the replicas, a server of its own API
                    "loom-router": ("--replica-server-key", "--replica-secret", "--curve-secret", "--client-keys")
                    }.get(cmd, ("--curve-server-key", "--curve-secret"))
            for opt in want:
                check(opt in args, what + ": %s is missing: the plane is not keyed" % opt)
            check("--insecure-api" not in args, what + ": --insecure-api serves the API to anyone")
            if cmd == "loom-worker":
                check("$(POD_NAME)" in args["--curve-secret"] and args.get("--id") == "$(POD_NAME)",
                      what + ": the worker's key must be the one named after its --id")
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            vols = {v["name"]: v for v in t["spec"].get("volumes", [])}
            for opt in want:
                path = args[opt]
                mount = next((m for m in mounts if path.startswith(m.rstrip("/") + "/")), None)
                check(mount and "secret" in vols.get(mounts[mount], {}),
                      what + ": %s=%s is not on a Secret volume" % (opt, path))


def rules_cluster(manifests):
    for name, docs in manifests.items():
        if is_router_manifest(docs):
            continue
        services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
        pods = [(d, t["metadata"].get("labels", {})) for d in docs for _, t in pod_templates(d)]
        coord = [(d, t, c) for d, t, c, cmd in loom_containers(docs) if cmd == "loom-coordinator"]
        workers = [(d, t, c) for d, t, c, cmd in loom_containers(docs) if cmd == "loom-worker"]
        check(len(coord) == 1 and workers, "%s: one coordinator and workers" % name)
        cdoc, ctpl, ccont = coord[0]
        clabels = ctpl["metadata"]["labels"]
        wlabels = workers[0][1]["metadata"]["labels"]
        check(not selects(clabels, wlabels) and not selects(wlabels, clabels),
              "%s: coordinator and worker pods need telling apart" % name)
        if cdoc["kind"] == "Deployment":
            check(cdoc["spec"]["replicas"] == 1 and cdoc["spec"].get("strategy", {}).get("type") == "Recreate",
                  "%s: the coordinator Deployment must be one replica with strategy Recreate" % name)
        # workers dial the coordinator at a name that resolves while it is unready
        for d, t, c in workers:
            args = arg_map(c)
            if "--coordinator" in args:
                host = re.match(r"tcp://([^:]+):(\d+)$", args["--coordinator"])
                check(host and int(host.group(2)) == CONTROL_PORT, "%s: worker --coordinator %s" % (name, args["--coordinator"]))
                host = host.group(1)
            else:
                check("--etcd" in args, "%s: workers need --coordinator or --etcd" % name)
                host = arg_map(ccont).get("--advertise-host")
                check(host, "%s: with etcd, the coordinator must --advertise-host a name workers can dial" % name)
            if d["kind"] == "LeaderWorkerSet":
                # the group's headless Service publishes the leader before it is ready
                check(host == "$(LWS_LEADER_ADDRESS)", "%s: workers dial %s, not the group's leader" % (name, host))
                continue
            svc = services.get(host)
            check(svc is not None, "%s: workers dial %s, which is no Service here" % (name, host))
            check(svc["spec"].get("publishNotReadyAddresses") is True and svc["spec"].get("clusterIP") == "None",
                  "%s: Service %s must be headless with publishNotReadyAddresses" % (name, host))
            check(selects(svc["spec"]["selector"], clabels), "%s: Service %s does not select the coordinator" % (name, host))
            check(CONTROL_PORT in [p["port"] for p in svc["spec"].get("ports", [])],
                  "%s: Service %s lacks the control port" % (name, host))
        for d in docs:
            if d["kind"] == "StatefulSet":
                svc = services.get(d["spec"]["serviceName"])
                check(svc is not None and svc["spec"].get("clusterIP") == "None",
                      "%s: StatefulSet %s needs its headless Service %s"
                      % (name, d["metadata"]["name"], d["spec"]["serviceName"]))
            if d["kind"] == "StatefulSet" and any(d is w[0] for w in workers):
                check(d["spec"].get("podManagementPolicy") == "Parallel",
                      "%s: StatefulSet %s: pods become ready only together; use Parallel" % (name, d["metadata"]["name"]))
            if d["kind"] == "Service" and d["spec"].get("selector"):
                check(any(selects(d["spec"]["selector"], labels) for _, labels in pods),
                      "%s: Service %s selects no pod" % (name, d["metadata"]["name"]))
        pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
        check(pdbs, "%s: no PodDisruptionBudget" % name)
        for d in pdbs:
            sel = d["spec"]["selector"]["matchLabels"]
            check(any(selects(sel, labels) for _, labels in pods), "%s: PDB %s selects no pod" % (name, d["metadata"]["name"]))
            check(d["spec"].get("maxUnavailable", 1) != 0 and "minAvailable" not in d["spec"],
                  "%s: PDB %s would block every node drain" % (name, d["metadata"]["name"]))
        # the control port: workers only
        pols = [d for d in docs if d["kind"] == "NetworkPolicy" and selects(d["spec"]["podSelector"]["matchLabels"], clabels)]
        check(pols, "%s: no NetworkPolicy selects the coordinator" % name)
        allowed = False
        for pol in pols:
            check("Ingress" in pol["spec"].get("policyTypes", ["Ingress"]), "%s: the policy must restrict ingress" % name)
            for rule in pol["spec"].get("ingress", []):
                ports = [p.get("port") for p in rule.get("ports", [])]
                if ports and CONTROL_PORT not in ports and "control" not in ports:
                    continue
                peers = rule.get("from", [])
                only_workers = peers and all(set(p) == {"podSelector"} and selects(p["podSelector"].get("matchLabels"), wlabels)
                                             and p["podSelector"].get("matchLabels") for p in peers)
                check(only_workers, "%s: NetworkPolicy %s opens the control port beyond the workers: %s"
                      % (name, pol["metadata"]["name"], rule))
                allowed = True
        check(allowed, "%s: no NetworkPolicy rule lets the workers reach the control port" % name)


def rules_autoscaler(manifests):
    with open(os.path.join(ROOT, "coordinator", "metrics.c")) as f:
        gauges = set(re.findall(r'gauge2?\(&o, [a-z_>-]+, "([a-z_:]+)"', f.read()))
    hpas = 0
    for name, docs in manifests.items():
        workloads = {(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] in WORKLOADS}
        for d in docs:
            if d["kind"] != "HorizontalPodAutoscaler":
                continue
            hpas += 1
            ref = d["spec"]["scaleTargetRef"]
            check((ref["kind"], ref["name"]) in workloads, "%s: HPA scales %s, not in this file" % (name, ref))
            if is_router_manifest(docs):  # routers: CPU (tokenizing, proxying)
                check(ref["kind"] == "Deployment", "%s: HPA scales %s, not the router Deployment" % (name, ref))
                check(all(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in d["spec"]["metrics"]),
                      "%s: scale routers on CPU" % name)
                continue
            check(ref["kind"] == "LeaderWorkerSet", "%s: scale whole Loom clusters (LeaderWorkerSet groups), not %s"
                  % (name, ref["kind"]))
            for m in d["spec"]["metrics"]:
                metric = m[m["type"][0].lower() + m["type"][1:]]["metric"]["name"]
                check(metric in gauges, "%s: HPA metric %s is no gauge of coordinator/metrics.c (%s)"
                      % (name, metric, sorted(gauges)))
                check("waiting" in metric, "%s: scale on the waiting queue, not %s" % (name, metric))
    check(hpas >= 1, "no HorizontalPodAutoscaler in deploy/k8s")


def rules_router(manifests):
    """A keyed router Deployment behind a Service, probed on its --probe-listen /ready and /health."""
    routers = 0
    for name, docs in manifests.items():
        services = [d for d in docs if d["kind"] == "Service"]
        for d, t, c, cmd in loom_containers(docs):
            if cmd != "loom-router":
                continue
            routers += 1
            what = "%s %s container %s" % (name, d["metadata"]["name"], c["name"])
            args = arg_map(c)
            check(d["kind"] == "Deployment", what + ": routers are a Deployment")
            check("--replica" in args or "--etcd" in args, what + ": no replicas (--replica or --etcd)")
            check(args.get("--listen", "").startswith("tcp://0.0.0.0:"), what + ": --listen must serve the pod's peers")
            check("--insecure-api" not in args, what + ": --insecure-api serves the router's API to anyone")
            env = {e["name"] for e in c.get("env", [])}
            check("--replica-api-key" in args or "LOOM_REPLICA_API_KEY" in env,
                  what + ": the replicas require an API key: --replica-api-key or LOOM_REPLICA_API_KEY")
            http = re.match(r".*:(\d+)$", args.get("--http", ""))
            check(http, what + ": --http serves the OpenAI API and /metrics")
            probes = re.match(r".*:(\d+)$", args.get("--probe-listen", ""))
            check(probes, what + ": --probe-listen serves the probes on a listener a flood of the traffic ports "
                  "cannot starve")
            # ready while a replica serves; alive while its reactor turns (restarting a
            # router whose replicas are all down would not bring them back)
            for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health")):
                get = c.get(probe, {}).get("httpGet", {})
                check(get.get("path") == path and str(get.get("port")) == probes.group(1),
                      "%s: %s must GET %s on the --probe-listen port %s" % (what, probe, path, probes.group(1)))
            labels = t["metadata"].get("labels", {})
            svc = [s for s in services if s["spec"].get("selector") and selects(s["spec"]["selector"], labels)]
            check(svc, what + ": no Service selects the router")
            ports = {p["port"] for s in svc for p in s["spec"].get("ports", [])}
            listen = int(args["--listen"].rsplit(":", 1)[1])
            check(listen in ports and int(http.group(1)) in ports,
                  "%s: the router's Service lacks the API %d or HTTP %s port" % (what, listen, http.group(1)))
    check(routers >= 1, "no loom-router in deploy/k8s (loom-router.yaml)")


RULES = (rules_binaries, rules_containers, rules_cluster, rules_security, rules_autoscaler, rules_router)


def test_k8s_manifests_form_drain_and_fail_over():
    manifests = load_manifests()
    for rule in RULES:
        rule(manifests)
    gpu = [name for name, docs in manifests.items() for _, _, c, cmd in loom_containers(docs)
           if cmd == "loom-worker" and arg_map(c).get("--device", "").startswith("cuda")]
    check(len(gpu) >= 2, "expected GPU variants (loom-gpu.yaml, loom-lws.yaml), found workers on GPUs in %s" % gpu)


def test_k8s_rules_catch_mistakes():
    """Each rule fails on the mistake it is there for."""
    def find(docs, kind, name=None):
        return next(d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name))

    def coordinator(docs):
        return find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]

    def worker(docs):
        return find(docs, "StatefulSet", "loom-worker")["spec"]["template"]["spec"]["containers"][0]

    cases = [
        ("RollingUpdate", "strategy Recreate",
         lambda docs: find(docs, "Deployment")["spec"].update(strategy={"type": "RollingUpdate"})),
        ("a ready-only control Service", "publishNotReadyAddresses",
         lambda docs: find(docs, "Service", "loom-coordinator-control")["spec"].pop("publishNotReadyAddresses")),
        ("no worker Service", "needs its headless Service",
         lambda docs: docs.remove(find(docs, "Service", "loom-worker"))),
        ("an optional API key", "is optional",
         lambda docs: coordinator(docs)["env"][0]["valueFrom"]["secretKeyRef"].update(optional=True)),
        ("a worker without a readiness probe", "probes",
         lambda docs: worker(docs).pop("readinessProbe")),
        ("a probe that reads another file", "does not read",
         lambda docs: worker(docs)["args"].__setitem__(-1, "--health-file=/tmp/elsewhere")),
        ("no memory limit", "memory limit",
         lambda docs: coordinator(docs)["resources"].pop("limits")),
        ("a PDB that selects nothing", "selects no pod",
         lambda docs: find(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].update(component="wroker")),
        ("the control port open to all", "beyond the workers",
         lambda docs: find(docs, "NetworkPolicy")["spec"]["ingress"][0].pop("from")),
        ("no rule for the workers", "no NetworkPolicy rule",
         lambda docs: find(docs, "NetworkPolicy")["spec"]["ingress"].pop(0)),
        ("an option the coordinator lacks", "has no option --max-num-seq",
         lambda docs: coordinator(docs)["args"].append("--max-num-seq=8")),
        ("a grace period below the shutdown timeout", "must exceed --shutdown-timeout",
         lambda docs: find(docs, "Deployment")["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=10)),
        ("a control plane without keys", "--worker-keys is missing",
         lambda docs: coordinator(docs)["args"].remove("--worker-keys=/etc/loom/curve/workers.allow")),
        ("worker keys on an emptyDir", "is not on a Secret volume",
         lambda docs: find(docs, "StatefulSet", "loom-worker")["spec"]["template"]["spec"]["volumes"].__setitem__(
             -1, {"name": "curve", "emptyDir": {}})),
        ("fewer workers than the grid", "workers for a grid",
         lambda docs: find(docs, "StatefulSet", "loom-worker")["spec"].update(replicas=3)),
    ]
    base = load_manifests()

    def caught(name, cases):
        for what, needle, change in cases:
            docs = copy.deepcopy(base[name])
            change(docs)
            try:
                for rule in RULES:
                    rule({name: docs})
            except Failure as e:
                check(needle in str(e), "%s: refused for another reason: %s" % (what, e))
                continue
            raise Failure("%s was not caught" % what)

    caught("loom.yaml", cases)

    def router(docs):
        return find(docs, "Deployment", "loom-router")["spec"]["template"]["spec"]["containers"][0]

    router_cases = [
        ("a router API open to anyone", "--insecure-api", lambda docs: router(docs)["args"].append("--insecure-api")),
        ("an unkeyed router API", "--client-keys is missing",
         lambda docs: router(docs)["args"].remove("--client-keys=/etc/loom/curve/router-clients.allow")),
        ("unkeyed replicas", "--replica-secret is missing",
         lambda docs: router(docs)["args"].remove("--replica-secret=/etc/loom/curve/router.key")),
        ("router keys on an emptyDir", "is not on a Secret volume",
         lambda docs: find(docs, "Deployment", "loom-router")["spec"]["template"]["spec"]["volumes"].__setitem__(
             -1, {"name": "curve", "emptyDir": {}})),
        ("a router probed elsewhere", "must GET /ready",
         lambda docs: router(docs)["readinessProbe"]["httpGet"].update(path="/metrics")),
        ("router probes on the traffic port", "on the --probe-listen port",
         lambda docs: router(docs)["livenessProbe"]["httpGet"].update(port=8000)),
        ("an option the router lacks", "has no option --replica-key",
         lambda docs: router(docs)["args"].append("--replica-key=x")),
    ]
    caught("loom-router.yaml", router_cases)
    lws = copy.deepcopy(base["loom-lws.yaml"])
    find(lws, "HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["metric"]["name"] = "loom_requests_waiting"
    try:
        rules_autoscaler({"loom-lws.yaml": lws})
    except Failure as e:
        check("no gauge" in str(e), "autoscaler refused for another reason: %s" % e)
    else:
        raise Failure("an autoscaler metric Loom does not export was not caught")


# ---- the worker's health file ----------------------------------------------

def read_state(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def wait_state(path, states, timeout, procs):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for p in procs:
            check(p.poll() is None, "a process exited early: %s" % p.args)
        s = read_state(path)
        if s in states:
            return s
        time.sleep(0.1)
    raise AssertionError("%s stayed %r, expected %s" % (path, read_state(path), states))


def probe(kind, path):
    """Runs loom.yaml's worker probe `kind` on the health file at `path`: 0 when it passes."""
    c = next(c for _, _, c, cmd in loom_containers(load_manifests()["loom.yaml"]) if cmd == "loom-worker")
    health = arg_map(c)["--health-file"]
    cmd = [a.replace(health, path) for a in c[kind]["exec"]["command"]]
    return subprocess.run(cmd, capture_output=True, timeout=10).returncode


def test_worker_health_file_and_spare():
    """What the worker probes read: serving, standby for a spare, a file that
    stops changing when the worker dies, and the spare serving in its place;
    the manifest's probe commands pass and fail on those files."""
    run = tempfile.mkdtemp(prefix="loom-health-")
    port = free_port_pair()
    ctl = "tcp://127.0.0.1:%d" % (port + 1)
    procs = []
    log = open(os.path.join(run, "all.log"), "w")

    def start(args):
        procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT))
        return procs[-1]

    ok = False
    try:
        coord = start([os.path.join(BIN, "loom-coordinator"), "--insecure", "--model", STORIES, "--listen",
                       "tcp://127.0.0.1:%d" % port, "--control", ctl, "--recovery-timeout-ms", "30000"])
        health = os.path.join(run, "%i.health")
        w0 = start([os.path.join(BIN, "loom-worker"), "--coordinator", ctl, "--threads", "1", "--id", "w0",
                    "--health-file", health])
        h0, h1 = os.path.join(run, "w0.health"), os.path.join(run, "w1.health")
        wait_state(h0, ("serving",), 60, procs)
        start([os.path.join(BIN, "loom-worker"), "--coordinator", ctl, "--threads", "1", "--id", "w1",
               "--health-file", health])
        wait_state(h1, ("standby",), 30, procs)
        check(not os.path.exists(h1 + ".tmp"), "the health file is renamed into place")
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            check(probe(kind, h0) == 0 and probe(kind, h1) == 0, "%s fails on a serving worker or a spare" % kind)
        check(probe("startupProbe", os.path.join(run, "none")) != 0, "startupProbe passes before the file exists")
        joining = os.path.join(run, "joining.health")
        with open(joining, "w") as f:
            f.write("joining\n")
        check(probe("readinessProbe", joining) != 0, "readinessProbe passes on a worker still joining")
        before = os.stat(h0).st_mtime
        time.sleep(2.2)
        check(os.stat(h0).st_mtime > before, "the health file is rewritten every second")
        w0.send_signal(signal.SIGKILL)
        w0.wait()
        procs.remove(w0)
        wait_state(h1, ("joining", "serving"), 30, procs)
        wait_state(h1, ("serving",), 60, procs)
        dead = os.stat(h0).st_mtime
        time.sleep(1.5)
        check(os.stat(h0).st_mtime == dead and read_state(h0) == "serving",
              "a dead worker's file keeps its last state and stops aging")
        os.utime(h0, (dead - 60, dead - 60))
        check(probe("livenessProbe", h0) != 0, "livenessProbe passes on a file a minute old")
        check(probe("readinessProbe", h1) == 0, "readinessProbe fails on the spare now serving")
        rc, out, ids, err = generate("tcp://127.0.0.1:%d" % port, "Once upon a time", max_tokens=8)
        check(rc == 0 and ids and len(ids) == 8, "generation after the spare took over: %d %s" % (rc, err))
        check(coord.poll() is None, "the coordinator exited")
        for p in reversed(procs):  # a clean exit, so the sanitizer build reports leaks
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)
        log.flush()
        with open(os.path.join(run, "all.log")) as f:
            text = f.read()
        check("ERROR: AddressSanitizer" not in text and "ERROR: LeakSanitizer" not in text
              and "runtime error:" not in text, "sanitizer reports in the worker or coordinator log")
        ok = True
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        log.close()
        if ok:
            shutil.rmtree(run, ignore_errors=True)
        else:
            with open(os.path.join(run, "all.log")) as f:
                sys.stderr.write(f.read()[-4000:])


def test_dockerfiles_build_real_targets():
    for name in ("Dockerfile", "Dockerfile.cuda"):
        with open(os.path.join(ROOT, "deploy", "docker", name)) as f:
            text = f.read()
        for target in re.findall(r"--target ([a-z0-9 -]+)", text)[0].split():
            check(os.path.exists(os.path.join(BIN, target)), "%s builds unknown target %s" % (name, target))


def test_images_pinned_and_context_trimmed():
    """Every base image is pinned by digest; .dockerignore keeps build trees, .git and node_modules out."""
    for name in ("Dockerfile", "Dockerfile.cuda"):
        with open(os.path.join(ROOT, "deploy", "docker", name)) as f:
            text = f.read()
        froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
        check(len(froms) >= 2, "%s: FROM lines %r" % (name, froms))
        for image in froms:
            check(re.fullmatch(r"[a-z0-9./_-]+:[A-Za-z0-9._-]+@sha256:[0-9a-f]{64}", image),
                  "%s: base image %s is not pinned by a digest" % (name, image))
        check("docker buildx imagetools inspect" in text, "%s does not say how to refresh its digests" % name)
        check("-mavx2 -mfma -mf16c" in text and "AVX2, FMA" in text, "%s: instruction-set floor not stated" % name)
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        ignored = set(l.strip() for l in f if l.strip() and not l.startswith("#"))
    for must in (".git", "build", "build-*", "tests/reference/node_modules"):
        check(must in ignored, ".dockerignore lacks %s" % must)


if __name__ == "__main__":
    run_tests([test_k8s_manifests_follow_the_schemas, test_k8s_schema_check_catches_mistakes,
               test_k8s_manifests_form_drain_and_fail_over, test_k8s_rules_catch_mistakes,
               test_worker_health_file_and_spare,
               test_dockerfiles_build_real_targets, test_images_pinned_and_context_trimmed])
