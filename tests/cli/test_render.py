"""`molctl render k8s|systemd`: manifests that validate offline against the Kubernetes schemas,
budgets that follow the profile, and the argv `up` would run (captured from `up`'s own
spawning code, not rebuilt here). Also `python -m molctl.lifecycle.waitready`, the units' readiness step,
against the fake engine."""

from __future__ import annotations

import math
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from molctl.engines import get_engine
from molctl.errors import ExitStatus
from molctl.lifecycle.launch import UpOptions
from molctl.lifecycle.readiness import base_url
from molctl.lifecycle.starter import _Starter
from molctl.lifecycle.stop import ENGINE_STOP_TIMEOUT_S
from molctl.profiles import load_profile, profile_dirs
from molctl.render import (
    KEYS_MOUNT,
    PRESTOP_DELAY_S,
    PROFILES_MOUNT,
    STARTUP_PERIOD_S,
    STATE_MOUNT,
    STOP_MARGIN_S,
)
from tests.helpers import Molctl, free_port
from tests.procs import fake_engine_argv, running

K8S_VERSION = "1.30.0"  # the oldest release whose schemas know the preStop `sleep` action
PROFILES = ("venti", "tall", "tiny")
IMAGE = "registry.example/molctl:1"


@pytest.fixture
def render(tmp_path, monkeypatch) -> Molctl:
    """The CLI with a state dir that does not exist: rendering must never create it."""
    monkeypatch.delenv("MOLCTL_PROFILES_DIR", raising=False)
    return Molctl(tmp_path / "never-created", in_process=True)


def _k8s(render: Molctl, profile: str, *extra: str) -> list[dict]:
    result = render("render", "k8s", profile, "--image", IMAGE, *extra)
    assert result.exit_code == ExitStatus.OK, result.stderr
    assert not render.state_dir.exists()
    return [d for d in yaml.safe_load_all(result.stdout) if d is not None]


def _by_kind(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objects}


def _containers(objects: list[dict]) -> dict[str, dict]:
    pod = _by_kind(objects)["StatefulSet"]["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"]}


def _up_spawns(
    profile_name: str,
    overrides: list,
    key_args: list[str],
    state_dir: Path,
    profiles_dirs: list[Path],
    drain_timeout_s: float = 600.0,
) -> dict[str, tuple[list[str], dict, str]]:
    """What `up` spawns for this profile and options: `{component: (argv, env, upstream)}`,
    captured at `_Starter._spawn` (the code `up` runs), nothing started."""
    from molctl import stackconfig

    profile, config = stackconfig.load(profile_name, profile_dirs(), overrides)

    class Ctx:
        pass

    ctx = Ctx()
    ctx.state_dir = state_dir
    opts = UpOptions(overrides=overrides, drain_timeout_s=drain_timeout_s, profiles_dirs=profiles_dirs)
    starter = _Starter(profile, config, ctx, opts, key_args, progress=None)
    spawned: dict[str, tuple[list[str], dict, str]] = {}

    def fake_spawn(component, argv, env, port, host, claims):
        spawned[component] = (argv, env, base_url(host, port))
        return None, None

    starter._spawn = fake_spawn
    starter.start_engine([])
    starter.start_proxy([], spawned["engine"][2])  # `up` passes the engine record's URL
    return spawned


# ------------------------------------------------------------------------------------ Kubernetes


@pytest.mark.parametrize("profile", PROFILES)
def test_k8s_manifests_validate_offline(render, profile):
    objects = _k8s(render, profile, "--replicas", "2", "--namespace", "mol", "--store", "memory")
    assert [o["kind"] for o in objects] == ["ConfigMap", "Service", "StatefulSet"]
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises ValidationError naming the field
        assert obj["metadata"]["namespace"] == "mol"
    assert _by_kind(objects)["StatefulSet"]["spec"]["replicas"] == 2


