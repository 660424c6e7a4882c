"""The Helm chart (helm/kvflow), the Dockerfile and .dockerignore.

The chart is rendered and linted by Helm's own Go SDK (``helm-python-sdk``
ships it as a shared library: no helm binary, no hand-written template engine).
Every rendered manifest is validated against the Kubernetes 1.30 OpenAPI schemas
with ``kubernetes-validate``; then the parts operators rely on are asserted.
Value sets: the defaults plus tests/helm_values/*.yaml.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvflow"
VALUES_DIR = Path(__file__).resolve().parents[1] / "helm_values"
RELEASE = "kv"
NAMESPACE = "serving"
FULLNAME = "kv-kvflow"
KUBE_VERSION = "1.30.0"
# Custom resources have no schema in kubernetes-validate; they are checked by hand below.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

VALUE_SETS: dict[str, dict[str, Any]] = {"default": {}}
for _path in sorted(VALUES_DIR.glob("*.yaml")):
    VALUE_SETS[_path.stem] = yaml.safe_load(_path.read_text())
EXPECTED_SETS = {"default", "cpu-demo", "external-redis", "scaled-out"}

Manifest = dict[str, Any]


class Rendered:
    """The manifests of one render, indexed by kind and name."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self.docs: list[Manifest] = []
        for path, text in files.items():
            if path.endswith(".yaml"):
                self.docs.extend(d for d in yaml.safe_load_all(text) if d)

    def all(self, kind: str) -> list[Manifest]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> Manifest:
        found = [d for d in self.all(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def has(self, kind: str, name: str) -> bool:
        return any(d["metadata"]["name"] == name for d in self.all(kind))

    def pod(self, component: str) -> Manifest:
        return self.get("Deployment", f"{FULLNAME}-{component}")["spec"]["template"]

    def container(self, component: str) -> Manifest:
        containers = self.pod(component)["spec"]["containers"]
        assert len(containers) == 1
        return containers[0]


@pytest.fixture(scope="module")
def chart() -> Any:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


_CACHE: dict[str, Rendered] = {}


def render(chart: Any, values: dict[str, Any]) -> Rendered:
    return Rendered(chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True))


@pytest.fixture(params=sorted(VALUE_SETS))
def value_set(request: pytest.FixtureRequest, chart: Any) -> tuple[str, Rendered]:
    name = request.param
    if name not in _CACHE:
        _CACHE[name] = render(chart, VALUE_SETS[name])
    return name, _CACHE[name]


def rendered_set(chart: Any, name: str) -> Rendered:
    if name not in _CACHE:
        _CACHE[name] = render(chart, VALUE_SETS[name])
    return _CACHE[name]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- Helm itself --------------------------------------------------------------------------------


def test_value_sets_present() -> None:
    assert set(VALUE_SETS) >= EXPECTED_SETS


def test_chart_metadata(chart: Any) -> None:
    assert chart.metadata["apiVersion"] == "v2"
    assert chart.name == "kvflow"
    assert chart.schema is not None, "values.schema.json must ship with the chart"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_strict(name: str) -> None:
    report = helm.lint(CHART, VALUE_SETS[name], strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == [], problems


def test_every_manifest_validates_against_kubernetes_1_30(value_set: tuple[str, Rendered]) -> None:
    _, r = value_set
    assert r.docs
    for doc in r.docs:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE


def test_validator_is_not_a_no_op(chart: Any) -> None:
    deployment = json.loads(
        json.dumps(rendered_set(chart, "default").get("Deployment", f"{FULLNAME}-router"))
    )
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = [1]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


def test_resource_inventory(chart: Any) -> None:
    default = Counter(d["kind"] for d in rendered_set(chart, "default").docs)
    assert default == Counter(
        {
            "Deployment": 4,  # router, prefill, decode, redis
            "Service": 4,  # router, 2 headless, redis
            "PodDisruptionBudget": 3,
            "NetworkPolicy": 4,
            "ServiceAccount": 2,
            "Role": 1,
            "RoleBinding": 1,
            "ConfigMap": 2,  # engine args, dashboard
            "Secret": 2,  # redis password, cluster token
            "PersistentVolumeClaim": 1,
        }
    )
    scaled = Counter(d["kind"] for d in rendered_set(chart, "scaled-out").docs)
    assert scaled["HorizontalPodAutoscaler"] == 1 and scaled["ServiceMonitor"] == 1
    assert scaled["Secret"] == 3  # redis password + cluster token + router API key
    external = rendered_set(chart, "external-redis")
    assert not external.has("Deployment", f"{FULLNAME}-redis")
    assert not external.has("Secret", f"{FULLNAME}-redis")
    assert not external.has("NetworkPolicy", f"{FULLNAME}-redis")
    assert not external.has("PersistentVolumeClaim", f"{FULLNAME}-models")
    for r in (rendered_set(chart, n) for n in VALUE_SETS):
        assert not r.all("ClusterRole") and not r.all("ClusterRoleBinding")


# --- values.schema.json -------------------------------------------------------------------------

BAD_VALUES = [
    {"prefill": {"replicaCount": "3"}},
    {"decode": {"gpusPerPod": 1.5}},
    {"gpu": {"enabled": "yes"}},
    {"engineArgs": {"max-model-len": [4096]}},
    {"engineArgs": {"--max-model-len": 4096}},
    {"engineArgs": {"dtype": "auto\n--evil"}},
    {"redis": {"mode": "sentinel"}},
    {"redis": {"bundled": {"image": "redis:latest"}}},
    {"router": {"routing": "fastest"}},
    {"router": {"httpPort": 70000}},
    {"router": {"autoscaling": {"enabled": "true"}}},
    {"model": {"volume": {"type": "hostPath"}}},
    {"prefill": {"tolerations": {"key": "x"}}},
    {"prefill": {"nodeSelector": {"gpu": True}}},
    {"serviceMonitor": {"interval": 15}},
    {"clusterAuth": {"existingSecretKey": "a b"}},
    {"clusterAuth": {"token": "inline"}},
    {"router": {"metricsRequireApiKey": "yes"}},
    {"replicas": 3},
]


@pytest.mark.parametrize("bad", BAD_VALUES, ids=lambda b: json.dumps(b)[:60])
def test_schema_rejects_wrong_types(chart: Any, bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.render(bad, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"redis": {"mode": "external"}}, "redis.external.url"),
        ({"model": {"volume": {"type": "existingClaim"}}}, "existingClaim"),
        ({"engineArgs": {"tensor-parallel-size": 4}}, "tensor-parallel-size 4 needs gpusPerPod >= 4"),
        ({"router": {"metricsRequireApiKey": True}}, "router.metricsRequireApiKey needs router.apiKey"),
    ],
)
def test_template_guards(chart: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_tensor_parallel_prefill_and_role_free_workers_render(chart: Any, tmp_path: Path) -> None:
    """KV moves rank to rank (docs/cluster.md): prefill and role-free workers may be tensor-parallel too."""
    static = render(chart, {"prefill": {"engineArgs": {"tensor-parallel-size": 2}, "gpusPerPod": 2}})
    assert flag_value(worker_argv(static, "prefill", tmp_path), "--tensor-parallel-size") == "2"
    adaptive = render(chart, {"layout": "adaptive", "engineArgs": {"tensor-parallel-size": 2},
                              "workers": {"gpusPerPod": 2}})
    assert flag_value(worker_argv(adaptive, "worker", tmp_path), "--tensor-parallel-size") == "2"


def test_values_yaml_fully_commented() -> None:
    """Every key carries a comment unless its parent is documented as a data blob ("# --")."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, bool]] = []  # (indent, children are data)
    comments: list[str] = []  # the comment block right above the current line
    missing = []
    checked = 0
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("#"):
            comments.append(stripped)
            continue
        key = re.match(r"^(\s*)([A-Za-z0-9_.-]+):", line)
        if key:
            indent = len(key.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            in_data = any(data for _, data in stack)
            checked += not in_data
            if not in_data and not comments:
                missing.append(f"{number}: {stripped}")
            stack.append((indent, in_data or (bool(comments) and comments[0].startswith("# --"))))
        comments = []
    assert checked > 100 and missing == []


# --- workers: command line, probes, resources, placement -----------------------------------------


def expand_k8s_vars(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion (what the kubelet does to env values, command and args)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def resolve_env(r: Rendered, container: Manifest) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand_k8s_vars(item["value"], env)
            continue
        source = item["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            if r.has("Secret", ref["name"]):
                data = r.get("Secret", ref["name"])["data"][ref["key"]]
                env[item["name"]] = base64.b64decode(data).decode()
            else:  # a Secret the operator provides
                env[item["name"]] = f"secret-{ref['name']}-{ref['key']}"
        elif "fieldRef" in source:
            env[item["name"]] = "10.1.2.3"
        else:
            raise AssertionError(f"unexpected env source {source}")
    return env


def worker_argv(r: Rendered, component: str, tmp_path: Path) -> list[str]:
    """Run the worker container's real command (/bin/sh wrapper) with a stub `kvflow` that
    prints its argv, the engine-args ConfigMap written where the pod would mount it."""
    container = r.container(component)
    pod_spec = r.pod(component)["spec"]
    assert container["command"] == ["/bin/sh", "-ec"]
    (script,) = container["args"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "engine-args")
    volume = next(v for v in pod_spec["volumes"] if v["name"] == "engine-args")
    cm = r.get("ConfigMap", volume["configMap"]["name"])
    assert mount["mountPath"] in script
    args_dir = tmp_path / component / "engine"
    args_dir.mkdir(parents=True)
    for key, data in cm["data"].items():
        (args_dir / key).write_text(data)
    bindir = tmp_path / component / "bin"
    bindir.mkdir()
    stub = bindir / "kvflow"
    stub.write_text(
        f"#!/bin/sh\nexec '{sys.executable}' -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n"
    )
    stub.chmod(0o755)
    env = resolve_env(r, container) | {"PATH": f"{bindir}:/usr/bin:/bin"}
    local_script = script.replace(mount["mountPath"], str(args_dir))
    out = subprocess.run(
        [*container["command"], local_script], env=env, capture_output=True, text=True, timeout=30, check=True
    )
    return json.loads(out.stdout)


def flag_value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def test_engine_args_reach_worker_command_line(value_set: tuple[str, Rendered], tmp_path: Path) -> None:
    name, r = value_set
    values = VALUE_SETS[name]
    for component, port in (("prefill", "50061"), ("decode", "50071")):
        argv = worker_argv(r, component, tmp_path)
        assert argv[0] == component
        assert flag_value(argv, "--model") == values.get("model", {}).get("name", "smollm2")
        assert flag_value(argv, "--host") == "0.0.0.0"
        assert flag_value(argv, "--port") == port
        assert flag_value(argv, "--metrics-port") == "9100"
        # Decode workers dial the pod IP for the KV link's rendezvous; the backend comes from kvTransfer.
        assert flag_value(argv, "--advertise-address") == f"10.1.2.3:{port}"
        assert flag_value(argv, "--kv-transfer-backend") == values.get("kvTransfer", {}).get("backend", "auto")
        index = flag_value(argv, "--index")
        assert index.startswith(("redis://", "rediss://")) and "$(" not in index
        # Shared engine args, overridden per role, reach the command line.
        expected = {
            "--max-model-len": "4096",
            "--block-size": "16",
            "--dtype": "auto",
            "--max-num-seqs": "256",
        }
        if name == "cpu-demo":
            expected |= {"--dtype": "float32", "--max-model-len": "2048", "--max-num-seqs": "16"}
            expected |= {"--kv-cache-memory-bytes": "1073741824"}
            assert "--enforce-eager" in argv
            assert "--gpu-memory-utilization" not in argv  # null drops a default flag
        else:
            expected["--gpu-memory-utilization"] = "0.9"
        if name == "scaled-out":
            expected |= {"--max-model-len": "32768", "--load-format": "safetensors"}
            if component == "decode":
                expected["--tensor-parallel-size"] = "2"
            else:
                assert "--tensor-parallel-size" not in argv
        for flag, value in expected.items():
            assert flag_value(argv, flag) == value, (component, flag)
        if name == "scaled-out" and component == "decode":
            assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
            assert flag_value(argv, "--kv-cache-dtype") == "fp8"
            assert flag_value(argv, "--kv-cache-memory-bytes") == "8589934592"  # not 8.589934592e+09
            assert flag_value(argv, "--swap-space") == "4"
            assert "--enable-chunked-prefill" not in argv
        elif name == "scaled-out":
            assert "--enable-chunked-prefill" in argv and "--enable-prefix-caching" in argv
            assert flag_value(argv, "--max-num-batched-tokens") == "16384"
        else:
            assert "--enable-prefix-caching" in argv
        min_tokens = values.get("decode", {}).get("disaggMinPromptTokens")
        if component == "decode" and min_tokens is not None:
            assert flag_value(argv, "--disagg-min-prompt-tokens") == str(min_tokens)
        else:
            assert "--disagg-min-prompt-tokens" not in argv


def test_index_url_and_password_wiring(chart: Any, tmp_path: Path) -> None:
    default = rendered_set(chart, "default")
    password = base64.b64decode(default.get("Secret", f"{FULLNAME}-redis")["data"]["redis-password"]).decode()
    assert len(password) == 32
    argv = worker_argv(default, "prefill", tmp_path)
    assert flag_value(argv, "--index") == f"redis://:{password}@{FULLNAME}-redis:6379/0"
    for component in ("router", "prefill", "decode"):
        names = [e["name"] for e in default.container(component)["env"]]
        # $(KVFLOW_REDIS_PASSWORD) only expands when defined earlier in the list.
        assert names.index("KVFLOW_REDIS_PASSWORD") < names.index("KVFLOW_INDEX_URL")
        assert password not in json.dumps(default.pod(component))
    redis = default.container("redis")
    assert redis["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert redis["env"][0]["valueFrom"]["secretKeyRef"]["name"] == f"{FULLNAME}-redis"
    external = rendered_set(chart, "external-redis")
    argv = worker_argv(external, "decode", tmp_path / "ext")
    assert (
        flag_value(argv, "--index")
        == "rediss://:secret-managed-redis-password@redis.cache.svc.cluster.local:6380/2"
    )
    none = render(chart, {"redis": {"mode": "none"}})
    assert "--index" not in worker_argv(none, "prefill", tmp_path / "none")
    assert [s["metadata"]["name"] for s in none.all("Secret")] == [f"{FULLNAME}-cluster-token"]
    router_args = none.container("router")["args"]
    assert resolve_env(none, none.container("router"))["KVFLOW_INDEX_URL"] == "memory"
    assert router_args[router_args.index("--index") + 1] == "$(KVFLOW_INDEX_URL)"


def test_cluster_token_reaches_router_and_workers_from_a_secret(chart: Any, tmp_path: Path) -> None:
    """The token every worker RPC needs: generated into a Secret (or the operator's), env only, never in argv."""
    default = rendered_set(chart, "default")
    secret = default.get("Secret", f"{FULLNAME}-cluster-token")
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) >= 32 and token.isalnum()
    assert token != base64.b64decode(render(chart, {}).get("Secret", f"{FULLNAME}-cluster-token")["data"]["token"])
    for component in ("router", "prefill", "decode"):
        env = {e["name"]: e for e in default.container(component)["env"]}
        assert env["KVFLOW_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": f"{FULLNAME}-cluster-token", "key": "token"}
        assert resolve_env(default, default.container(component))["KVFLOW_CLUSTER_TOKEN"] == token
        assert token not in json.dumps(default.pod(component))
        argv = default.container(component)["args"] if component == "router" else \
            worker_argv(default, component, tmp_path / component)
        assert not any("token" in a for a in argv), argv
    own = render(chart, {"clusterAuth": {"existingSecret": "mine", "existingSecretKey": "k"}})
    assert not own.has("Secret", f"{FULLNAME}-cluster-token")
    for component in ("router", "prefill", "decode"):
        env = {e["name"]: e for e in own.container(component)["env"]}
        assert env["KVFLOW_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "mine", "key": "k"}


def test_decode_workers_allow_only_the_prefill_service(value_set: tuple[str, Rendered], tmp_path: Path) -> None:
    """Decode workers send their token only to prefill workers: the prefill headless Service's name resolves to its
    ready pods' IPs, which is what discovery hands the router."""
    _, r = value_set
    allowlist = flag_value(worker_argv(r, "decode", tmp_path / "decode"), "--prefill-allowlist")
    host, port = allowlist.rsplit(":", 1)
    svc = r.get("Service", host)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"].get("publishNotReadyAddresses") is not True
    assert matches(svc["spec"]["selector"], r.pod("prefill")["metadata"]["labels"])
    assert int(port) == next(p["containerPort"] for p in r.container("prefill")["ports"] if p["name"] == "grpc")
    assert "--prefill-allowlist" not in worker_argv(r, "prefill", tmp_path / "prefill")


def test_metrics_behind_the_api_key(chart: Any) -> None:
    r = render(chart, {"router": {"apiKey": {"value": "s3cr3t-key"}, "metricsRequireApiKey": True},
                       "serviceMonitor": {"enabled": True}})
    assert "--metrics-require-api-key" in r.container("router")["args"]
    (sm,) = r.all("ServiceMonitor")
    http = next(e for e in sm["spec"]["endpoints"] if e["port"] == "http")
    assert http["authorization"] == {"type": "Bearer", "credentials": {"name": f"{FULLNAME}-router-api-key",
                                                                      "key": "api-key"}}
    assert r.has("Secret", f"{FULLNAME}-router-api-key")
    assert all("authorization" not in e for e in sm["spec"]["endpoints"] if e["port"] != "http")
    default = rendered_set(chart, "scaled-out")
    assert "--metrics-require-api-key" not in default.container("router")["args"]
    assert all("authorization" not in e for e in default.all("ServiceMonitor")[0]["spec"]["endpoints"])


def test_engine_args_configmap_change_rolls_workers(chart: Any) -> None:
    def checksum(values: dict[str, Any]) -> str:
        return render(chart, values).pod("prefill")["metadata"]["annotations"]["checksum/engine-args"]

    assert checksum({}) == checksum({})
    assert checksum({}) != checksum({"engineArgs": {"max-model-len": 8192}})


def test_worker_probes_use_grpc_health(value_set: tuple[str, Rendered]) -> None:
    _, r = value_set
    for component in ("prefill", "decode"):
        c = r.container(component)
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": grpc_port}, (component, probe)
        # Unready workers must leave routing fast: readiness notices within ~5 s.
        ready = c["readinessProbe"]
        assert ready["periodSeconds"] * ready["failureThreshold"] <= 5
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300


def test_router_probes_and_ports(value_set: tuple[str, Rendered]) -> None:
    _, r = value_set
    c = r.container("router")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 50051}
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    svc = r.get("Service", f"{FULLNAME}-router")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        "http": (8000, "http"),
        "grpc": (50051, "grpc"),
    }
    assert matches(svc["spec"]["selector"], r.pod("router")["metadata"]["labels"])


