"""`molctl render` output that systemd and Kubernetes accept and run as meant: systemd unit lines,
stop timeouts and specifiers, Kubernetes names, env expansion, probes and preStop hooks, and secrets
refused in engine args. The systemd command lines are split as systemd 252 splits them
(`_systemd_words`), not as a shell would."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml

from molctl.errors import ExitStatus
from tests.helpers import Molctl

IMAGE = "registry.example/molctl:1"
_ESCAPES = {
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    "\\": "\\",
    '"': '"',
    "'": "'",
    "s": " ",
}


@pytest.fixture
def render(tmp_path, monkeypatch) -> Molctl:
    monkeypatch.delenv("MOLCTL_PROFILES_DIR", raising=False)
    return Molctl(tmp_path / "never-created", in_process=True)


def _systemd_words(value: str, *, exec_line: bool) -> list[str]:
    """A unit setting's words as systemd reads them (src/core/load-fragment.c, extract_first_word
    with EXTRACT_UNQUOTE|EXTRACT_CUNESCAPE): `%%` is `%` (any other `%X` is a specifier: refused
    here), single and double quotes group, C escapes are decoded; on an Exec line `$$` is `$` (a
    lone `$VAR` would be expanded: refused here)."""
    if re.search(r"%[^%]", value.replace("%%", "")):
        raise AssertionError(f"a systemd specifier in {value!r}")
    value = value.replace("%%", "%")
    words, i = [], 0
    while True:
        while i < len(value) and value[i] in " \t":
            i += 1
        if i >= len(value):
            return words
        word, quote = [], None
        while i < len(value):
            c = value[i]
            if c == "\\":
                nxt = value[i + 1 : i + 2]
                word.append(_ESCAPES.get(nxt, "\\" + nxt))
                i += 2
            elif quote:
                quote = None if c == quote else quote
                word += [] if quote is None else [c]
                i += 1
            elif c in " \t":
                break
            elif c in "\"'":
                quote, i = c, i + 1
            else:
                word.append(c)
                i += 1
        assert quote is None, f"unterminated quote in {value!r}"
        text = "".join(word)
        if exec_line:
            assert "$" not in text.replace("$$", ""), f"systemd would expand a variable in {text!r}"
            text = text.replace("$$", "$")
        words.append(text)


def _unit(text: str) -> dict[str, list[str]]:
    """`{key: [values]}` of one unit file (sections merged, repeated keys kept)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def _render_units(render: Molctl, tmp_path: Path, profile: str, *args: str, env: dict | None = None) -> dict[str, dict]:
    out = tmp_path / "units"
    result = render("render", "systemd", profile, *args, "--output", str(out), env=env)
    assert result.exit_code == ExitStatus.OK, result.stderr
    return {p.name.rsplit("-", 1)[1].removesuffix(".service"): _unit(p.read_text()) for p in out.iterdir()}


# ------------------------------------------------------------------------------------ systemd


def test_systemd_units_name_the_profile_folders_of_molctl_profiles_dir(render, tmp_path):
    """A profile found through MOLCTL_PROFILES_DIR: `up` passes the variable on to the proxy it
    spawns, but a unit does not inherit the renderer's environment: the proxy (and the readiness
    wait) were started without that folder and failed with 'no profile named ...'."""
    folder = tmp_path / "my profiles"
    folder.mkdir()
    source = (Path(__file__).resolve().parents[2] / "profiles" / "tiny.yaml").read_text()
    (folder / "mine.yaml").write_text(source.replace("name: tiny", "name: mine", 1))
    env = {"MOLCTL_PROFILES_DIR": f"{tmp_path / 'missing'}:{folder}"}
    units = _render_units(render, tmp_path, "mine", "--allow-unauthenticated", env=env)
    for unit, key in (("proxy", "ExecStart"), ("engine", "ExecStartPost")):  # the proxy, the engine's readiness wait
        argv = _systemd_words(units[unit][key][0], exec_line=True)
        dirs = [argv[i + 1] for i, a in enumerate(argv) if a == "--profiles-dir"]
        assert dirs == [str(folder.resolve())], (
            unit,
            key,
            argv,
        )  # a folder that does not exist is skipped, as up skips it


