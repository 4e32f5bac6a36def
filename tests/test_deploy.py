"""deploy/ (kustomize) and the Dockerfile: render every kustomization with `kubectl kustomize`,
validate each object strictly against the Kubernetes OpenAPI schema, and check what a schema
cannot: selectors that select, ports that exist, container args that the real CLIs accept (after
the $(VAR) expansion the kubelet does from the rendered ConfigMap), a NetworkPolicy that lets
only the router reach the model services, non-root containers with requests and limits, a PDB
per Deployment, GPUs requested = limited, API keys and certificates only from Secrets mounted
read-only, mutual TLS wired end to end where it is on (cert-manager's objects, which no Kubernetes
schema covers, are checked field by field here). Needs kubectl (client only, no cluster)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from router.discovery import DnsDiscovery, KubernetesDiscovery, parse_spec

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBECTL = shutil.which("kubectl")
K8S_VERSION = "1.37"  # schema version for kubernetes-validate (strict)
NAMESPACE = "tandem"
IMAGE = "ghcr.io/tandem-serving/tandem:0.1.0"  # Dockerfile (CPU)
CUDA_IMAGE = "ghcr.io/tandem-serving/tandem:0.1.0-cuda12.6"  # Dockerfile.cuda
IMAGES = {"deploy": CUDA_IMAGE, "gpu": CUDA_IMAGE, "cert-manager": CUDA_IMAGE, "base": IMAGE, "cpu": IMAGE}
UID = 10001
COMPONENTS = ("router", "draft", "target")
MODULES = {"router": "router", "target_service": "target", "draft_service": "draft"}
SERVICE_PORTS = {"target": 50052, "draft": 50053}
ROUTER_PORTS = {"http": 8000, "grpc": 50051}
MIN_MODEL_LOAD_S = 600  # startup probes must allow at least this long for a model to load

KUSTOMIZATIONS = {"deploy": "deploy", "base": "deploy/base", "gpu": "deploy/overlays/gpu", "cpu": "deploy/overlays/cpu",
                  "cert-manager": "deploy/overlays/cert-manager"}
GPU_RENDERS = ("deploy", "gpu", "cert-manager")
CRD_GROUPS = ("cert-manager.io/",)  # custom resources: not in the Kubernetes schema (see test_cert_manager_objects)
HEALTH_PORT = 50060  # plaintext health-only port of a TLS service (kubelet probes cannot speak TLS)
EXTRA_MANIFESTS = ["deploy/tools/model-loader.yaml"]  # applied by hand (kubectl apply -f)
DASHBOARD_CONFIGMAP = "tandem-grafana-dashboard"  # deploy/grafana (tests/test_dashboard.py checks its content)

needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not on PATH: cannot render deploy/ with "
                                   "`kubectl kustomize` (install the kubectl client; no cluster is needed)")


# ---- rendering and lookups ------------------------------------------------------------------------
@functools.cache
def render(name: str) -> tuple[dict, ...]:
    proc = subprocess.run([KUBECTL, "kustomize", str(ROOT / KUSTOMIZATIONS[name])], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {KUSTOMIZATIONS[name]} failed:\n{proc.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def of_kind(objs, kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs, kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def component(obj: dict) -> str:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")


def deployments(objs) -> dict[str, dict]:
    return {component(d): d for d in of_kind(objs, "Deployment")}


def pod_spec(deploy: dict) -> dict:
    return deploy["spec"]["template"]["spec"]


def pod_labels(deploy: dict) -> dict:
    return deploy["spec"]["template"]["metadata"].get("labels", {})


def all_containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def main_container(deploy: dict) -> dict:
    (c,) = pod_spec(deploy)["containers"]
    return c


def selects(selector: dict | None, labels: dict) -> bool:
    """A LabelSelector (matchLabels/matchExpressions) or a Service's plain map, against labels."""
    if selector is None:
        return False
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def container_ports(deploy: dict) -> dict:
    """{name: number} and {number: number} for every declared containerPort of the pod."""
    ports = {}
    for c in pod_spec(deploy)["containers"]:
        for p in c.get("ports", []):
            ports[p["containerPort"]] = p["containerPort"]
            if "name" in p:
                ports[p["name"]] = p["containerPort"]
    return ports


_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity(q) -> float:
    m = _QUANTITY.match(str(q))
    assert m and m.group(2) in _SUFFIX, f"unparsable quantity {q!r}"
    return float(m.group(1)) * _SUFFIX[m.group(2)]