def test_router_runs_kubernetes_discovery(value_set: tuple[str, Rendered]) -> None:
    name, r = value_set
    c = r.container("router")
    assert c["command"] == ["kvflow"]
    args = c["args"]
    assert args[0] == "router"
    assert flag_value(args, "--discovery") == "kubernetes"
    assert flag_value(args, "--k8s-namespace") == NAMESPACE
    assert "--prefill" not in args and "--decode" not in args
    port_name = flag_value(args, "--worker-grpc-port-name")
    for component in ("prefill", "decode"):
        selector = flag_value(args, f"--{component}-selector")
        key, _, service_name = selector.partition("=")
        assert key == "kubernetes.io/service-name"
        svc = r.get("Service", service_name)
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"].get("publishNotReadyAddresses") is not True
        assert matches(svc["spec"]["selector"], r.pod(component)["metadata"]["labels"])
        assert not matches(
            svc["spec"]["selector"],
            r.pod("decode" if component == "prefill" else "prefill")["metadata"]["labels"],
        )
        svc_port = next(p for p in svc["spec"]["ports"] if p["name"] == port_name)
        container_ports = {p["name"]: p["containerPort"] for p in r.container(component)["ports"]}
        assert svc_port["targetPort"] == port_name and svc_port["port"] == container_ports[port_name]
    assert flag_value(args, "--port") == "8000" and flag_value(args, "--grpc-port") == "50051"
    assert flag_value(args, "--routing") == VALUE_SETS[name].get("router", {}).get("routing", "prefix")
    assert flag_value(args, "--index") == "$(KVFLOW_INDEX_URL)"
    api_key = VALUE_SETS[name].get("router", {}).get("apiKey")
    if api_key:
        assert flag_value(args, "--api-key") == "$(KVFLOW_API_KEY)"
        env = {e["name"]: e for e in c["env"]}
        ref = env["KVFLOW_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == api_key.get("existingSecret") or r.has("Secret", ref["name"])
        assert "s3cr3t-key" not in json.dumps(r.pod("router"))
    else:
        assert "--api-key" not in args
    assert ("--disable-log-requests" in args) == (name == "scaled-out")


def test_gpu_resources_and_placement(value_set: tuple[str, Rendered]) -> None:
    name, r = value_set
    values = VALUE_SETS[name]
    for component in ("prefill", "decode"):
        pod = r.pod(component)["spec"]
        res = r.container(component)["resources"]
        assert res["requests"]["memory"] and res["limits"]["memory"]
        if name == "cpu-demo":
            assert "nvidia.com/gpu" not in res.get("limits", {}) and "nvidia.com/gpu" not in res.get(
                "requests", {}
            )
            assert "tolerations" not in pod and "runtimeClassName" not in pod
        else:
            gpus = values.get(component, {}).get("gpusPerPod", 1)
            assert res["limits"]["nvidia.com/gpu"] == gpus == res["requests"]["nvidia.com/gpu"]
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
                "tolerations"
            ]
        wanted = values.get(component, {})
        assert pod.get("nodeSelector", {}) == wanted.get("nodeSelector", {})
        assert pod.get("affinity", {}) == wanted.get("affinity", {})
        replicas = r.get("Deployment", f"{FULLNAME}-{component}")["spec"]["replicas"]
        assert replicas == wanted.get("replicaCount", 1)
    if name == "scaled-out":
        assert r.pod("prefill")["spec"]["runtimeClassName"] == "nvidia"
    assert r.container("router")["resources"]["limits"]["cpu"]