def test_systemd_stop_timeout_zero_is_not_an_infinite_stop(render, tmp_path):
    """`--stop-timeout 0` (SIGKILL right after SIGTERM, as `down --stop-timeout 0`) was rendered
    `TimeoutStopSec=0`, which systemd reads as no timeout at all (load-fragment.c,
    config_parse_service_timeout: 0 becomes USEC_INFINITY): a hung engine was never killed."""
    units = _render_units(
        render, tmp_path, "tiny", "--allow-unauthenticated", "--stop-timeout", "0", "--drain-timeout", "0"
    )
    for unit in ("engine", "proxy"):
        for key in ("TimeoutStopSec", "TimeoutStartSec"):
            assert int(units[unit][key][0]) >= 1, (unit, key)


def test_systemd_description_escapes_specifiers(render, tmp_path):
    """Description= is subject to specifier expansion: a served model name `Tiny %i 100%` became
    `Tiny  100` plus a bad-specifier error in the journal (`%i` the empty instance)."""
    units = _render_units(
        render,
        tmp_path,
        "tiny",
        "--allow-unauthenticated",
        "--set",
        "served_model_name=Tiny %i 100%",
        "--set",
        "engine.served_name=base%n",
    )
    for unit, text in (("proxy", "Tiny %i 100%"), ("engine", "base%n")):
        description = units[unit]["Description"][0]
        assert not re.search(r"%[^%]", description.replace("%%", "")), description
        assert text in description.replace("%%", "%")


# ------------------------------------------------------------------------------------ Kubernetes


def _k8s(render: Molctl, profile: str, *extra: str) -> list[dict]:
    result = render("render", "k8s", profile, "--image", IMAGE, *extra)
    assert result.exit_code == ExitStatus.OK, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d is not None]


def _containers(objects: list[dict]) -> dict[str, dict]:
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    return {c["name"]: c for c in sts["spec"]["template"]["spec"]["containers"]}


def _k8s_expand(value: str, defined: dict[str, str]) -> str:
    """What the kubelet makes of an env value or an arg (k8s.io/kubernetes third_party/forked/
    golang/expansion): `$$` is `$`, `$(NAME)` of a variable defined before it is its value."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else defined.get(m.group(1), m.group(0)),
        value,
    )


def test_k8s_engine_env_values_survive_kubernetes_expansion(render):
    """Kubernetes expands `$(VAR)` and reads `$$` as `$` in env values as in args (EnvVar.value):
    the args were escaped, the engine's `engine.env` values were not, so `a$$b` reached the engine
    as `a$b` and `$(HOME)` as another variable's value, not what `up` sets."""
    value = "a$$b $(POD_NAME) $(HF_HUB_OFFLINE) 100%"
    objects = _k8s(render, "tiny", "--set", f"engine.env.WEIRD={value}")
    env = _containers(objects)["engine"]["env"]
    defined: dict[str, str] = {}
    for var in env:  # each value expanded against the variables defined before it, as the kubelet does
        defined[var["name"]] = _k8s_expand(var["value"], defined)
    assert defined["WEIRD"] == value
    assert defined["HF_HUB_OFFLINE"] == "1"


def _proxy_profile(objects: list[dict]):
    """The profile the rendered proxy runs with: the file with its `--set-json` overrides."""
    import json

    from molctl import stackconfig
    from molctl.profiles import profile_dirs

    args = _containers(objects)["proxy"]["args"]
    overrides = [tuple(o) for o in json.loads(_k8s_expand(args[args.index("--set-json") + 1], {}))]
    return stackconfig.load(args[args.index("proxy") + 1], profile_dirs(), overrides)[0]


