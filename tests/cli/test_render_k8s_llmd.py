"""`molctl render k8s PROFILE --scheduler llm-d`: every rendered object valid offline against its
schema (built-in kinds with kubernetes-validate as the per-pod stack's tests do; InferencePool and
InferenceObjective against the CRDs of GIE v1.5.0 and llm-d-router v0.10.0, tests/data/llmd;
the router values against the chart's own values and template validations), and what each object
says: engines as their own vLLM workload, the pool selecting them, objectives route > answer >
summary, the proxy's upstream the router."""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from molctl.errors import ExitStatus
from tests.helpers import Molctl

IMAGE = "registry.example/molctl:1"
DATA = Path(__file__).resolve().parents[1] / "data" / "llmd"
CRDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
    ("llm-d.ai/v1alpha2", "InferenceObjective"): "llm-d.ai_inferenceobjectives.yaml",
    ("llm-d.ai/v1alpha2", "InferenceModelRewrite"): "llm-d.ai_inferencemodelrewrites.yaml",
}
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@pytest.fixture
def render(tmp_path, monkeypatch) -> Molctl:
    monkeypatch.delenv("MOLCTL_PROFILES_DIR", raising=False)
    return Molctl(tmp_path / "never-created", in_process=True)


def _llmd(render: Molctl, out: Path, profile: str = "venti", *extra: str) -> tuple[dict[str, dict], dict]:
    result = render("render", "k8s", profile, "--image", IMAGE, "--scheduler", "llm-d", "-o", str(out), *extra)
    assert result.exit_code == ExitStatus.OK, result.stderr
    objects = {p.name: yaml.safe_load(p.read_text()) for p in sorted(out.glob("*.yaml"))}
    values = yaml.safe_load((out / "helm" / "llm-d-router-values.yaml").read_text())
    return objects, values


def _crd_schema(api_version: str, kind: str) -> dict:
    crd = yaml.safe_load((DATA / CRDS[(api_version, kind)]).read_text())
    version = api_version.split("/")[1]
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    assert served["served"] and crd["spec"]["names"]["kind"] == kind
    return served["schema"]["openAPIV3Schema"]


def validate_custom(obj: dict) -> None:
    """A custom object as the API server's structural-schema validation takes it: its CRD's
    openAPIV3Schema (types, required, enums, patterns, lengths; the CEL rules
    x-kubernetes-validations are not evaluated), with no unknown field (the API server prunes
    them silently: refused here, as a field the controller would never see), and a DNS subdomain
    name of at most 253."""
    schema = _crd_schema(obj["apiVersion"], obj["kind"])
    jsonschema.Draft7Validator(_closed(schema)).validate(
        {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    )
    name = obj["metadata"]["name"]
    assert DNS_SUBDOMAIN.match(name) and len(name) <= 253, name


def _closed(schema: dict) -> dict:
    """The schema with additionalProperties false wherever it lists properties (structural)."""
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes")}
    if "properties" in out:
        out["properties"] = {k: _closed(v) for k, v in out["properties"].items() if k not in ("metadata",)}
        out.setdefault("additionalProperties", False)
        if schema.get("properties", {}).get("metadata") is not None:
            out["properties"]["metadata"] = {"type": "object"}
    if "items" in out:
        out["items"] = _closed(out["items"])
    return out


def test_every_rendered_object_validates_against_its_schema(render, tmp_path):
    import kubernetes_validate

    objects, _ = _llmd(render, tmp_path / "out", "venti", "--replicas", "4", "--store", "redis://redis:6379/0")
    kinds = sorted(o["kind"] for o in objects.values())
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "Deployment",
        "InferenceObjective",
        "InferenceObjective",
        "InferenceObjective",
        "InferencePool",
        "Service",
    ]
    for obj in objects.values():
        if (obj["apiVersion"], obj["kind"]) in CRDS:
            validate_custom(obj)
        else:
            kubernetes_validate.validate(obj, "1.30.0", strict=True)