def test_model_volume_and_cache(value_set: tuple[str, Rendered]) -> None:
    name, r = value_set
    for component in ("prefill", "decode"):
        c = r.container(component)
        env = {e["name"]: e.get("value") for e in c["env"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in r.pod(component)["spec"]["volumes"]}
        model_mount = mounts[env["KVFLOW_CACHE"]]
        volume = volumes[model_mount["name"]]
        if name == "external-redis":
            assert volume["persistentVolumeClaim"] == {"claimName": "llm-weights", "readOnly": True}
            assert model_mount["readOnly"] is True
        elif name == "cpu-demo":
            assert volume["emptyDir"] == {"sizeLimit": "2Gi"}
        else:
            claim = volume["persistentVolumeClaim"]["claimName"]
            pvc = r.get("PersistentVolumeClaim", claim)
            assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
            size = "500Gi" if name == "scaled-out" else "100Gi"
            assert pvc["spec"]["resources"]["requests"]["storage"] == size
            assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_security_contexts(value_set: tuple[str, Rendered]) -> None:
    _, r = value_set
    for deployment in r.all("Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            tmp = next(m for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
            assert "emptyDir" in volumes[tmp["name"]]
    for component in ("prefill", "decode"):
        c = r.container(component)
        env = {e["name"]: e.get("value") for e in c["env"]}
        mounted = {m["mountPath"] for m in c["volumeMounts"]}
        for var in ("HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "KVFLOW_CACHE"):
            assert any(env[var] == p or env[var].startswith(p + "/") for p in mounted), var
        assert "/dev/shm" in mounted
        assert r.pod(component)["spec"]["automountServiceAccountToken"] is False


def test_graceful_termination(value_set: tuple[str, Rendered]) -> None:
    """The pod outlives its drain: preStop, then --drain-timeout for in-flight requests, then the exit."""
    _, r = value_set
    for component, minimum in (("router", 30), ("prefill", 60), ("decode", 60)):
        pod = r.pod(component)["spec"]
        container = r.container(component)
        sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        args = container["args"] if component == "router" else container["args"][0].split()
        drain = float(args[args.index("--drain-timeout") + 1])
        assert drain >= 30
        assert pod["terminationGracePeriodSeconds"] >= max(minimum, sleep + drain + 10)


def test_grace_period_shorter_than_the_drain_is_refused(chart: Any) -> None:
    with pytest.raises(helm.HelmError, match="decode: terminationGracePeriodSeconds 100 must be at least"):
        chart.render({"decode": {"terminationGracePeriodSeconds": 100}}, name=RELEASE, namespace=NAMESPACE)


def test_rbac_is_list_watch_endpointslices_only(value_set: tuple[str, Rendered]) -> None:
    _, r = value_set
    (role,) = r.all("Role")
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}
    ]
    (binding,) = r.all("RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    router_sa = r.pod("router")["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": router_sa, "namespace": NAMESPACE}]
    assert r.has("ServiceAccount", router_sa)
    for component in ("prefill", "decode"):
        sa = r.pod(component)["spec"]["serviceAccountName"]
        assert sa != router_sa and r.get("ServiceAccount", sa)["automountServiceAccountToken"] is False


def test_network_policies(value_set: tuple[str, Rendered]) -> None:
    name, r = value_set
    labels = {c: r.pod(c)["metadata"]["labels"] for c in ("router", "prefill", "decode")}
    if r.has("Deployment", f"{FULLNAME}-redis"):
        labels["redis"] = r.pod("redis")["metadata"]["labels"]

    def policy_for(component: str) -> Manifest:
        found = [
            p
            for p in r.all("NetworkPolicy")
            if matches(p["spec"]["podSelector"]["matchLabels"], labels[component])
        ]
        assert len(found) == 1, component
        assert found[0]["spec"]["policyTypes"] == ["Ingress"]
        return found[0]

    def peers(rule: Manifest) -> set[str]:
        out = set()
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, peer  # same namespace, by pod labels only
            out |= {c for c, lab in labels.items() if matches(peer["podSelector"]["matchLabels"], lab)}
        return out

    def port_rules(policy: Manifest, port: str) -> list[Manifest]:
        return [rule for rule in policy["spec"]["ingress"] if any(p.get("port") == port for p in rule["ports"])]

    def any_port_rules(policy: Manifest) -> list[Manifest]:
        return [rule for rule in policy["spec"]["ingress"] if any("port" not in p for p in rule["ports"])]

    (grpc_rule,) = port_rules(policy_for("prefill"), "grpc")
    assert peers(grpc_rule) == {"router", "decode"}  # decode workers pull KV: Prefill, KVLink
    (grpc_rule,) = port_rules(policy_for("decode"), "grpc")
    assert peers(grpc_rule) == {"router"}
    # NCCL links (kvTransfer.backend auto or nccl): prefill and decode pods reach each other on any TCP port.
    assert [peers(rule) for rule in any_port_rules(policy_for("prefill"))] == [{"decode"}]
    assert [peers(rule) for rule in any_port_rules(policy_for("decode"))] == [{"prefill"}]
    for component in ("router", "redis"):
        if component in labels:
            assert not any_port_rules(policy_for(component))
    for component in ("prefill", "decode"):
        (metrics_rule,) = port_rules(policy_for(component), "metrics")
        assert metrics_rule["from"] == [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ]
        # grpc, metrics, and the any-port rule of NCCL links when there is one
        assert len(policy_for(component)["spec"]["ingress"]) == 2 + len(any_port_rules(policy_for(component)))
        ports = {p["name"] for p in r.container(component)["ports"]}
        assert ports == {"grpc", "metrics"}
    if "redis" in labels:
        (rule,) = policy_for("redis")["spec"]["ingress"]
        assert peers(rule) == {"router", "prefill", "decode"}
        assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]
    (router_rule,) = policy_for("router")["spec"]["ingress"]
    assert {p["port"] for p in router_rule["ports"]} == {"http", "grpc"}
    if name == "external-redis":
        assert router_rule["from"] == VALUE_SETS[name]["networkPolicy"]["routerFrom"]
    else:
        assert "from" not in router_rule


def test_grpc_kv_transfer_closes_the_link_ports(chart: Any) -> None:
    r = render(chart, {"kvTransfer": {"backend": "grpc"}})
    for policy in r.all("NetworkPolicy"):
        assert all("port" in p for rule in policy["spec"]["ingress"] for p in rule["ports"]), policy["metadata"]


def test_pdbs_and_hpa(value_set: tuple[str, Rendered]) -> None:
    name, r = value_set
    for component in ("router", "prefill", "decode"):
        pdb = r.get("PodDisruptionBudget", f"{FULLNAME}-{component}")
        assert matches(pdb["spec"]["selector"]["matchLabels"], r.pod(component)["metadata"]["labels"])
        others = [c for c in ("router", "prefill", "decode") if c != component]
        assert not any(
            matches(pdb["spec"]["selector"]["matchLabels"], r.pod(c)["metadata"]["labels"]) for c in others
        )
        expected = "25%" if (name, component) == ("scaled-out", "prefill") else 1
        assert pdb["spec"]["maxUnavailable"] == expected
    router = r.get("Deployment", f"{FULLNAME}-router")
    if name == "scaled-out":
        hpa = r.get("HorizontalPodAutoscaler", f"{FULLNAME}-router")
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": router["metadata"]["name"],
        }
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
        assert "replicas" not in router["spec"]  # the HPA owns it
    else:
        assert not r.all("HorizontalPodAutoscaler")
        assert router["spec"]["replicas"] == 1