# ---- $(VAR) expansion and the real CLIs ----------------------------------------------------------
def container_env(container: dict, objs) -> dict[str, str]:
    """What the kubelet puts in the environment: envFrom first, env entries override."""
    configmaps = {c["metadata"]["name"]: c.get("data", {}) for c in of_kind(objs, "ConfigMap")}
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        assert "configMapRef" in src, f"{container['name']}: only configMapRef envFrom is expected, got {src}"
        name = src["configMapRef"]["name"]
        assert name in configmaps, f"{container['name']}: envFrom names ConfigMap {name!r}, not in the render"
        env.update({src.get("prefix", "") + k: v for k, v in configmaps[name].items()})
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["configMapKeyRef"]
            assert ref["name"] in configmaps, f"{e['name']}: ConfigMap {ref['name']!r} not in the render"
            assert ref["key"] in configmaps[ref["name"]], f"{e['name']}: key {ref['key']!r} not in {ref['name']}"
            env[e["name"]] = configmaps[ref["name"]][ref["key"]]
    return env


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' rule: $(VAR) -> value when VAR is defined, $$ -> $; anything else stays."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        assert m.group(1) in env, f"{arg!r}: $({m.group(1)}) is not defined in the container's environment"
        return env[m.group(1)]
    return _VAR.sub(sub, arg)


@functools.cache
def cli_parser(module: str) -> argparse.ArgumentParser:
    return importlib.import_module(f"{module}.__main__").build_parser()


def parse_container(container: dict, objs) -> tuple[str, argparse.Namespace]:
    """(module, parsed args) for a container that runs `python -m MODULE ARGS`."""
    command = container.get("command", [])
    assert command[:2] == ["python", "-m"] and len(command) == 3 and command[2] in MODULES, \
        f"{container['name']}: command {command} is not `python -m` one of {sorted(MODULES)}"
    module = command[2]
    env = container_env(container, objs)
    argv = [expand(a, env) for a in container.get("args", [])]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return module, cli_parser(module).parse_args(argv)
    except SystemExit:
        pass  # argparse printed why; report it below, outside the handler (no SystemExit traceback)
    pytest.fail(f"{container['name']}: `python -m {module}` rejects its args {argv}:\n{err.getvalue()}")


def parsed(objs) -> dict[str, argparse.Namespace]:
    out = {}
    for comp, d in deployments(objs).items():
        module, args = parse_container(main_container(d), objs)
        assert MODULES[module] == comp, f"Deployment {d['metadata']['name']} ({comp}) runs {module}"
        out[comp] = args
    return out


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(params=sorted(KUSTOMIZATIONS))
def rendered(request) -> tuple[str, tuple[dict, ...]]:
    if KUBECTL is None:
        pytest.skip("kubectl is not on PATH: cannot render deploy/ with `kubectl kustomize` "
                    "(install the kubectl client; no cluster is needed)")
    return request.param, render(request.param)


# ---- schema ---------------------------------------------------------------------------------------
@needs_kubectl
def test_every_object_validates_strictly_against_the_kubernetes_schema():
    import kubernetes_validate  # dev extra (pyproject.toml)

    objects = [(name, o) for name in KUSTOMIZATIONS for o in render(name)]
    for path in EXTRA_MANIFESTS:
        objects += [(path, o) for o in yaml.safe_load_all((ROOT / path).read_text()) if o]
    problems, seen = [], set()
    for source, obj in objects:
        key = json.dumps(obj, sort_keys=True)
        if key in seen or obj.get("apiVersion", "").startswith(CRD_GROUPS):  # validate each once; CRDs apart
            continue
        seen.add(key)
        where = f"{source}: {obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.append(f"{where}: {e.message}")
    assert not problems, "\n".join(problems)


@needs_kubectl
def test_deploy_root_is_the_gpu_overlay():
    assert render("deploy") == render("gpu")


def test_expected_objects(rendered):
    name, objs = rendered
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    expected = {("Namespace", NAMESPACE), ("ServiceAccount", "router"), ("Role", "router-endpointslice-reader"),
                ("RoleBinding", "router-endpointslice-reader")}
    for comp in COMPONENTS:
        expected |= {("Deployment", comp), ("Service", comp), ("PodDisruptionBudget", comp)}
    expected |= {("HorizontalPodAutoscaler", "router"), ("HorizontalPodAutoscaler", "target")}
    expected |= {("ConfigMap", DASHBOARD_CONFIGMAP)}
    assert expected <= kinds, f"missing: {sorted(expected - kinds)}"
    assert len(of_kind(objs, "ConfigMap")) == 2  # the settings (tandem-config-HASH) and the dashboard
    assert not of_kind(objs, "ClusterRole") and not of_kind(objs, "ClusterRoleBinding")
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == NAMESPACE, f"{o['kind']}/{o['metadata']['name']} namespace"