def test_the_crd_check_refuses_what_the_api_server_would(render, tmp_path):
    """The stand-in validator is strict: a wrong type, an unknown field, a missing poolRef fail."""
    objects, _ = _llmd(render, tmp_path / "out")
    pool = objects["inferencepool-molctl-venti-pool.yaml"]
    objective = objects["inferenceobjective-molctl-venti-route.yaml"]
    bad = [
        {**pool, "spec": {**pool["spec"], "appProtocol": "grpc"}},
        {**pool, "spec": {**pool["spec"], "targetPort": 8000}},
        {**objective, "spec": {"priority": 2}},
        {**objective, "spec": {**objective["spec"], "priority": "high"}},
    ]
    for obj in bad:
        with pytest.raises(jsonschema.ValidationError):
            validate_custom(obj)


def test_the_pool_selects_the_engines_and_the_proxy_goes_through_the_router(render, tmp_path):
    objects, values = _llmd(render, tmp_path / "out", "venti", "--replicas", "3", "--proxy-replicas", "5")
    engine = objects["deployment-molctl-venti-engine.yaml"]
    proxy = objects["deployment-molctl-venti-proxy.yaml"]
    pool = objects["inferencepool-molctl-venti-pool.yaml"]
    service = objects["service-molctl-venti.yaml"]
    assert engine["spec"]["replicas"] == 3 and proxy["spec"]["replicas"] == 5
    engine_labels = engine["spec"]["template"]["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= engine_labels.items()
    assert not selector.items() <= proxy["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= proxy["spec"]["template"]["metadata"]["labels"].items()
    assert values["router"]["modelServers"]["matchLabels"] == selector
    (container,) = engine["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert "vllm.entrypoints.openai.api_server" in args
    lora = args.index("--lora-modules")
    assert args[lora + 1 : lora + 5] == [f"L{i}=/root/glm52_local/loras/L{i}" for i in range(4)]
    assert args[args.index("--host") + 1] == "0.0.0.0"  # the router reaches the engine on its pod IP
    port = int(args[args.index("--port") + 1])
    assert pool["spec"]["targetPorts"] == [{"number": port}] == values["router"]["modelServers"]["targetPorts"]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600  # an hour-long model load
    assert startup["httpGet"] == {"path": "/health", "port": "engine"}
    assert engine["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["model"]["readOnly"] and "engine-cache" in mounts
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["VLLM_CACHE_ROOT"].startswith(mounts["engine-cache"]["mountPath"])
    (proxy_container,) = proxy["spec"]["template"]["spec"]["containers"]
    pargs = proxy_container["args"]
    assert pargs[pargs.index("--upstream") + 1] == "http://molctl-venti-pool-epp:8081"
    set_json = pargs[pargs.index("--set-json") + 1]
    assert '["proxy.scheduler_objectives", "molctl-venti"]' in set_json
    # venti's max-num-seqs is 8: 3 engines x 8 running slots over 5 proxies, rounded up
    assert '["proxy.max_inflight", 5]' in set_json
    assert pool["spec"]["endpointPickerRef"]["name"] == "molctl-venti-pool-epp"


def test_a_profile_or_set_max_inflight_is_kept(render, tmp_path):
    objects, _ = _llmd(render, tmp_path / "out", "venti", "--set", "proxy.max_inflight=3")
    args = objects["deployment-molctl-venti-proxy.yaml"]["spec"]["template"]["spec"]["containers"][0]["args"]
    set_json = args[args.index("--set-json") + 1]
    assert '"proxy.max_inflight", 3]' in set_json and set_json.count("proxy.max_inflight") == 1


def test_one_objective_per_hop_route_above_answer_above_summary(render, tmp_path):
    objects, values = _llmd(render, tmp_path / "out", "venti", "-n", "inference")
    objectives = {o["metadata"]["name"]: o for o in objects.values() if o["kind"] == "InferenceObjective"}
    prio = {n: o["spec"]["priority"] for n, o in objectives.items()}
    assert prio["molctl-venti-route"] > prio["molctl-venti-answer"] > prio["molctl-venti-summary"]
    assert {o["spec"]["poolRef"]["name"] for o in objectives.values()} == {"molctl-venti-pool"}
    # the chart creates the same objects; Helm adopts the ones kubectl applied (same release)
    assert {o["name"]: o["priority"] for o in values["router"]["inferenceObjectives"]} == prio
    for obj in [*objectives.values(), objects["inferencepool-molctl-venti-pool.yaml"]]:
        meta = obj["metadata"]
        assert meta["namespace"] == "inference"
        assert meta["annotations"] == {
            "meta.helm.sh/release-name": "molctl-venti-pool",
            "meta.helm.sh/release-namespace": "inference",
        }
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    proxy = objects["deployment-molctl-venti-proxy.yaml"]
    args = proxy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--upstream") + 1] == "http://molctl-venti-pool-epp.inference.svc:8081"


def _chart_values() -> dict:
    """The standalone chart's defaults: its own values.yaml under `router:` over routerlib's."""
    base = yaml.safe_load((DATA / "routerlib-values.yaml").read_text())
    standalone = yaml.safe_load((DATA / "llm-d-router-standalone-values.yaml").read_text())["router"]
    return {"router": {**base, **{k: v for k, v in standalone.items() if v is not None}}}


def _known(value, default, path: str) -> None:
    """Every key the render sets is one the chart has, with a value of the same type; the keys of
    maps the chart leaves open (matchLabels, pluginsCustomConfig) are the user's."""
    if isinstance(default, dict) and isinstance(value, dict):
        for key, sub in value.items():
            # open maps: the chart reads them whole (modelServers.matchLabels, epp.pluginsCustomConfig,
            # and epp.flags: each rendered as --KEY=VALUE, routerlib templates/_deployment.yaml)
            if path in ("router.modelServers", "router.epp") and key in ("matchLabels", "pluginsCustomConfig", "flags"):
                assert isinstance(sub, dict), path + "." + key
                continue
            assert key in default, f"{path}.{key}: not a value of the chart"
            _known(sub, default[key], f"{path}.{key}".lstrip("."))
    elif isinstance(default, list):
        assert isinstance(value, list), path
        if default and isinstance(default[0], dict):
            for item in value:
                assert set(item) <= set(default[0]), path
    elif default is not None:
        assert type(value) is type(default) or (isinstance(value, int) and isinstance(default, int)), path


def test_the_router_values_fit_the_chart(render, tmp_path):
    """No values.schema.json is published (llm-d-router v0.10.0): the values are checked against
    the chart's own defaults and its template validations (templates/_validations.tpl)."""
    _, values = _llmd(render, tmp_path / "out")
    defaults = _chart_values()
    defaults["router"]["inferenceObjectives"] = [{"name": "", "priority": 0}]  # the chart's commented example
    _known(values, defaults, "")
    router = values["router"]
    # llm-d-router.validations.standalone / .gateway.common / .epp.inferenceObjectives
    assert router["proxy"]["mode"] in ("sidecar", "service")
    assert router["proxy"]["proxyType"] in ("envoy", "agentgateway")
    assert router["modelServers"]["matchLabels"]
    assert router["inferencePool"]["create"] is True  # objectives need the pool; EPP runs --pool-name
    assert isinstance(router["proxy"]["failOpen"] if "failOpen" in router["proxy"] else True, bool)
    assert any(p["name"] == "http" for p in router["extraServicePorts"])
    config = yaml.safe_load(router["epp"]["pluginsCustomConfig"][router["epp"]["pluginsConfigFile"]])
    assert config["apiVersion"] == "llm-d.ai/v1alpha1" and config["kind"] == "EndpointPickerConfig"
    types = {p["type"] for p in config["plugins"]}
    weights = {p["pluginRef"]: p["weight"] for p in config["schedulingProfiles"][0]["plugins"]}
    assert set(weights) <= types
    for scorer in (
        "prefix-cache-scorer",
        "lora-affinity-scorer",
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "session-affinity-scorer",
    ):
        assert weights[scorer] > 0, scorer
    stability = dict(
        line.split()
        for line in (DATA / "epp-plugin-stability.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert types <= set(stability), types - set(stability)  # types the EPP v0.10.0 registers
    if "Alpha" in {stability[t] for t in types}:
        assert router["epp"]["flags"]["allow-experimental-plugins"] is True
    session = next(p for p in config["plugins"] if p["type"] == "session-affinity-scorer")
    assert session["parameters"]["strategy"] == "session_id"
    assert session["parameters"]["sessionIdConfig"]["sources"] == [{"header": "x-session-id"}]
    assert "flowControl" in config["featureGates"]
    ttl = config["flowControl"]["defaultRequestTTL"]
    assert re.fullmatch(r"\d+s", ttl) and int(ttl[:-1]) >= 3600  # queued, not shed, while the engines load


def test_an_sglang_profile_is_refused_in_one_line(render, tmp_path):
    out = tmp_path / "out"
    result = render("render", "k8s", "venti-sglang", "--image", IMAGE, "--scheduler", "llm-d", "-o", str(out))
    assert result.exit_code == ExitStatus.USAGE
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "engine.kind is 'sglang'" in lines[0] and "vLLM" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--scheduler", "slurm", "-o", "OUT"], "--scheduler 'slurm': expected one of stack, llm-d"),
        (["--scheduler", "llm-d"], "--scheduler llm-d: give --output DIR"),
        (["--scheduler", "llm-d", "--proxy-replicas", "0", "-o", "OUT"], "--proxy-replicas 0: expected at least 1"),
        (["--scheduler", "llm-d", "--cache-pvc", "Bad_Claim", "-o", "OUT"], "--cache-pvc 'Bad_Claim'"),
        (["--proxy-replicas", "3", "-o", "OUT"], "--proxy-replicas: only with --scheduler llm-d"),
        (["--cache-pvc", "cache", "-o", "OUT"], "--cache-pvc: only with --scheduler llm-d"),
    ],
)
def test_bad_scheduler_options_are_usage_errors(render, tmp_path, extra, expected):
    out = tmp_path / "out"
    result = render("render", "k8s", "venti", "--image", IMAGE, *[str(out) if a == "OUT" else a for a in extra])
    assert result.exit_code == ExitStatus.USAGE, result.stderr
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_the_default_stays_the_per_pod_stack(render, tmp_path):
    result = render("render", "k8s", "venti", "--image", IMAGE)
    assert result.exit_code == ExitStatus.OK
    kinds = [d["kind"] for d in yaml.safe_load_all(result.stdout) if d]
    assert kinds == ["ConfigMap", "Service", "StatefulSet"]
    assert "proxy.scheduler_objectives" not in result.stdout


def test_the_readme_walkthrough_names_every_object_and_value_it_renders(render, tmp_path):
    """README "Beyond one host on Kubernetes with llm-d": every file, object name, label and
    values key the render writes is named there (NAME spelled as NAME or molctl-venti)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Beyond one host on Kubernetes with llm-d", 1)[1].split("\n## ", 1)[0]
    objects, values = _llmd(render, tmp_path / "out")

    def named(text: str) -> bool:
        return text in section or text.replace("molctl-venti", "NAME") in section

    for fname, obj in objects.items():
        assert named(fname.removesuffix(".yaml").split("-", 1)[1]) or named(fname), fname
        assert named(obj["metadata"]["name"]) and obj["kind"] in section, fname
    assert "helm/llm-d-router-values.yaml" in section
    for key, value in values["router"].items():
        assert f"`{key}" in section, key
        if isinstance(value, dict):
            for sub in value:
                if key != "epp" or sub != "pluginsCustomConfig":
                    assert re.search(rf"\b{sub}\b", section), f"{key}.{sub}"
    config = yaml.safe_load(values["router"]["epp"]["pluginsCustomConfig"]["molctl-plugins.yaml"])
    for plugin in config["plugins"]:
        assert f"`{plugin['type']}`" in section, plugin["type"]
    for label in ("app.kubernetes.io/instance", "molctl.io/component", "meta.helm.sh/release-name"):
        assert label in section, label
    for header in ("x-session-id", "x-llm-d-inference-objective", "x-llm-d-inference-fairness-id"):
        assert header in section, header