def test_service_monitor(chart: Any) -> None:
    r = rendered_set(chart, "scaled-out")
    (sm,) = r.all("ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    selector = sm["spec"]["selector"]
    (expr,) = selector["matchExpressions"]
    scraped = [
        s
        for s in r.all("Service")
        if matches(selector["matchLabels"], s["metadata"]["labels"])
        and s["metadata"]["labels"].get(expr["key"]) in expr["values"]
    ]
    assert {s["metadata"]["name"] for s in scraped} == {
        f"{FULLNAME}-{c}" for c in ("router", "prefill", "decode")
    }
    endpoint_ports = {e["port"] for e in sm["spec"]["endpoints"]}
    for svc in scraped:
        assert endpoint_ports & {p["name"] for p in svc["spec"]["ports"]}
    assert all(e["path"] == "/metrics" and e["interval"] == "10s" for e in sm["spec"]["endpoints"])


DASHBOARD_METRICS = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "kvflow:requests_total",
    "kvflow:route_prefix_matched_blocks_total",
    "kvflow:route_decisions_total",
    "kvflow:index_lag_seconds",
    "kvflow:index_unavailable_total",
    "kvflow:kv_transfer_bytes_total",
    "kvflow:kv_transfer_seconds",
    "kvflow:disagg_fallback_total",
]


