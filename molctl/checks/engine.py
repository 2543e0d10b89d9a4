"""Engine checks, run under `engine.python`: the package imports, its version matches the pin
(a local suffix such as +cu130 or +cpu is ignored), and every flag the profile passes is
accepted by that installed version, so a typo or a removed flag fails here, not after a load.
The probe's answer is cached in STATE/cache per installed package (see probe_install_cached)."""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from molctl.checks.result import CheckResult, Probes, describe
from molctl.engines import get_engine
from molctl.engines.base import probe_install_cached
from molctl.profiles import Profile


def run(profile: Profile, probes: Probes) -> list[CheckResult]:
    engine = get_engine(profile.engine.kind)
    python = profile.engine_python
    cache = probes.state_dir / "cache" if probes.state_dir is not None and probes.state_dir.is_dir() else None
    install = probe_install_cached(engine, python, cache)
    if not install.found:
        why = install.error or f"package {engine.package!r} is not importable"
        return [CheckResult("engine.package", "fail", f"{why} (engine.python = {python})")]
    if install.error and not install.flags:
        return [CheckResult("engine.package", "fail", f"{engine.package} under {python}: {install.error}")]
    note = f"; {install.note}" if install.note else ""
    out = [CheckResult("engine.package", "pass", f"{engine.package} importable by {python}{note}")]

    pin = SpecifierSet(profile.engine.version)
    try:
        version = Version(install.version or "")
        public = Version(version.public)
    except InvalidVersion:
        out.append(
            CheckResult(
                "engine.version",
                "fail",
                f"{engine.package} reports version {install.version!r}, which is not a version",
            )
        )
        public = None
    if public is not None:
        if pin.contains(public, prereleases=True):
            note = "" if engine.shortens_max_tokens(str(public)) else engine.overflow_note
            out.append(CheckResult("engine.version", "pass", f"{engine.package} {install.version} matches {pin}{note}"))
        else:
            out.append(
                CheckResult(
                    "engine.version",
                    "fail",
                    f"{engine.package} {install.version} under {python} does not match engine.version {pin}",
                )
            )

    endpoint = profile.engine.otlp_traces_endpoint
    if endpoint and install.trace_missing:
        out.append(
            CheckResult(
                "engine.tracing",
                "fail",
                f"engine.otlp_traces_endpoint is set ({endpoint}) but {python} lacks "
                f"{describe(list(install.trace_missing), 3)}, which {engine.package}'s tracing imports: "
                f"{engine.trace_install} there, or unset engine.otlp_traces_endpoint",
            )
        )
    elif endpoint and install.trace_missing is not None:
        out.append(
            CheckResult("engine.tracing", "pass", f"OpenTelemetry's SDK and OTLP exporters importable by {python}")
        )

    passed = engine.profile_flags(profile)
    unknown = [f"--{f}" for f in passed if f not in install.flags]
    if unknown:
        out.append(
            CheckResult(
                "engine.flags",
                "fail",
                f"{engine.package} {install.version} does not accept {describe(unknown, 5)} (from {profile.source} "
                "engine.args)",
            )
        )
    else:
        out.append(
            CheckResult(
                "engine.flags", "pass", f"all {len(passed)} flags accepted by {engine.package} {install.version}"
            )
        )
    return out