@pytest.mark.parametrize("profile", PROFILES)
def test_k8s_budgets_and_gpus_follow_the_profile(render, profile):
    prof = load_profile(profile, profile_dirs())
    for drain in (600, 90):
        objects = _k8s(render, profile, "--drain-timeout", str(drain))
        pod = _by_kind(objects)["StatefulSet"]["spec"]["template"]["spec"]
        engine, proxy = _containers(objects)["engine"], _containers(objects)["proxy"]
        startup = engine["startupProbe"]
        budget = startup["failureThreshold"] * startup["periodSeconds"]
        assert prof.engine.start_timeout_s <= budget < prof.engine.start_timeout_s + STARTUP_PERIOD_S
        # the pod may take the endpoint delay, the whole drain and the engine's stop before SIGKILL
        assert pod["terminationGracePeriodSeconds"] >= PRESTOP_DELAY_S + drain + ENGINE_STOP_TIMEOUT_S
        assert proxy["lifecycle"]["preStop"] == {"sleep": {"seconds": PRESTOP_DELAY_S}}
        engine_wait = engine["lifecycle"]["preStop"]["exec"]["command"]
        assert engine_wait[-2] == f"http://127.0.0.1:{prof.proxy.port}/health"  # waits for the proxy to exit
        assert float(engine_wait[-1]) >= PRESTOP_DELAY_S + drain
        assert float(engine_wait[-1]) + ENGINE_STOP_TIMEOUT_S <= pod["terminationGracePeriodSeconds"]
        assert proxy["args"][proxy["args"].index("--drain-timeout") + 1] == f"{float(drain)}"
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert proxy["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert engine["startupProbe"]["exec"]["command"][-2] == f"http://127.0.0.1:{prof.engine.port}/health"
    if prof.engine.gpus:
        gpus = {"nvidia.com/gpu": prof.engine.gpus}
        assert engine["resources"] == {"requests": gpus, "limits": gpus}
    else:
        assert "nvidia.com/gpu" not in yaml.safe_dump(objects)
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"] == (
        f"{2 * prof.engine.gpus}Gi" if prof.engine.gpus else "1Gi"
    )
    assert "resources" not in proxy