# ---- workloads -----------------------------------------------------------------------------------
def test_the_grafana_dashboard_is_a_configmap_the_sidecar_picks_up(rendered):
    _, objs = rendered
    cm = one(objs, "ConfigMap", DASHBOARD_CONFIGMAP)
    assert cm["metadata"]["labels"].get("grafana_dashboard") == "1", "the grafana sidecar's default label"
    assert json.loads(cm["data"]["tandem-dashboard.json"]) == json.loads(
        (DEPLOY / "grafana" / "tandem-dashboard.json").read_text())


def test_deployment_selectors_match_their_own_pods_only(rendered):
    _, objs = rendered
    deps = of_kind(objs, "Deployment")
    for d in deps:
        sel = d["spec"]["selector"]
        assert selects(sel, pod_labels(d)), f"Deployment {d['metadata']['name']}: selector misses its pods"
        for other in deps:
            if other is not d:
                assert not selects(sel, pod_labels(other)), \
                    f"Deployment {d['metadata']['name']} selector also selects {other['metadata']['name']}'s pods"


def test_services_select_pods_and_target_declared_ports(rendered):
    _, objs = rendered
    deps = of_kind(objs, "Deployment")
    for svc in of_kind(objs, "Service"):
        name = svc["metadata"]["name"]
        chosen = [d for d in deps if selects(svc["spec"].get("selector"), pod_labels(d))]
        assert chosen, f"Service {name} selects no pods"
        for d in chosen:
            ports = container_ports(d)
            for p in svc["spec"]["ports"]:
                target = p.get("targetPort", p["port"])
                assert target in ports, f"Service {name} port {p['port']}: targetPort {target!r} is not declared " \
                                        f"by Deployment {d['metadata']['name']} ({sorted(map(str, ports))})"
    for comp, port in SERVICE_PORTS.items():
        svc = one(objs, "Service", comp)
        assert svc["spec"].get("clusterIP") == "None", f"Service {comp} must be headless (clusterIP: None)"
        assert [p["port"] for p in svc["spec"]["ports"]] == [port]
        assert svc["spec"]["ports"][0]["name"] == "grpc"
    router = one(objs, "Service", "router")
    assert {p["name"]: p["port"] for p in router["spec"]["ports"]} == ROUTER_PORTS


def _budget(probe: dict) -> int:
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def test_probes(rendered):
    _, objs = rendered
    deps, args = deployments(objs), parsed(objs)
    for comp in SERVICE_PORTS:
        c, ports = main_container(deps[comp]), container_ports(deps[comp])
        # over TLS the kubelet (no TLS in grpc probes) asks the plaintext health-only port
        port = args[comp].health_port if args[comp].tls_cert else SERVICE_PORTS[comp]
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c.get(kind)
            assert probe and "grpc" in probe, f"{comp}: {kind} must be a native grpc probe (grpc.health.v1)"
            assert probe["grpc"]["port"] in ports, f"{comp}: {kind} port {probe['grpc']['port']} not declared"
            assert probe["grpc"]["port"] == port, f"{comp}: {kind} asks port {probe['grpc']['port']}, not {port}"
        assert _budget(c["startupProbe"]) >= MIN_MODEL_LOAD_S, f"{comp}: startupProbe too short to load a model"
    c, ports = main_container(deps["router"]), container_ports(deps["router"])
    for kind, path in (("startupProbe", "/health"), ("livenessProbe", "/health"), ("readinessProbe", "/ready")):
        probe = c.get(kind)
        assert probe and probe.get("httpGet", {}).get("path") == path, f"router: {kind} must GET {path}"
        assert probe["httpGet"]["port"] in ports and ports[probe["httpGet"]["port"]] == ROUTER_PORTS["http"]