def test_grafana_dashboard_configmap(chart: Any) -> None:
    r = rendered_set(chart, "default")
    cm = r.get("ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["kvflow.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "kvflow.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    for metric in DASHBOARD_METRICS:
        assert metric in exprs, metric
    assert not rendered_set(chart, "cpu-demo").has("ConfigMap", f"{FULLNAME}-dashboard")


# --- Dockerfile ---------------------------------------------------------------------------------


def test_dockerfile_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    out = subprocess.run(
        [hadolint, "--failure-threshold", "info", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_properties() -> None:
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    froms = [i for i in parser.structure if i["instruction"] == "FROM"]
    assert len(froms) >= 2, "multi-stage build"
    assert any("AS builder" in f["value"] for f in froms)
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    assert base and base.group(1).startswith("nvidia/cuda:") and "runtime" in base.group(1)
    assert not re.search(r":latest\b", text)
    images = [f["value"].split()[0] for f in froms]
    assert all(i == "${BASE_IMAGE}" or (":" in i and not i.endswith(":latest")) for i in images)
    last_from = max(i["startline"] for i in froms)
    users = [
        i["value"] for i in parser.structure if i["instruction"] == "USER" and i["startline"] > last_from
    ]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert parser.structure[-1]["instruction"] in ("CMD", "ENTRYPOINT")
    assert "COPY --from=builder" in text
    # The chart runs the image as this same non-root uid.
    chart_uid = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]["runAsUser"]
    assert users[-1].split(":")[0] == str(chart_uid)


def test_dockerignore_keeps_context_small() -> None:
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    entries = [line for line in lines if line and not line.startswith("#")]
    assert entries[0] == "*", "allow-list: ignore everything, then re-include"
    included = {e[1:].rstrip("/") for e in entries if e.startswith("!")}
    assert {
        "pyproject.toml",
        "engine",
        "router",
        "kvflow",
        "prefill_worker",
        "decode_worker",
        "protos",
    } <= included
    assert not included & {".git", ".venv", "tests", "helm"}


# --- layout adaptive: role-free workers ---------------------------------------------------------

ADAPTIVE_SETS: dict[str, dict[str, Any]] = {
    "adaptive": {"layout": "adaptive"},
    "adaptive-cpu": VALUE_SETS["cpu-demo"] | {
        "layout": "adaptive",
        "router": VALUE_SETS["cpu-demo"]["router"] | {"disaggPolicy": "adaptive", "sloTtftMs": 500, "sloItlMs": 25.5},
        "workers": {"replicaCount": 3, "disaggMinPromptTokens": 16, "engineArgs": {"max-num-seqs": 8},
                    "tolerations": [], "nodeSelector": {"pool": "cpu"}, "priorityClassName": "serving",
                    "podAnnotations": {"team": "llm"}, "podDisruptionBudget": {"maxUnavailable": "50%"}},
        "serviceMonitor": {"enabled": True},
    },
}


@pytest.fixture(params=sorted(ADAPTIVE_SETS))
def adaptive_set(request: pytest.FixtureRequest, chart: Any) -> tuple[str, Rendered]:
    name = request.param
    if name not in _CACHE:
        _CACHE[name] = render(chart, ADAPTIVE_SETS[name])
    return name, _CACHE[name]


@pytest.mark.parametrize("name", sorted(ADAPTIVE_SETS))
def test_adaptive_layout_lints_and_validates(chart: Any, name: str) -> None:
    report = helm.lint(CHART, ADAPTIVE_SETS[name], strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
    r = render(chart, ADAPTIVE_SETS[name])
    for doc in r.docs:
        if (doc["apiVersion"], doc["kind"]) not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_adaptive_layout_has_role_free_workers_only(adaptive_set: tuple[str, Rendered]) -> None:
    name, r = adaptive_set
    workers = ADAPTIVE_SETS[name].get("workers", {})
    for component in ("prefill", "decode"):
        for kind in ("Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"):
            assert not r.has(kind, f"{FULLNAME}-{component}")
    deployment = r.get("Deployment", f"{FULLNAME}-worker")
    assert deployment["spec"]["replicas"] == workers.get("replicaCount", 2)
    svc = r.get("Service", f"{FULLNAME}-worker")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"].get("publishNotReadyAddresses") is not True
    assert matches(svc["spec"]["selector"], r.pod("worker")["metadata"]["labels"])
    pdb = r.get("PodDisruptionBudget", f"{FULLNAME}-worker")
    assert matches(pdb["spec"]["selector"]["matchLabels"], r.pod("worker")["metadata"]["labels"])
    assert pdb["spec"]["maxUnavailable"] == workers.get("podDisruptionBudget", {}).get("maxUnavailable", 1)
    pod = r.pod("worker")
    assert pod["spec"].get("nodeSelector", {}) == workers.get("nodeSelector", {})
    assert pod["spec"].get("priorityClassName") == workers.get("priorityClassName")
    assert pod["metadata"]["annotations"].get("team") == workers.get("podAnnotations", {}).get("team")
    assert pod["spec"]["serviceAccountName"] == f"{FULLNAME}-worker"
    assert pod["spec"]["automountServiceAccountToken"] is False
    res = r.container("worker")["resources"]
    assert ("nvidia.com/gpu" in res["limits"]) == (name == "adaptive")
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 10 + 240 + 10
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert r.container("worker")[probe]["grpc"] == {"port": 50081}
    assert set(r.get("ConfigMap", f"{FULLNAME}-engine-args")["data"]) == {"worker.args"}


def test_role_free_worker_command_line(adaptive_set: tuple[str, Rendered], tmp_path: Path) -> None:
    """`kvflow worker` with the shared engine args under its own, and a prefill allowlist naming its own headless
    Service: any role-free worker may be moved to the prefill pool, so each may pull KV from any other."""
    name, r = adaptive_set
    workers = ADAPTIVE_SETS[name].get("workers", {})
    argv = worker_argv(r, "worker", tmp_path)
    assert argv[0] == "worker"
    assert flag_value(argv, "--port") == "50081" and flag_value(argv, "--metrics-port") == "9100"
    assert flag_value(argv, "--advertise-address") == "10.1.2.3:50081"
    assert flag_value(argv, "--drain-timeout") == "240"
    assert flag_value(argv, "--max-num-seqs") == str(workers.get("engineArgs", {}).get("max-num-seqs", 256))
    assert flag_value(argv, "--max-model-len") == ("2048" if name == "adaptive-cpu" else "4096")
    assert flag_value(argv, "--index").startswith("redis://")
    min_tokens = workers.get("disaggMinPromptTokens")
    assert (flag_value(argv, "--disagg-min-prompt-tokens") == str(min_tokens)) if min_tokens else \
        "--disagg-min-prompt-tokens" not in argv
    host, port = flag_value(argv, "--prefill-allowlist").rsplit(":", 1)
    svc = r.get("Service", host)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"].get("publishNotReadyAddresses") is not True
    assert matches(svc["spec"]["selector"], r.pod("worker")["metadata"]["labels"])
    assert int(port) == next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc") == 50081
    token = resolve_env(r, r.container("worker"))["KVFLOW_CLUSTER_TOKEN"]
    assert len(token) >= 32 and not any(token in a for a in argv)  # env only


def test_router_discovers_role_free_workers(adaptive_set: tuple[str, Rendered]) -> None:
    name, r = adaptive_set
    router = ADAPTIVE_SETS[name].get("router", {})
    args = r.container("router")["args"]
    assert flag_value(args, "--discovery") == "kubernetes"
    assert "--prefill-selector" not in args and "--decode-selector" not in args
    key, _, service_name = flag_value(args, "--worker-selector").partition("=")
    assert key == "kubernetes.io/service-name"
    svc = r.get("Service", service_name)
    assert matches(svc["spec"]["selector"], r.pod("worker")["metadata"]["labels"])
    port_name = flag_value(args, "--worker-grpc-port-name")
    assert next(p for p in svc["spec"]["ports"] if p["name"] == port_name)["targetPort"] == port_name
    assert flag_value(args, "--disagg-policy") == "adaptive"
    for flag, key in (("--slo-ttft-ms", "sloTtftMs"), ("--slo-itl-ms", "sloItlMs")):
        if key in router:
            assert float(flag_value(args, flag)) == router[key]
        else:
            assert flag not in args  # the router's default
    # The router really accepts this command line (and resolves it to a kubernetes cluster of role-free workers).
    from kvflow.cli import build_parser
    from kvflow.commands.router import config_from_args
    from router.discovery import kubernetes_selectors

    env = {"KVFLOW_INDEX_URL": "redis://:pw@kv-kvflow-redis:6379/0", "KVFLOW_API_KEY": "k"}
    config = config_from_args(build_parser().parse_args([expand_k8s_vars(a, env) for a in args]))
    assert kubernetes_selectors(config) == {"worker": f"kubernetes.io/service-name={FULLNAME}-worker"}
    if "sloTtftMs" in router:
        assert (config.slo_ttft_ms, config.slo_itl_ms) == (500.0, 25.5)


def test_adaptive_network_policies_admit_worker_to_worker(chart: Any, adaptive_set: tuple[str, Rendered]) -> None:
    _, r = adaptive_set
    labels = {c: r.pod(c)["metadata"]["labels"] for c in ("router", "worker", "redis")}

    def peers(rule: Manifest) -> set[str]:
        return {c for peer in rule["from"] for c, lab in labels.items()
                if matches(peer["podSelector"]["matchLabels"], lab)}

    (policy,) = [p for p in r.all("NetworkPolicy") if matches(p["spec"]["podSelector"]["matchLabels"], labels["worker"])]
    rules = policy["spec"]["ingress"]
    (grpc_rule,) = [rule for rule in rules if {"port": "grpc", "protocol": "TCP"} in rule["ports"]]
    assert peers(grpc_rule) == {"router", "worker"}  # any worker pulls KV from any other (Prefill, KVLink)
    (link_rule,) = [rule for rule in rules if rule["ports"] == [{"protocol": "TCP"}]]
    assert peers(link_rule) == {"worker"}  # NCCL links between workers
    (metrics_rule,) = [rule for rule in rules if {"port": "metrics", "protocol": "TCP"} in rule["ports"]]
    assert "podSelector" not in metrics_rule["from"][0]
    redis = next(p for p in r.all("NetworkPolicy") if p["metadata"]["name"] == f"{FULLNAME}-redis")
    assert peers(redis["spec"]["ingress"][0]) == {"router", "worker"}
    grpc_only = render(chart, {"layout": "adaptive", "kvTransfer": {"backend": "grpc"}})
    policy = grpc_only.get("NetworkPolicy", f"{FULLNAME}-worker")
    assert all("port" in p for rule in policy["spec"]["ingress"] for p in rule["ports"])


def test_adaptive_service_monitor_and_notes(chart: Any) -> None:
    r = render(chart, ADAPTIVE_SETS["adaptive-cpu"])
    (sm,) = r.all("ServiceMonitor")
    assert sm["spec"]["selector"]["matchExpressions"][0]["values"] == ["router", "worker"]
    notes = r.files["kvflow/templates/NOTES.txt"]
    assert "3 role-free" in notes and f"{FULLNAME}-worker" in notes and "prefill," not in notes


def test_static_layout_is_the_default_and_unchanged(chart: Any) -> None:
    """layout static (the default, so existing installs keep their Deployments) renders what it did before the
    adaptive layout existed: pinned prefill/decode, the router without --worker-selector or policy flags."""
    assert yaml.safe_load((CHART / "values.yaml").read_text())["layout"] == "static"
    explicit = render(chart, {"layout": "static"})
    default = rendered_set(chart, "default")
    secrets = {"Secret"}  # random per render
    strip = [d for d in default.docs if d["kind"] not in secrets]
    assert [d for d in explicit.docs if d["kind"] not in secrets] == strip
    assert not default.has("Deployment", f"{FULLNAME}-worker") and not default.has("Service", f"{FULLNAME}-worker")
    args = default.container("router")["args"]
    assert not {"--worker-selector", "--disagg-policy", "--slo-ttft-ms", "--slo-itl-ms"} & set(args)
    set_policy = render(chart, {"router": {"disaggPolicy": "static", "sloTtftMs": 800}})
    args = set_policy.container("router")["args"]
    assert flag_value(args, "--disagg-policy") == "static" and flag_value(args, "--slo-ttft-ms") == "800"
    assert "--prefill-selector" in args and "--worker-selector" not in args


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"layout": "adaptive", "workers": {"terminationGracePeriodSeconds": 100}},
         "worker: terminationGracePeriodSeconds 100 must be at least"),
    ],
)
def test_adaptive_template_guards(chart: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("bad", [{"layout": "mixed"}, {"workers": {"replicaCount": "2"}},
                                 {"router": {"disaggPolicy": "always"}}, {"router": {"sloTtftMs": 0}},
                                 {"workers": {"gpusPerPod": 0}}], ids=lambda b: json.dumps(b)[:60])
def test_schema_rejects_bad_adaptive_values(chart: Any, bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.render(bad, name=RELEASE, namespace=NAMESPACE)