@pytest.mark.parametrize("profile", PROFILES)
def test_k8s_args_are_the_argv_up_runs(render, profile):
    objects = _k8s(
        render,
        profile,
        "--python",
        sys.executable,
        "--model-root",
        "/models/mol",
        "--set",
        "proxy.max_output_tokens=64",
    )
    containers = _containers(objects)
    # `up` with the settings render applies: the proxy on every address, the engine's interpreter
    # named, the key file where the Secret is mounted, the state dir in its emptyDir
    overrides = [
        ("proxy.host", "0.0.0.0"),
        ("model_root", "/models/mol"),
        ("proxy.max_output_tokens", 64),
        ("engine.python", sys.executable),
    ]
    spawned = _up_spawns(
        profile, overrides, ["--api-key-file", f"{KEYS_MOUNT}/api-keys"], Path(STATE_MOUNT), [Path(PROFILES_MOUNT)]
    )
    engine_argv, engine_env, _ = spawned["engine"]
    assert containers["engine"]["args"] == engine_argv
    assert containers["proxy"]["args"] == spawned["proxy"][0]
    # the engine's environment: the profile's engine.env as `up` sets it, unset_env removed by `env -u`
    prof = load_profile(profile, profile_dirs())
    env = {e["name"]: e["value"] for e in containers["engine"]["env"]}
    # ... and the persistent engine cache below the state dir (molctl.enginecache), mounted as a volume
    cache = Path(STATE_MOUNT) / profile / "engine-cache"
    cache_env = get_engine(prof.engine.kind).cache_env(cache)
    assert env == {**cache_env, **prof.engine.env} and all(engine_env[k] == v for k, v in env.items())
    assert {"name": "engine-cache", "mountPath": str(cache)} in containers["engine"]["volumeMounts"]
    unset = containers["engine"]["command"]
    assert unset[0] == "env" and unset[1::2] == ["-u"] * len(prof.engine.unset_env)
    assert unset[2::2] == list(prof.engine.unset_env) and not set(prof.engine.unset_env) & set(engine_env)
    # the model is mounted where the argv reads it
    mounts = {m["name"]: m for m in containers["engine"]["volumeMounts"]}
    assert mounts["model"]["mountPath"] == "/models/mol" and mounts["model"]["readOnly"] is True
    assert (
        engine_argv[engine_argv.index("--model" if prof.engine.kind == "vllm" else "--model-path") + 1]
        == "/models/mol/base"
    )
    volumes = {v["name"]: v for v in _by_kind(objects)["StatefulSet"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["hostPath"] == {"path": "/models/mol", "type": "Directory"}
    # the profile file the proxy's --profiles-dir reads
    assert _by_kind(objects)["ConfigMap"]["data"] == {f"{profile}.yaml": prof.source.read_text(encoding="utf-8")}


def test_k8s_service_targets_only_the_proxy_port(render):
    prof = load_profile("venti", profile_dirs())
    objects = _k8s(render, "venti")
    service = _by_kind(objects)["Service"]
    assert service["spec"]["ports"] == [
        {"name": "http", "port": prof.proxy.port, "targetPort": "http", "protocol": "TCP"}
    ]
    named = {p["name"]: (c["name"], p["containerPort"]) for c in _containers(objects).values() for p in c["ports"]}
    assert named["http"] == ("proxy", prof.proxy.port)
    assert service["spec"]["selector"] == _by_kind(objects)["StatefulSet"]["spec"]["selector"]["matchLabels"]
    assert prof.engine.port not in [p["port"] for p in service["spec"]["ports"]]


def test_k8s_secrets_are_references(render):
    objects = _k8s(
        render,
        "tall",
        "--api-key-secret",
        "mol-keys",
        "--store",
        "memory",
        "--store-password-secret",
        "redis-auth:pw",
        "--engine-env-secret",
        "hf-token",
    )
    proxy, engine = _containers(objects)["proxy"], _containers(objects)["engine"]
    pod = _by_kind(objects)["StatefulSet"]["spec"]["template"]["spec"]
    keys = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert keys["secret"]["secretName"] == "mol-keys"
    mount = next(m for m in proxy["volumeMounts"] if m["name"] == "api-keys")
    key_file = proxy["args"][proxy["args"].index("--api-key-file") + 1]
    assert key_file == f"{mount['mountPath']}/{keys['secret']['items'][0]['path']}" and mount["readOnly"] is True
    env = {e["name"]: e for e in proxy["env"]}
    assert env["MOLCTL_STORE_PASSWORD"]["valueFrom"] == {"secretKeyRef": {"name": "redis-auth", "key": "pw"}}
    assert engine["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert not any(e["name"].startswith("MOLCTL_") for e in engine["env"])
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_secret_in_engine_env_is_refused(render):
    for kind in (("k8s", "--image", IMAGE), ("systemd", "--allow-unauthenticated")):
        result = render("render", kind[0], "tall", *kind[1:], "--set", "engine.env.HF_TOKEN=hf_secret_value")
        assert result.exit_code == ExitStatus.CHECK_FAILED and result.stdout == ""
        assert "field 'engine.env.HF_TOKEN': its name says it is a secret" in result.stderr
        assert "hf_secret_value" not in result.stderr


def test_k8s_store_and_replica_identity(render):
    result = render(
        "render",
        "k8s",
        "tiny",
        "--image",
        IMAGE,
        "--replicas",
        "3",
        "--store",
        "memory",
        "--proxy-arg=--log-backups=3",
        "--proxy-arg=$(POD_NAME)-extra",
    )
    assert result.exit_code == ExitStatus.OK
    objects = [d for d in yaml.safe_load_all(result.stdout) if d]
    proxy = _containers(objects)["proxy"]
    set_json = proxy["args"][proxy["args"].index("--set-json") + 1]
    assert '["proxy.store", "memory"]' in set_json
    assert proxy["args"][-2:] == ["--log-backups=3", "$(POD_NAME)-extra"]  # appended, $(POD_NAME) left to Kubernetes
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in proxy["env"]
    assert "each pod keeps its own conversations" in result.stderr  # 3 replicas on a per-pod store


def test_k8s_metrics_port_is_a_container_port_outside_the_service(render):
    """proxy.metrics_port: a `metrics` port on the proxy container (for a scrape config or a
    PodMonitor), never on the Service (the public endpoint serves no /metrics)."""
    objects = _k8s(render, "tiny", "--set", "proxy.metrics_port=9400")
    proxy = _containers(objects)["proxy"]
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in proxy["ports"]
    assert proxy["args"][proxy["args"].index("--metrics-port") + 1] == "9400"
    service = _by_kind(objects)["Service"]
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]
    assert all(p.get("targetPort") != "metrics" and p["port"] != 9400 for p in service["spec"]["ports"])
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_k8s_on_a_redis_store(render):
    """--store redis://...: the URL travels as proxy.store, the password only as a Secret
    reference; with the engine reachable and advertised on the pod IP there is no warning."""
    url = "redis://redis.mol.svc:6379/0"
    result = render(
        "render",
        "k8s",
        "tiny",
        "--image",
        IMAGE,
        "--replicas",
        "2",
        "--store",
        url,
        "--store-password-secret",
        "redis-auth",
        "--set",
        "engine.host=0.0.0.0",
        "--proxy-arg=--replica-id=$(POD_NAME)",
        "--proxy-arg=--advertise-upstream=http://$(POD_IP):8100",
    )
    assert result.exit_code == ExitStatus.OK, result.stderr
    assert result.stderr == ""
    objects = [d for d in yaml.safe_load_all(result.stdout) if d]
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    proxy = _containers(objects)["proxy"]
    assert f'["proxy.store", "{url}"]' in proxy["args"][proxy["args"].index("--set-json") + 1]
    env = {e["name"]: e for e in proxy["env"]}
    assert env["MOLCTL_STORE_PASSWORD"]["valueFrom"] == {"secretKeyRef": {"name": "redis-auth", "key": "password"}}
    assert "value" not in env["MOLCTL_STORE_PASSWORD"]


@pytest.mark.parametrize("extra", [(), ("--proxy-arg=--advertise-upstream=http://$(POD_IP):8100",)])
def test_k8s_replicas_on_a_redis_store_warn_when_peers_cannot_reach_the_engines(render, extra):
    """Each pod's engine on the pod's loopback (the default engine.host) or advertised as the
    loopback (no --advertise-upstream): a peer's hops would land on its own engine while recorded
    as the owner's (or be refused), so affinity is off: render says how to turn it on."""
    result = render(
        "render", "k8s", "tiny", "--image", IMAGE, "--replicas", "2", "--store", "redis://redis:6379/0", *extra
    )
    assert result.exit_code == ExitStatus.OK, result.stderr
    assert "conversation affinity" in result.stderr and "--advertise-upstream=http://$(POD_IP):8100" in result.stderr
    assert "engine.host=0.0.0.0" in result.stderr


def test_k8s_escapes_dollar_in_the_argv(render):
    objects = _k8s(render, "tiny", "--set", "served_model_name=a$(B)$$c")
    args = _containers(objects)["proxy"]["args"]
    assert '["served_model_name", "a$$(B)$$$$c"]' in args[args.index("--set-json") + 1]


def test_k8s_model_pvc_and_unauthenticated(render):
    objects = _k8s(render, "tiny", "--model-pvc", "models", "--allow-unauthenticated", "--shm-size", "4Gi")
    pod = _by_kind(objects)["StatefulSet"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert "api-keys" not in volumes and volumes["dshm"]["emptyDir"]["sizeLimit"] == "4Gi"
    assert "--allow-unauthenticated" in _containers(objects)["proxy"]["args"]
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_k8s_output_dir_one_file_per_object(render, tmp_path):
    stdout_docs = _k8s(render, "tiny")
    out = tmp_path / "manifests"
    result = render("render", "k8s", "tiny", "--image", IMAGE, "--output", str(out))
    assert result.exit_code == ExitStatus.OK, result.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == ["configmap-molctl-tiny-profile.yaml", "service-molctl-tiny.yaml", "statefulset-molctl-tiny.yaml"]
    assert [yaml.safe_load((out / f).read_text()) for f in files] == [stdout_docs[0], stdout_docs[1], stdout_docs[2]]
    assert result.stdout.splitlines() == [
        f"wrote {out / f}"
        for f in ("configmap-molctl-tiny-profile.yaml", "service-molctl-tiny.yaml", "statefulset-molctl-tiny.yaml")
    ]


@pytest.mark.parametrize(
    ("args", "status", "says"),
    [
        (("render", "k8s", "nosuch", "--image", IMAGE), ExitStatus.CHECK_FAILED, "no profile named 'nosuch' (known:"),
        (
            ("render", "k8s", "tiny", "--image", IMAGE, "--replicas", "0"),
            ExitStatus.USAGE,
            "--replicas 0: expected at least 1",
        ),
        (
            ("render", "k8s", "tiny", "--image", IMAGE, "--replicas", "2147483648"),
            ExitStatus.USAGE,
            "--replicas 2147483648: expected 1 to 2147483647",
        ),
        (("render", "k8s", "tiny"), ExitStatus.USAGE, "--image is required"),
        (
            ("render", "k8s", "tiny", "--image", IMAGE, "--namespace", "Bad_NS"),
            ExitStatus.USAGE,
            "--namespace 'Bad_NS'",
        ),
        (("render", "k8s", "tiny", "--image", IMAGE, "--shm-size", "lots"), ExitStatus.USAGE, "--shm-size 'lots'"),
        (
            ("render", "k8s", "tiny", "--image", IMAGE, "--store-password-secret", "a:b:c d"),
            ExitStatus.USAGE,
            "--store-password-secret",
        ),
        (
            ("render", "k8s", "tiny", "--image", IMAGE, "--store", "postgres://x"),
            ExitStatus.CHECK_FAILED,
            "field 'proxy.store'",
        ),
        (
            ("render", "k8s", "tiny", "--image", IMAGE, "--set", "engine.gpus=-1"),
            ExitStatus.CHECK_FAILED,
            "engine.gpus",
        ),
        (("render", "systemd", "tiny"), ExitStatus.USAGE, "--api-key-file F"),
        (
            ("render", "systemd", "nosuch", "--allow-unauthenticated"),
            ExitStatus.CHECK_FAILED,
            "no profile named 'nosuch'",
        ),
    ],
)
def test_bad_inputs_one_line(render, args, status, says):
    result = render(*args)
    assert result.exit_code == status
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("molctl: error: ") and says in lines[0], result.stderr
    assert not render.state_dir.exists()


def test_bad_output_dir(render, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    result = render("render", "k8s", "tiny", "--image", IMAGE, "--output", str(a_file))
    assert result.exit_code == ExitStatus.USAGE and result.stderr.strip() == (
        f"molctl: error: --output {a_file}: exists and is not a directory"
    )
    result = render("render", "systemd", "tiny", "--allow-unauthenticated", "--output", str(a_file / "sub"))
    assert result.exit_code == ExitStatus.ERROR
    assert result.stderr.strip().startswith(f"molctl: error: --output {a_file / 'sub'}: cannot create it")
    assert a_file.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


# ------------------------------------------------------------------------------------ systemd


def _units(text: str) -> dict[str, dict[str, dict[str, list[str]]]]:
    """`{unit: {section: {key: [values]}}}` from `render systemd`'s stream (repeated keys kept)."""
    units: dict[str, dict[str, dict[str, list[str]]]] = {}
    unit = section = None
    for line in text.splitlines():
        if line.startswith("# ---- "):
            unit = line[len("# ---- ") :]
            units[unit] = {}
        elif line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            units[unit][section] = {}
        elif line and not line.startswith("#"):
            key, _, value = line.partition("=")
            units[unit][section].setdefault(key, []).append(value)
    return units


@pytest.mark.parametrize("profile", PROFILES)
def test_systemd_units(render, profile, tmp_path):
    prof = load_profile(profile, profile_dirs())
    key_file = tmp_path / "keys"  # named, never read: it need not exist
    result = render("render", "systemd", profile, "--api-key-file", str(key_file), "--drain-timeout", "120")
    assert result.exit_code == ExitStatus.OK, result.stderr
    assert not render.state_dir.exists()
    units = _units(result.stdout)
    engine = units[f"molctl-{profile}-engine.service"]["Service"]
    proxy_unit = units[f"molctl-{profile}-proxy.service"]
    proxy = proxy_unit["Service"]
    for service in (engine, proxy):
        assert service["KillMode"] == ["control-group"] and service["Restart"] == ["on-failure"]
    # systemd's start budget outlasts the readiness wait's own timeout, so the wait's one-line reason
    # (e.g. adapters missing) reaches the journal before systemd kills the start
    for service in (engine, proxy):
        wait_timeout = float(
            shlex.split(service["ExecStartPost"][0])[shlex.split(service["ExecStartPost"][0]).index("--timeout") + 1]
        )
        assert int(service["TimeoutStartSec"][0]) >= wait_timeout + 10
    assert engine["TimeoutStartSec"] == [str(math.ceil(prof.engine.start_timeout_s) + 10)]
    assert proxy["TimeoutStopSec"] == [str(120 + STOP_MARGIN_S)]
    assert engine["TimeoutStopSec"] == [str(math.ceil(ENGINE_STOP_TIMEOUT_S))]
    assert proxy_unit["Unit"]["Requires"] == proxy_unit["Unit"]["After"] == [f"molctl-{profile}-engine.service"]
    # the argv `up` runs on this host (this interpreter, this state dir, this key file)
    spawned = _up_spawns(
        profile, [], ["--api-key-file", str(key_file.resolve())], render.state_dir, [], drain_timeout_s=120.0
    )
    assert shlex.split(engine["ExecStart"][0]) == spawned["engine"][0]
    assert shlex.split(proxy["ExecStart"][0]) == spawned["proxy"][0]
    cache_env = get_engine(prof.engine.kind).cache_env(render.state_dir / profile / "engine-cache")
    assert engine["Environment"] == [f'"{k}={v}"' for k, v in {**cache_env, **prof.engine.env}.items()]
    assert engine["UnsetEnvironment"] == [" ".join(prof.engine.unset_env)]
    wait = shlex.split(engine["ExecStartPost"][0])
    assert wait[:5] == [sys.executable, "-m", "molctl.lifecycle.waitready", "engine", profile]
    assert shlex.split(proxy["ExecStartPost"][0])[3:5] == ["url", f"http://127.0.0.1:{prof.proxy.port}/readyz"]
    if shutil.which("systemd-analyze"):  # optional: the real parser, where systemd is installed
        out = tmp_path / "units"
        assert (
            render("render", "systemd", profile, "--api-key-file", str(key_file), "--output", str(out)).exit_code == 0
        )
        verify = subprocess.run(
            ["systemd-analyze", "verify", *sorted(str(p) for p in out.iterdir())],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=out,
        )
        assert verify.returncode == 0, verify.stderr


def test_systemd_store_and_overrides_reach_both_argvs(render, tmp_path):
    result = render(
        "render",
        "systemd",
        "tiny",
        "--allow-unauthenticated",
        "--store",
        "memory",
        "--set",
        "engine.port=9100",
        "--user",
        "molctl",
        "--proxy-arg=--log-backups=3",
    )
    units = _units(result.stdout)
    engine, proxy = (units[f"molctl-tiny-{c}.service"]["Service"] for c in ("engine", "proxy"))
    proxy_argv = shlex.split(proxy["ExecStart"][0])
    assert proxy_argv[proxy_argv.index("--upstream") + 1] == "http://127.0.0.1:9100"
    assert '["proxy.store", "memory"]' in proxy_argv[proxy_argv.index("--set-json") + 1]
    wait = shlex.split(engine["ExecStartPost"][0])
    assert wait[wait.index("--set-json") + 1] == proxy_argv[proxy_argv.index("--set-json") + 1]
    assert engine["User"] == proxy["User"] == ["molctl"]
    assert proxy_argv[-1] == "--log-backups=3"


def test_systemd_user_warned_of_paths_in_the_renderers_home(render, tmp_path):
    """`--user molctl` run by another user whose home holds the model root (the profile's ~): the
    units would name paths that user may not reach (a 0700 home): render warns and names them."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    result = render(
        "render",
        "systemd",
        "tiny",
        "--allow-unauthenticated",
        "--user",
        "molctl",
        "--model-root",
        str(home / "models"),
        env={"HOME": str(home)},
    )
    assert result.exit_code == ExitStatus.OK, result.stderr
    assert "--user molctl" in result.stderr and str(home / "models") in result.stderr
    elsewhere = render(
        "render",
        "systemd",
        "tiny",
        "--allow-unauthenticated",
        "--user",
        "molctl",
        "--model-root",
        str(tmp_path / "srv"),
        env={"HOME": str(home)},
    )
    assert elsewhere.exit_code == ExitStatus.OK and elsewhere.stderr == ""


# ------------------------------------------------------------------------------------ waitready


def _waitready(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    from tests.helpers import ROOT

    return subprocess.run(
        [sys.executable, "-m", "molctl.lifecycle.waitready", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_waitready_engine_against_the_fake_engine():
    port = free_port()
    set_json = f'[["engine.port", {port}]]'
    with running(fake_engine_argv(port), f"http://127.0.0.1:{port}/health"):
        ok = _waitready("engine", "tiny", "--timeout", "30", "--set-json", set_json)
        assert ok.returncode == 0, ok.stderr
        assert "engine ready" in ok.stderr
    missing_port = free_port()
    with running(
        fake_engine_argv(missing_port, {"adapters": ["L0", "L1", "L2"]}), f"http://127.0.0.1:{missing_port}/health"
    ):
        bad = _waitready("engine", "tiny", "--timeout", "30", "--set-json", f'[["engine.port", {missing_port}]]')
        assert bad.returncode == ExitStatus.ADAPTERS and "adapter L3 is missing" in bad.stderr


def test_waitready_says_the_eta_and_records_the_start_in_the_state_dir(tmp_path):
    """The systemd readiness step: no ETA on the first start, one from the history on the next."""
    from molctl.lifecycle import starthistory

    port = free_port()
    set_json = f'[["engine.port", {port}]]'
    with running(fake_engine_argv(port), f"http://127.0.0.1:{port}/health"):
        args = ("engine", "tiny", "--timeout", "30", "--set-json", set_json, "--state-dir", str(tmp_path))
        first = _waitready(*args)
        assert first.returncode == 0 and "no ETA yet" in first.stderr, first.stderr
        second = _waitready(*args)
        assert second.returncode == 0 and "ETA " in second.stderr and "median of 1 earlier start" in second.stderr
    assert [s["engine"] for s in starthistory.load(tmp_path, "tiny")] == ["vllm", "vllm"]


def test_waitready_url_times_out_on_a_closed_port():
    port = free_port()
    result = _waitready("url", f"http://127.0.0.1:{port}/readyz", "--timeout", "1")
    assert result.returncode == ExitStatus.TIMEOUT
    assert f"http://127.0.0.1:{port}/readyz is not answering" in result.stderr


@pytest.mark.parametrize(
    "option",
    [
        ["--model-root", "/srv/m\nExecStartPre=/bin/touch /tmp/pwned"],
        ["--set", 'engine.env.FOO="a\\nExecStartPre=/bin/touch /tmp/pwned"'],
    ],
)
def test_systemd_refuses_a_value_with_a_line_break(render, tmp_path, option):
    """A line break in the model root or an engine variable was written as is: the unit got an
    extra `ExecStartPre=` line (found feeding render hostile values)."""
    result = render("render", "systemd", "tiny", "--allow-unauthenticated", *option, "--output", str(tmp_path / "out"))
    assert result.exit_code == ExitStatus.USAGE
    assert "line break" in result.stderr and result.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_url_with_credentials_in_engine_env_is_refused(render):
    """What `lock` redacts, render refuses: a value holding `user:password@` would be written into
    the unit or the Deployment in clear."""
    for kind in (("k8s", "--image", IMAGE), ("systemd", "--allow-unauthenticated")):
        result = render(
            "render", kind[0], "tall", *kind[1:], "--set", "engine.env.HF_ENDPOINT=https://u:s3cr3t@mirror/hf"
        )
        assert result.exit_code == ExitStatus.CHECK_FAILED and result.stdout == ""
        assert "field 'engine.env.HF_ENDPOINT': its value is a URL with a user name or password" in result.stderr
        assert "s3cr3t" not in result.stderr
        ok = render("render", kind[0], "tall", *kind[1:], "--set", "engine.env.HF_ENDPOINT=https://mirror/hf")
        assert ok.exit_code == ExitStatus.OK, ok.stderr