def test_container_args_parse_with_the_real_clis(rendered):
    name, objs = rendered
    args = parsed(objs)
    deps = deployments(objs)
    services = of_kind(objs, "Service")
    from router.__main__ import config_from_args

    config_from_args(args["router"])  # RouterConfig's own checks (ValueError on a bad combination)

    def mounted(deploy: dict, path: str) -> bool:
        mounts = main_container(deploy).get("volumeMounts", [])
        return any(path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/") for m in mounts)

    for comp, port in SERVICE_PORTS.items():
        a = args[comp]
        assert a.host == "0.0.0.0", f"{comp}: --host must be 0.0.0.0 in a pod"
        assert a.port == port and port in container_ports(deps[comp]), f"{comp}: --port {a.port} is not its port"
        assert a.model == f"/models/{comp}" and mounted(deps[comp], a.model), f"{comp}: --model {a.model} unmounted"
        assert a.max_draft_tokens >= args["router"].num_speculative_tokens, f"{comp}: --max-draft-tokens < k"
        grace = pod_spec(deps[comp]).get("terminationGracePeriodSeconds", 30)
        assert grace >= a.grace_seconds + 5, f"{comp}: terminationGracePeriodSeconds {grace} leaves no room " \
                                             f"after --grace-seconds {a.grace_seconds}"
    assert args["draft"].sparse_top_n >= 1
    for comp, a in args.items():  # a cluster's log collector gets JSON lines naming each request
        assert a.log_format == "json" and not a.otlp_traces_endpoint, f"{comp}: JSON logs; tracing opt-in"

    r = args["router"]
    assert r.host == "0.0.0.0"
    from router.config import FLUSH_S

    pre_stop = int(main_container(deps["router"])["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = pod_spec(deps["router"]).get("terminationGracePeriodSeconds", 30)
    assert grace >= pre_stop + r.shutdown_timeout + FLUSH_S + 5, \
        f"router: terminationGracePeriodSeconds {grace} cuts the drain short (preStop {pre_stop} s, " \
        f"--shutdown-timeout {r.shutdown_timeout} s)"
    ports = container_ports(deps["router"])
    assert ports.get("http") == r.port == ROUTER_PORTS["http"]
    assert ports.get("grpc") == r.grpc_port == ROUTER_PORTS["grpc"]
    assert mounted(deps["router"], r.tokenizer), f"router: --tokenizer {r.tokenizer} is not on a mounted volume"
    assert r.tokenizer == args["target"].model, "router: --tokenizer should be the target's model directory"
    assert r.max_num_batched_tokens <= args["target"].max_batch_tokens, \
        "router: a step budget larger than the target's --max-batch-tokens"
    for comp, address in (("target", r.target), ("draft", r.draft)):
        discovery = parse_spec(address)  # the router's own parser: k8s:NS/SERVICE:PORT or dns:NAME:PORT
        if isinstance(discovery, KubernetesDiscovery):
            discovery.close()
            host, port = f"{discovery.service}.{discovery.namespace}.svc", discovery.port
        else:
            assert isinstance(discovery, DnsDiscovery), f"router: --{comp} {address} must be discovered, not static"
            host, port = discovery.name, discovery.port
        svc = [s for s in services if s["spec"].get("clusterIP") == "None"
               and host == f"{s['metadata']['name']}.{s['metadata']['namespace']}.svc"]
        assert svc, f"router: --{comp} {address} does not name a headless Service (NAME.{NAMESPACE}.svc)"
        assert selects(svc[0]["spec"]["selector"], pod_labels(deps[comp])), f"--{comp} names a Service of other pods"
        assert int(port) in [p["port"] for p in svc[0]["spec"]["ports"]], f"--{comp}: port {port} not on the Service"
    # The router waits --startup-wait for the target before it opens its ports: at least as long as
    # the target may take to load, and within the router's own startup probe.
    target_load = _budget(main_container(deps["target"])["startupProbe"])
    router_start = _budget(main_container(deps["router"])["startupProbe"])
    assert target_load <= r.startup_wait < router_start, (target_load, r.startup_wait, router_start)

    if name in GPU_RENDERS:
        for comp in SERVICE_PORTS:
            assert (args[comp].device, args[comp].dtype) == ("cuda", "bfloat16"), comp
    if name == "cpu":
        for comp in SERVICE_PORTS:
            assert args[comp].device == "cpu", comp


def test_security_resources_and_volumes(rendered):
    name, objs = rendered
    pods = [(f"Deployment/{d['metadata']['name']}", pod_spec(d)) for d in of_kind(objs, "Deployment")]
    for where, spec in pods:
        psc = spec.get("securityContext", {})
        assert psc.get("runAsNonRoot") is True and psc.get("runAsUser") == UID, f"{where}: pod must run as {UID}"
        assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{where}: seccomp RuntimeDefault"
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), f"{where}: host namespaces"
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            sources = [k for k in v if k != "name"]
            assert len(sources) == 1, f"{where}: volume {v['name']} has sources {sources}"
        for c in all_containers(spec):
            cw = f"{where} container {c['name']}"
            assert c.get("image") == IMAGES[name], f"{cw}: image {c.get('image')}"
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, f"{cw}: allowPrivilegeEscalation must be false"
            assert sc.get("readOnlyRootFilesystem") is True, f"{cw}: readOnlyRootFilesystem must be true"
            assert sc.get("capabilities", {}).get("drop") == ["ALL"] and not sc["capabilities"].get("add"), \
                f"{cw}: capabilities must drop ALL and add none"
            assert not sc.get("privileged"), f"{cw}: privileged"
            assert sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, f"{cw}: runAsNonRoot"
            assert sc.get("runAsUser", psc.get("runAsUser")) == UID, f"{cw}: runAsUser"
            res = c.get("resources", {})
            for key in ("cpu", "memory"):
                req, lim = res.get("requests", {}).get(key), res.get("limits", {}).get(key)
                assert req is not None and lim is not None, f"{cw}: needs requests and limits for {key}"
                assert quantity(req) <= quantity(lim), f"{cw}: {key} request {req} > limit {lim}"
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            for m in mounts.values():
                assert m["name"] in volumes, f"{cw}: mounts unknown volume {m['name']}"
            assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]["name"]], f"{cw}: /tmp must be an emptyDir"
            if "/models" in mounts:
                assert mounts["/models"].get("readOnly") is True, f"{cw}: /models must be mounted read-only"