def test_k8s_metrics_listener_is_reachable_on_the_pod_ip(render):
    """proxy.metrics_port: the proxy container declared a `metrics` port for a scrape config or a
    PodMonitor, but the listener stayed on proxy.metrics_host's default 127.0.0.1, the pod's
    loopback, so no scrape could reach it. Render now sets proxy.metrics_host=0.0.0.0 (still not on
    the Service); the user's --set still wins."""
    objects = _k8s(render, "tiny", "--set", "proxy.metrics_port=9400")
    assert _proxy_profile(objects).proxy.metrics_host == "0.0.0.0"
    service = next(o for o in objects if o["kind"] == "Service")
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]
    mine = _k8s(render, "tiny", "--set", "proxy.metrics_port=9400", "--set", "proxy.metrics_host=127.0.0.1")
    assert _proxy_profile(mine).proxy.metrics_host == "127.0.0.1"
    without = _k8s(render, "tiny")  # no listener: nothing added
    assert (
        "metrics_host"
        not in _containers(without)["proxy"]["args"][_containers(without)["proxy"]["args"].index("--set-json") + 1]
    )


def _one_line_error(result, status: ExitStatus) -> str:
    assert result.exit_code == status, (result.exit_code, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("molctl: error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("bad", ["a" * 53, "1molctl"])
def test_k8s_name_the_api_server_or_the_statefulset_controller_would_refuse(render, bad):
    """`--name` accepted any DNS label of up to 63: a Service name must start with a letter
    (DNS-1035), and a StatefulSet named over 52 characters is accepted by the API server but never
    gets a pod: each pod carries the label controller-revision-hash=NAME-<10 characters>, a
    label value of at most 63 (kubernetes/kubernetes#64023)."""
    line = _one_line_error(render("render", "k8s", "tiny", "--image", IMAGE, "--name", bad), ExitStatus.USAGE)
    assert f"--name {bad!r}" in line and "52" in line
    assert _k8s(render, "tiny", "--name", "a" * 52)  # the longest that works


def test_k8s_default_name_of_a_long_profile_says_to_give_name(render, tmp_path):
    """A profile named over 45 characters: the default name molctl-PROFILE is too long, and the
    error blamed `--name`, which the user never gave."""
    folder = tmp_path / "profiles"
    folder.mkdir()
    long = "a-very-long-profile-name-for-the-staging-cluster-x"
    source = (Path(__file__).resolve().parents[2] / "profiles" / "tiny.yaml").read_text()
    (folder / f"{long}.yaml").write_text(source.replace("name: tiny", f"name: {long}", 1))
    cli = Molctl(tmp_path / "never-created", [folder], in_process=True)
    line = _one_line_error(cli("render", "k8s", long, "--image", IMAGE), ExitStatus.USAGE)
    assert f"the default name 'molctl-{long}'" in line and "give --name" in line
    result = cli("render", "k8s", long, "--image", IMAGE, "--name", "staging")
    assert result.exit_code == ExitStatus.OK, result.stderr
    unknown = cli("render", "k8s", long + "-nosuch", "--image", IMAGE)  # an unknown profile is still exit 3
    assert unknown.exit_code == ExitStatus.CHECK_FAILED and "no profile named" in unknown.stderr


def test_k8s_profile_name_that_is_no_label_value_is_refused(render, tmp_path):
    """A profile named `tiny-` (the profile rule allows a trailing '-'): every object carried the
    label molctl.io/profile=tiny-, which the API server refuses (a label value ends in a letter or
    digit); render wrote it and blamed nothing."""
    folder = tmp_path / "profiles"
    folder.mkdir()
    source = (Path(__file__).resolve().parents[2] / "profiles" / "tiny.yaml").read_text()
    (folder / "tiny-.yaml").write_text(source.replace("name: tiny", "name: tiny-", 1))
    cli = Molctl(tmp_path / "never-created", [folder], in_process=True)
    line = _one_line_error(cli("render", "k8s", "tiny-", "--image", IMAGE, "--name", "tiny"), ExitStatus.CHECK_FAILED)
    assert "'tiny-'" in line and "label value" in line


@pytest.mark.parametrize(
    ("flag", "value", "secret"),
    [
        ("api-key", "sk-engine-123", "sk-engine-123"),  # vLLM / SGLang --api-key
        ("hf-token", "hf_abc123", "hf_abc123"),  # vLLM --hf-token
        ("otlp-traces-endpoint", "https://user:s3cr3t@otel.internal:4318", "s3cr3t"),
    ],
)
def test_a_secret_in_engine_args_is_refused(render, flag, value, secret):
    """Render refused secrets in engine.env but wrote `engine.args.api-key` (and a URL with a
    password) in clear into the container args, the proxy's --set-json and the ConfigMap, or the
    units' ExecStart=: 'render never writes a secret' (contract, section 9)."""
    for kind in (("k8s", "--image", IMAGE), ("systemd", "--allow-unauthenticated")):
        result = render("render", kind[0], "tiny", *kind[1:], "--set", f"engine.args.{flag}={value}")
        line = _one_line_error(result, ExitStatus.CHECK_FAILED)
        assert f"engine.args.{flag}" in line and secret not in line
    for harmless in ("max-num-batched-tokens=8192", "tokenizer-mode=auto", "ssl-keyfile=/etc/tls/key.pem"):
        ok = render("render", "k8s", "tiny", "--image", IMAGE, "--set", f"engine.args.{harmless}")
        assert ok.exit_code == ExitStatus.OK, ok.stderr


class _ProxyHealth:
    """A stand-in for the proxy's GET /health on 127.0.0.1: `{"status": "ok"}` until `drain_at`
    seconds, `{"status": "draining"}` until `gone_at`, then nothing listens (the proxy exited)."""

    def __init__(self, drain_at: float, gone_at: float):
        import http.server
        import json
        import threading
        import time

        start = time.monotonic()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (the http.server name)
                status = "ok" if time.monotonic() - start < drain_at else "draining"
                body = json.dumps({"status": status}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.closed_at: float | None = None
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.timer = threading.Timer(gone_at, self.close)
        self.timer.start()

    def close(self) -> None:
        """Stop answering; `closed_at` is when it began (a client may see it go before this returns)."""
        if self.closed_at is None:
            self.closed_at = time.monotonic()
        self.timer.cancel()
        self.server.shutdown()
        self.server.server_close()


def test_k8s_engine_prestop_waits_for_a_draining_proxy_only(render):
    """The engine's preStop waited until the proxy's /health stopped answering, up to the whole
    drain budget. But the kubelet runs a preStop also when it restarts the container alone after a
    failed liveness or startup probe (Container Lifecycle Hooks: 'due to an API request or
    management event such as a liveness/startup probe failure'): the proxy keeps running, so a hung
    engine was restarted only after 5 + drain + 15 s (620 s by default). Now it waits only while
    the proxy drains (/health says `draining`), which it does within the proxy's preStop delay.
    What is checked is the order of events, not a margin of seconds (a 13 s bound failed on a loaded
    machine): the restart's preStop ends while its proxy still answers, well inside its budget; the
    pod stop's only after its proxy has gone."""
    import subprocess
    import sys

    from molctl.render import DRAIN_SEEN_WITHIN_S, PRESTOP_DELAY_S

    restart, pod_stop = _ProxyHealth(drain_at=1e9, gone_at=1e9), _ProxyHealth(drain_at=1, gone_at=PRESTOP_DELAY_S + 7)
    runs: dict[str, tuple[float, subprocess.Popen]] = {}
    ended: dict[str, float] = {}
    try:
        for label, proxy in (("restart", restart), ("pod_stop", pod_stop)):
            objects = _k8s(
                render, "tiny", "--python", sys.executable, "--drain-timeout", "60", "--set", f"proxy.port={proxy.port}"
            )
            command = _containers(objects)["engine"]["lifecycle"]["preStop"]["exec"]["command"]
            runs[label] = (time.monotonic(), subprocess.Popen(command))
        budget = float(command[-1])  # 5 + 60 + 15 s: the wait for a drain that never ends
        deadline = time.monotonic() + budget + 30
        while len(ended) < len(runs) and time.monotonic() < deadline:
            for label, (_, proc) in runs.items():
                if label not in ended and proc.poll() is not None:
                    ended[label] = time.monotonic()
            time.sleep(0.05)
    finally:
        restart.close()
        pod_stop.close()
        for _, proc in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    took = {label: ended[label] - runs[label][0] for label in ended}
    assert set(ended) == set(runs), took
    # the engine alone restarts: it gives a drain DRAIN_SEEN_WITHIN_S to show, then no wait
    assert DRAIN_SEEN_WITHIN_S <= took["restart"] < budget and ended["restart"] < restart.closed_at, took
    # the pod stops: it waits until the proxy has drained and exited
    assert pod_stop.closed_at is not None and ended["pod_stop"] >= pod_stop.closed_at, took


def test_k8s_engine_restart_after_a_failed_probe_has_its_own_grace(render):
    """A failed liveness or startup probe restarts the engine container within the pod's
    terminationGracePeriodSeconds (680 s by default: sized for the proxy's whole drain) unless the
    probe names its own (Probe.terminationGracePeriodSeconds, GA in 1.28): a hung engine that
    ignores SIGTERM was SIGKILLed only after 11 minutes. Its budget is the preStop's wait for a
    drain that does not come, the engine's --stop-timeout and the margin."""
    import kubernetes_validate

    from molctl.render import DRAIN_SEEN_WITHIN_S, STOP_MARGIN_S

    objects = _k8s(render, "venti", "--stop-timeout", "90")
    engine = _containers(objects)["engine"]
    pod_grace = next(o for o in objects if o["kind"] == "StatefulSet")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    for probe in ("startupProbe", "livenessProbe"):
        grace = engine[probe]["terminationGracePeriodSeconds"]
        assert DRAIN_SEEN_WITHIN_S + 90 <= grace <= DRAIN_SEEN_WITHIN_S + 90 + STOP_MARGIN_S < pod_grace, (probe, grace)
    for obj in objects:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)


@pytest.mark.parametrize(
    "profile, flag, value",
    [
        ("venti", "long-prefill-token-threshold", "2048"),
        ("venti", "return-tokens-as-token-ids", "true"),
        ("venti", "allow-credentials", "true"),
        ("venti", "ssl-keyfile", "/etc/tls/key.pem"),
        ("venti", "max-num-batched-tokens", "8192"),
        ("venti", "hf-token", "true"),
        ("venti-sglang", "bucket-time-to-first-token", "[0.1, 0.5]"),
        ("venti-sglang", "bucket-inter-token-latency", "[0.01, 0.05]"),
    ],
)
def test_ordinary_engine_flags_are_not_taken_for_secrets(render, profile, flag, value):
    """Guards a found bug: the secret-flag rule matched any word of a flag's name, so
    vLLM's long-prefill-token-threshold, return-tokens-as-token-ids, allow-credentials and SGLang's
    bucket-*-token buckets made render exit 3 (and check warn). A secret flag's name now ends in
    the secret word and its value is text (vLLM's bare --hf-token uses the cached login)."""
    result = render("render", "systemd", profile, "--allow-unauthenticated", "--set", f"engine.args.{flag}={value}")
    assert result.exit_code == ExitStatus.OK, result.stderr


@pytest.mark.parametrize(
    "name, value",
    [
        ("GOOGLE_APPLICATION_CREDENTIALS", "/var/run/gcp/sa.json"),
        ("AWS_SHARED_CREDENTIALS_FILE", "/etc/aws/credentials"),
        ("TOKENIZERS_PARALLELISM", "false"),
    ],
)
def test_variables_that_name_where_a_secret_is_are_not_secrets(render, name, value):
    """Guards a found bug: GOOGLE_APPLICATION_CREDENTIALS (a path) was refused once
    CREDENTIAL joined the secret names; the lock pins them in clear too."""
    from molctl.redaction import redact_value

    result = render("render", "systemd", "venti", "--allow-unauthenticated", "--set", f"engine.env.{name}={value}")
    assert result.exit_code == ExitStatus.OK, result.stderr
    assert redact_value(name, value) == value
    assert redact_value("HF_TOKEN", "hf_x") == "<redacted>" and redact_value("MY_DB_PASSWD", "x") == "<redacted>"