def test_network_policy_only_router_reaches_the_model_services(rendered):
    _, objs = rendered
    deps = deployments(objs)
    policies = of_kind(objs, "NetworkPolicy")
    router_labels = pod_labels(deps["router"])
    for comp, port in SERVICE_PORTS.items():
        labels = pod_labels(deps[comp])
        mine = [p for p in policies if selects(p["spec"]["podSelector"], labels)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
        assert mine, f"no NetworkPolicy isolates {comp} pods for ingress"
        allowed_ports = set()
        for p in mine:
            for rule in p["spec"].get("ingress", []):
                peers = rule.get("from")
                assert peers, f"NetworkPolicy {p['metadata']['name']}: a rule without `from` opens {comp} to all"
                for peer in peers:
                    assert set(peer) == {"podSelector"}, \
                        f"NetworkPolicy {p['metadata']['name']}: {comp} peers must be router pods only, got {peer}"
                    assert selects(peer["podSelector"], router_labels)
                    for other, d in deps.items():
                        if other != "router":
                            assert not selects(peer["podSelector"], pod_labels(d)), \
                                f"NetworkPolicy {p['metadata']['name']} lets {other} pods reach {comp}"
                allowed_ports |= {q.get("port") for q in rule.get("ports", [{}])}
        assert port in allowed_ports or "grpc" in allowed_ports, f"{comp}: the router may not reach port {port}"
    mine = [p for p in policies if selects(p["spec"]["podSelector"], router_labels)]
    open_ports = {q.get("port") for p in mine for rule in p["spec"].get("ingress", []) if not rule.get("from")
                  for q in rule.get("ports", [])}
    assert set(ROUTER_PORTS.values()) <= open_ports, f"router ingress must be open on {ROUTER_PORTS}: {open_ports}"


def test_every_deployment_has_a_pdb(rendered):
    _, objs = rendered
    deps = of_kind(objs, "Deployment")
    for d in deps:
        pdbs = [p for p in of_kind(objs, "PodDisruptionBudget") if selects(p["spec"]["selector"], pod_labels(d))]
        assert len(pdbs) == 1, f"Deployment {d['metadata']['name']}: {len(pdbs)} PodDisruptionBudgets select it"
        for other in deps:
            if other is not d:
                assert not selects(pdbs[0]["spec"]["selector"], pod_labels(other))


def test_autoscalers(rendered):
    name, objs = rendered
    deps = deployments(objs)
    for comp in ("router", "target"):
        hpa = one(objs, "HorizontalPodAutoscaler", comp)
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) == ("Deployment", deps[comp]["metadata"]["name"])
        assert 1 <= hpa["spec"].get("minReplicas", 1) <= hpa["spec"]["maxReplicas"]
        assert "replicas" not in deps[comp]["spec"], f"Deployment {comp}: `replicas` fights its HPA on every apply"
    router_hpa = one(objs, "HorizontalPodAutoscaler", "router")["spec"]
    assert router_hpa["minReplicas"] >= 2, "no single front door: routers share replicas through their leases"
    router_args = parse_container(main_container(deps["router"]), objs)[1]
    assert router_args.lease_ttl >= 3, "a lease renewed every third of it must survive a GC pause"
    router_metrics = router_hpa["metrics"]
    assert [(m["type"], m["resource"]["name"]) for m in router_metrics] == [("Resource", "cpu")]
    (metric,) = one(objs, "HorizontalPodAutoscaler", "target")["spec"]["metrics"]
    if name == "cpu":
        assert (metric["type"], metric["resource"]["name"]) == ("Resource", "cpu")
    else:
        assert metric["type"] == "Object" and metric["object"]["metric"]["name"] == "tandem_num_requests_waiting"
        described = metric["object"]["describedObject"]
        one(objs, described["kind"], described["name"])


def test_router_rbac_is_least_privilege(rendered):
    _, objs = rendered
    router = deployments(objs)["router"]
    sa = pod_spec(router).get("serviceAccountName")
    assert sa == "router"
    role = one(objs, "Role", "router-endpointslice-reader")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = one(objs, "RoleBinding", "router-endpointslice-reader")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "router-endpointslice-reader"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    for comp in SERVICE_PORTS:
        spec = pod_spec(deployments(objs)[comp])
        assert spec.get("serviceAccountName") != sa and spec.get("automountServiceAccountToken") is False, \
            f"{comp}: needs no API access and no token"


def test_overlay_specifics(rendered):
    name, objs = rendered
    deps = deployments(objs)
    gpu = name in GPU_RENDERS
    for comp, d in deps.items():
        spec, c = pod_spec(d), main_container(d)
        models = next(v for v in spec["volumes"] if v["name"] == "models")
        res = c["resources"]
        gpus = (res.get("requests", {}).get("nvidia.com/gpu"), res.get("limits", {}).get("nvidia.com/gpu"))
        if gpu:
            assert models.get("persistentVolumeClaim", {}).get("claimName") == "tandem-models", comp
        elif name == "cpu":
            assert models.get("hostPath", {}).get("path"), f"{comp}: the cpu overlay reads models from a hostPath"
        if gpu and comp in SERVICE_PORTS:
            assert gpus[0] is not None and gpus[0] == gpus[1] and int(gpus[0]) >= 1, \
                f"{comp}: nvidia.com/gpu requests {gpus[0]} must equal limits {gpus[1]}"
            assert spec.get("nodeSelector"), f"{comp}: GPU pods need a nodeSelector"
            assert any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", [])), comp
            shm = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
            vol = next(v for v in spec["volumes"] if shm and v["name"] == shm[0]["name"])
            assert vol["emptyDir"].get("medium") == "Memory", f"{comp}: /dev/shm must be a memory emptyDir"
        else:
            assert gpus == (None, None), f"{name}: {comp} must not request GPUs"
    if gpu:
        pvc = one(objs, "PersistentVolumeClaim", "tandem-models")
        assert pvc["spec"]["accessModes"]


# ---- keys and certificates ------------------------------------------------------------------------
def secret_mounts(deploy: dict) -> dict[str, tuple[str, bool]]:
    """{mountPath: (Secret name, read-only)} of the main container's Secret volumes."""
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod_spec(deploy).get("volumes", []) if "secret" in v}
    return {m["mountPath"]: (secrets[m["name"]], m.get("readOnly", False))
            for m in main_container(deploy).get("volumeMounts", []) if m["name"] in secrets}


def from_secret(deploy: dict, path) -> str | None:  # noqa: ANN001
    """The Secret a file comes from, if it lies under a read-only Secret mount."""
    for mount, (secret, read_only) in secret_mounts(deploy).items():
        if str(path).startswith(mount.rstrip("/") + "/"):
            assert read_only, f"Secret {secret} must be mounted read-only"
            return secret
    return None


TLS_FLAGS = ("tls_cert", "tls_key", "tls_ca", "public_tls_cert", "public_tls_key", "public_tls_ca")


def test_keys_and_certificates_come_only_from_secrets_mounted_read_only(rendered):
    _, objs = rendered
    assert not of_kind(objs, "Secret"), "no Secret in git: keys and certificates are made in the cluster"
    for cm in of_kind(objs, "ConfigMap"):
        for key, value in cm.get("data", {}).items():
            secret_like = re.search(r"(API_KEY|TLS|CERT|PRIVATE|PASSWORD|SECRET|TOKEN)(_|$)", key)
            assert not secret_like, f"ConfigMap holds {key}"
            assert "-----BEGIN" not in value, f"ConfigMap {key} holds PEM"
    deps, args = deployments(objs), parsed(objs)
    r = args["router"]
    assert not r.api_key, "--api-key puts the key in the pod spec: use --api-key-file"
    assert from_secret(deps["router"], r.api_key_file) == "tandem-api-keys", "the router must require API keys"
    for comp, a in args.items():
        assert not any(e["name"] == "TANDEM_API_KEY" and "value" in e for e in main_container(deps[comp]).get(
            "env", [])), f"{comp}: a literal API key"
        for flag in TLS_FLAGS:
            path = getattr(a, flag, None)
            if path is not None:
                assert from_secret(deps[comp], path), f"{comp}: --{flag.replace('_', '-')} {path} is not from a Secret"


def test_mutual_tls_is_all_or_nothing_and_wired_end_to_end(rendered):
    name, objs = rendered
    args, policies = parsed(objs), of_kind(objs, "NetworkPolicy")
    on = {comp: a.tls_cert is not None for comp, a in args.items()}
    assert len(set(on.values())) == 1, f"mutual TLS must be on for all three or for none: {on}"
    assert all(on.values()) == (name == "cert-manager")
    if not all(on.values()):
        return
    r = args["router"]
    assert r.tls_ca is not None, "router: --tls-ca, or any certificate would do"
    for comp, port in SERVICE_PORTS.items():
        a = args[comp]
        assert a.tls_key is not None and a.tls_ca is not None, f"{comp}: --tls-ca makes client certificates required"
        assert getattr(r, f"{comp}_tls_server_name") == f"{comp}.{NAMESPACE}.svc", \
            f"router: --{comp}-tls-server-name must name the headless Service (its addresses are pod IPs)"
        assert a.health_port and a.health_port != port
        for pol in policies:
            if selects(pol["spec"]["podSelector"], pod_labels(deployments(objs)[comp])):
                allowed = {q.get("port") for rule in pol["spec"].get("ingress", []) for q in rule.get("ports", [])}
                assert a.health_port not in allowed, f"{comp}: the plaintext health port is open to pods"


CERTIFICATE_FIELDS = {"secretName", "commonName", "dnsNames", "ipAddresses", "uris", "emailAddresses", "duration",
                      "renewBefore", "usages", "privateKey", "issuerRef", "isCA", "subject", "secretTemplate"}
PRIVATE_KEY_FIELDS = {"algorithm", "size", "encoding", "rotationPolicy"}
USAGES = {"digital signature", "key encipherment", "server auth", "client auth", "cert sign", "crl sign"}


def test_cert_manager_objects(rendered):
    """What a CRD schema would check (cert-manager.io/v1 fields and enums), and that they fit the
    Deployments: each pod's Secret is a Certificate's, for the names and usages it needs."""
    name, objs = rendered
    certificates = {c["metadata"]["name"]: c for c in of_kind(objs, "Certificate")}
    issuers = {i["metadata"]["name"]: i for i in of_kind(objs, "Issuer")}
    if name != "cert-manager":
        assert not certificates and not issuers
        return
    assert not of_kind(objs, "ClusterIssuer"), "Tandem's CA is its own, in its namespace"
    by_secret = {}
    for cname, c in certificates.items():
        spec = c["spec"]
        assert c["apiVersion"] == "cert-manager.io/v1" and set(spec) <= CERTIFICATE_FIELDS, (cname, set(spec))
        assert set(spec.get("privateKey", {})) <= PRIVATE_KEY_FIELDS and set(spec.get("usages", [])) <= USAGES
        ref = spec["issuerRef"]
        assert ref.get("kind") == "Issuer" and ref["name"] in issuers, f"{cname}: issuer {ref}"
        by_secret[spec["secretName"]] = c
    for iname, issuer in issuers.items():
        (kind,) = issuer["spec"]
        assert kind in ("selfSigned", "ca"), iname
        if kind == "ca":  # signs with a CA certificate that cert-manager makes
            root = by_secret[issuer["spec"]["ca"]["secretName"]]["spec"]
            assert root.get("isCA") is True and "selfSigned" in issuers[root["issuerRef"]["name"]]["spec"]
    args = parsed(objs)
    for comp, deploy in deployments(objs).items():
        secret = from_secret(deploy, args[comp].tls_cert)
        assert secret in by_secret, f"{comp}: Secret {secret} is no Certificate's"
        spec = by_secret[secret]["spec"]
        assert "isCA" not in spec and issuers[spec["issuerRef"]["name"]]["spec"].get("ca"), f"{comp}: signed by the CA"
        assert from_secret(deploy, args[comp].tls_ca) == secret, f"{comp}: ca.crt from the same Secret"
        if comp == "router":
            assert "client auth" in spec["usages"]
        else:
            assert "server auth" in spec["usages"]
            assert getattr(args["router"], f"{comp}_tls_server_name") in spec["dnsNames"]


# ---- the image -------------------------------------------------------------------------------------
def _stages(dockerfile: str = "Dockerfile") -> list[list[str]]:
    """Dockerfile instructions (continuations joined, comments dropped), split by FROM."""
    text = (ROOT / dockerfile).read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    instructions = [i.strip() for i in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines() if i.strip()]
    stages: list[list[str]] = []
    for ins in instructions:
        if ins.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(ins)
    return stages


def test_dockerfile_is_multi_stage_non_root_and_builds_from_pyproject():
    stages = _stages()
    assert len(stages) >= 2, "builder and runtime stages"
    builder, runtime = "\n".join(stages[0]), stages[-1]
    assert "pyproject.toml" in builder and "tomllib" in builder, "dependencies must come from pyproject.toml"
    assert "download.pytorch.org/whl/cpu" in builder, "torch defaults to the CPU build"
    make_proto = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if "grpc_tools.protoc" in ln)
    flags = [f for f in make_proto.split() if f.startswith("-")]
    protoc = next(ins for ins in stages[0] if "grpc_tools.protoc" in ins)
    assert all(f in protoc.split() for f in flags), f"protoc flags differ from `make proto`: {flags}"
    users = [ins.split()[1] for ins in runtime if ins.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] == str(UID), "runtime stage must end as USER 10001 (numeric)"
    copied = " ".join(ins for ins in runtime if ins.upper().startswith("COPY "))
    assert "/opt/venv" in copied
    for module in [*MODULES, "common"]:
        assert f"/app/{module}" in copied, f"runtime stage lacks {module}"


def test_cuda_dockerfile_pins_torch_flash_attn_and_base_to_one_cuda():
    """Dockerfile.cuda: multi-stage, non-root, dependencies from pyproject.toml, and the CUDA version
    of the torch index, the flash-attn wheel and the runtime base image agree (12.6), with a wheel
    built for this torch (2.13) and this Python (cp311)."""
    stages = _stages("Dockerfile.cuda")
    assert len(stages) >= 2
    builder, runtime = "\n".join(stages[0]), stages[-1]
    assert "pyproject.toml" in builder and "tomllib" in builder
    torch_pin = re.search(r'"torch==([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    text = (ROOT / "Dockerfile.cuda").read_text()
    index = re.search(r"TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cu(\d+)", text).group(1)
    wheel = re.search(r"FLASH_ATTN_WHEEL=(\S+)", text).group(1)
    base = re.search(r"CUDA_IMAGE=nvidia/cuda:(\d+)\.(\d+)\.\d+-runtime-", text)
    m = re.search(r"/flash_attn-([0-9.]+)\+cu(\d+)torch(\d+\.\d+)-cp311-cp311-linux_x86_64\.whl$", wheel)
    assert m and wheel.startswith("https://") and "/releases/download/" in wheel, f"not a pinned release wheel: {wheel}"
    assert m.group(2) == index == base.group(1) + base.group(2), (m.group(2), index, base.groups())
    assert torch_pin.startswith(m.group(3) + "."), f"flash-attn built for torch {m.group(3)}, pinned {torch_pin}"
    assert runtime[0].split()[1] == "${CUDA_IMAGE}", "the runtime stage runs on the CUDA base"
    users = [ins.split()[1] for ins in runtime if ins.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] == str(UID)
    copied = " ".join(ins for ins in runtime if ins.upper().startswith("COPY "))
    for module in [*MODULES, "common", "/opt/venv", "/opt/python"]:
        assert module in copied, f"runtime stage lacks {module}"


def test_dockerfile_copies_exist_and_are_not_dockerignored():
    ignored = {ln.strip().strip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    assert {".venv", "models", ".git"} <= ignored
    for stage in _stages() + _stages("Dockerfile.cuda"):
        for ins in stage:
            words = ins.split()
            if words[0].upper() != "COPY" or any(w.startswith("--from") for w in words):
                continue
            for src in [w for w in words[1:-1] if not w.startswith("--")]:
                assert (ROOT / src).exists(), f"Dockerfile copies {src}, which is not in the repository"
                assert src.strip("/").split("/")[0] not in ignored, f".dockerignore excludes {src}"
