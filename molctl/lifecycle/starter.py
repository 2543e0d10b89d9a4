"""One `up`'s components: spawn the engine and the proxy, record them, watch them until they
serve, run the canary, and stop what was started when that fails (`_Starter`); the errors a
start raises (`StartFailed`) and a component an earlier invocation started (`Adopted`)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from molctl import enginecache
from molctl.claims import Claim, ClaimConflict, HostClaims, claim_components, holder_info, release_all
from molctl.engines import get_engine
from molctl.errors import ExitStatus, MolctlError
from molctl.lifecycle import canary, starthistory
from molctl.lifecycle.launch import UpOptions, engine_argv, engine_env, proxy_argv
from molctl.lifecycle.progress import Progress
from molctl.lifecycle.readiness import EngineReadiness, http_status, wait_ready
from molctl.lifecycle.stacks import component_url
from molctl.lifecycle.stopsignals import _one_more_interrupt, interrupted_by
from molctl.phases import PhaseClock
from molctl.processes import kill_fresh, members, new_marker, record_for, spawn, stop, tail
from molctl.profiles import Profile
from molctl.state import (
    Record,
    is_same_process,
    new_log_path,
    prune_logs,
    read_records,
    record_path,
    remove_record,
    write_record,
)

PROXY_READY_TIMEOUT_S = 60.0
PROXY_RESTARTS = 3  # a proxy that dies while the engine loads is restarted, the engine kept


class StartFailed(MolctlError):
    """The engine or proxy exited, timed out or lacks adapters during start-up."""

    def __init__(self, message: str, exit_status: ExitStatus, log_tail: list[str] | None = None):
        super().__init__(message, exit_status)
        self.log_tail = log_tail or []


class Adopted:
    """A component started by an earlier invocation, watched like a Popen (poll() only)."""

    def __init__(self, record: Record):
        self.record = record

    def poll(self) -> int | None:
        return None if is_same_process(self.record) else -1


def _keep_logs(profile: Profile) -> int:
    return int(getattr(getattr(profile, "logs", None), "keep", 10) or 0)


class _Starter:
    """Spawns and watches the components of one `up`; stops what it started when that fails."""

    def __init__(self, profile: Profile, config: dict, ctx, opts: UpOptions, key_args: list[str], progress: Progress):
        self.profile, self.config, self.opts, self.key_args = profile, config, opts, key_args
        self.state_dir, self.name = ctx.state_dir, profile.name
        self.progress = progress
        self.started: list[Record] = []
        self.proxy: tuple[Record, Any] | None = None
        self.proxy_restarts = 0
        self.estimate = starthistory.estimate(self.state_dir, self.name)
        self.phases: PhaseClock | None = None  # set when this `up` spawns the engine (not for an adopted one)
        self.cache: dict[str, Any] = {}  # the engine cache dir and whether it held anything (molctl.enginecache)

    # spawning ---------------------------------------------------------------------------------
    def _spawn(
        self, component: str, argv: list[str], env: dict[str, str], port: int, host: str, claims: list[Claim]
    ) -> tuple[Record, Any]:
        log_path = new_log_path(self.state_dir, self.name, component)
        in_use = {r.log for r in read_records(self.state_dir, self.name).values()}
        prune_logs(self.state_dir, self.name, component, max(_keep_logs(self.profile) - 1, 0), in_use)
        rpath = record_path(self.state_dir, self.name, component)
        marker = new_marker(rpath)
        proc = spawn(argv, env, log_path, marker=marker, pass_fds=[c.fd for c in claims if c.fd is not None])
        record = None
        try:
            for claim in claims:  # the component holds its claims now, for as long as it lives
                claim.set_holder(
                    holder_info(self.name, component, self.state_dir, pid=proc.pid, command=f"up {self.name}")
                )
                claim.release()
            record = record_for(component, proc, argv, port, log_path, marker, host=host, config=self.config)
            write_record(self.state_dir, self.name, record)
            self.started.append(record)
        except BaseException as exc:
            if record is None or record not in self.started:  # not known to the clean-up yet: stop it here
                kill_fresh(proc)
                if record is not None and isinstance(exc, KeyboardInterrupt):
                    remove_record(self.state_dir, self.name, component)
            if isinstance(exc, OSError):
                raise MolctlError(
                    f"could not write the {component} record {rpath}: {exc.strerror or exc}; "
                    f"the {component} (pid {proc.pid}) was stopped"
                ) from None
            raise
        self.progress.step(f"{component} started (pid {proc.pid}), log: {log_path}")
        return record, proc

    def prepare_cache(self) -> None:
        """The engine's persistent cache dir, created; whether an earlier start left it warm."""
        self.cache = enginecache.prepare(self.profile, self.state_dir)
        state = "warm (kept from earlier starts)" if self.cache["warm"] else "empty (this start fills it)"
        self.progress.step(f"engine cache {self.cache['dir']}: {state}")

    def start_engine(self, claims: list[Claim]) -> tuple[Record, Any]:
        argv = engine_argv(self.profile)
        env = engine_env(self.profile, cache_dir=enginecache.cache_dir(self.profile, self.state_dir))
        return self._spawn("engine", argv, env, self.profile.engine.port, self.profile.engine.host, claims)

    def watch_phases(self, record: Record) -> None:
        """Follow the phases of the engine this `up` just spawned; say what the ETA is."""
        self.phases = PhaseClock(get_engine(self.profile.engine.kind).phases, record.log)
        self.progress.step(starthistory.eta_text(self.estimate, 0.0, "config"))

    def enter(self, phase: str) -> None:
        """molctl's own phases (canary, proxy) of a start this `up` spawned the engine of."""
        if self.phases is not None:
            self.phases.feed_log()
            self.phases.enter(phase)

    def record_start(self) -> dict[str, Any] | None:
        """After a start that ends ready: its phases into this host's history (STATE/PROFILE/
        starts.json) and the engine record (`status`); returns `timings.phases`. A history that
        cannot be written is a warning: the stack serves."""
        if self.phases is None:
            return None
        total = self.phases.elapsed()
        phases = self.phases.durations(total)
        self.cache["compile_cache"] = self.phases.compile_cache
        kind = self.profile.engine.kind
        try:
            starthistory.append(
                self.state_dir,
                self.name,
                starthistory.entry(total, phases, kind, "warm" if self.cache.get("warm") else "empty"),
            )
        except OSError as exc:
            where = starthistory.history_path(self.state_dir, self.name)
            self.progress.warn(f"could not record this start's phases in {where}: {exc.strerror or exc}")
        record = read_records(self.state_dir, self.name).get("engine")
        if record is not None:
            record.extra = {
                **record.extra,
                "start": {"total_s": round(total, 2), "phases": phases},
                "cache": self.cache,
            }
            try:
                write_record(self.state_dir, self.name, record)
            except OSError as exc:
                self.progress.warn(f"could not write the start's phases into the engine record: {exc.strerror or exc}")
        return {"total_s": round(total, 2), "phases": phases}

    def start_proxy(self, claims: list[Claim] | None, upstream: str) -> tuple[Record, Any]:
        if claims is None:
            try:
                claims = claim_components(HostClaims(), self.profile, self.state_dir, ["proxy"], f"up {self.name}")[
                    "proxy"
                ]
            except ClaimConflict as exc:
                raise StartFailed(f"cannot restart the proxy: {exc}", ExitStatus.CONFLICT) from None
        try:
            argv = proxy_argv(
                self.profile, self.opts, self.key_args, upstream, state_dir=Path(self.state_dir).absolute()
            )
            return self._spawn(
                "proxy", argv, dict(os.environ), self.profile.proxy.port, self.profile.proxy.host, claims
            )
        finally:
            release_all({"proxy": claims})

    def _proxy_exited(self, code: int, upstream: str) -> None:
        """The proxy died while the stack starts: restart it (bounded), keep the engine."""
        record, _ = self.proxy
        if self.proxy_restarts >= PROXY_RESTARTS:
            raise StartFailed(
                f"the proxy exited with code {code} during start-up, also after {PROXY_RESTARTS} "
                f"restarts (log: {record.log})",
                ExitStatus.START_FAILED,
                tail(record.log, 80),
            )
        self.proxy_restarts += 1
        self.progress.step(
            f"the proxy exited with code {code} (log: {record.log}); restarting it "
            f"({self.proxy_restarts} of {PROXY_RESTARTS}), the engine keeps running"
        )
        stop(record, 5.0)
        remove_record(self.state_dir, self.name, "proxy")
        self.started = [r for r in self.started if r is not record]
        self.proxy = self.start_proxy(None, upstream)

    # waiting ----------------------------------------------------------------------------------
    def wait_engine(self, record: Record, proc, timeout: float) -> None:
        profile = self.profile
        engine = get_engine(profile.engine.kind)
        upstream = component_url(record)

        def check_alive() -> None:
            code = proc.poll()
            if code is not None:
                raise StartFailed(
                    f"the engine exited with code {code} during start-up (log: {record.log})",
                    ExitStatus.START_FAILED,
                    tail(record.log, 80),
                )
            if self.proxy is not None:
                pcode = self.proxy[1].poll()
                if pcode is not None:
                    self._proxy_exited(pcode, upstream)

        def on_wait(elapsed: float, probe) -> None:
            if self.phases is None:  # an adopted engine: its phase from its log's tail
                self.progress.waiting(elapsed, timeout, engine.phase(tail(record.log, 50)) or "starting", probe.detail)
                return
            self.phases.feed_log()
            eta = starthistory.eta_text(self.estimate, self.phases.elapsed(), self.phases.current)
            self.progress.waiting(elapsed, timeout, self.phases.label(), probe.detail, eta=eta)

        probe, elapsed = wait_ready(
            EngineReadiness(profile, engine, url=upstream), timeout, check_alive=check_alive, on_wait=on_wait
        )
        if probe.state == "ready":
            self.progress.step(f"engine ready after {elapsed:.1f} s")
            return
        stop(record, self.opts.stop_timeout_s)  # `--stop-timeout`, as every other stop of `up` that the operator sets
        if probe.state == "adapters":
            raise StartFailed(f"the engine is up but {probe.detail}; it was stopped", ExitStatus.ADAPTERS)
        if probe.state == "version":  # the running server is not the pinned engine version
            raise StartFailed(f"the engine is up but {probe.detail}; it was stopped", ExitStatus.CHECK_FAILED)
        raise StartFailed(
            f"the engine was not ready within {timeout:.0f} s ({probe.detail}); it was stopped (log: {record.log})",
            ExitStatus.TIMEOUT,
            tail(record.log, 20),
        )

    def run_canary(self, record: Record, off: str | None) -> dict[str, Any]:
        """The adapter efficacy canary against the ready engine (molctl.lifecycle.canary), before the proxy
        starts; its result goes into the engine's record (for `status`) and log. An adapter with
        no effect, or a canary request that fails, stops the engine: exit 7."""
        if off is not None:
            result = canary.skipped(off)
        else:
            self.enter("canary")
            self.progress.step("adapter efficacy canary: the base model and L0-L3, greedy, with logprobs")
            result = canary.run(self.profile, get_engine(self.profile.engine.kind), component_url(record))
        line = canary.summary_line(result)
        canary.append_to_log(record.log, line)
        for warning in result.get("warnings", []):
            self.progress.warn(warning)
        if result["status"] in ("fail", "error"):
            stop(record, self.opts.stop_timeout_s)
            raise StartFailed(
                f"the engine is up but {canary.failure_message(result)}; it was stopped", ExitStatus.ADAPTERS
            )
        self.progress.step(line)
        record.extra = {**record.extra, "canary": result}
        try:
            write_record(self.state_dir, self.name, record)
        except OSError as exc:  # the stack serves; only `status` lacks the canary's result
            self.progress.warn(f"could not write the canary's result into the engine record: {exc.strerror or exc}")
        return result

    def wait_proxy(self, upstream: str) -> None:
        self.enter("proxy")
        deadline = time.monotonic() + PROXY_READY_TIMEOUT_S
        while True:
            record, proc = self.proxy
            code = proc.poll()
            if code is not None:
                self._proxy_exited(code, upstream)
                deadline = time.monotonic() + PROXY_READY_TIMEOUT_S
                continue
            if http_status(component_url(record) + "/readyz") == 200:
                return
            if time.monotonic() >= deadline:
                raise StartFailed(
                    f"the proxy was not ready within {PROXY_READY_TIMEOUT_S:.0f} s (log: {record.log})",
                    ExitStatus.START_FAILED,
                    tail(record.log, 80),
                )
            time.sleep(0.1)

    # failure ----------------------------------------------------------------------------------
    def clean_up(self, exc: BaseException, adopted_engine: Record | None, adopted_proxy: Record | None = None) -> None:
        """Stop what this invocation started (and an adopted engine that failed); a second Ctrl-C
        here is reported with what may still run and how to stop it."""
        interrupted = isinstance(exc, KeyboardInterrupt)
        if interrupted:
            _one_more_interrupt()
            self.progress.step(
                f"interrupted{interrupted_by()}: stopping what this command started (Ctrl-C again leaves it running)"
            )
        try:
            for record in reversed(self.started):
                stop(record, 10.0)
                remove_record(self.state_dir, self.name, record.component)
            if isinstance(exc, StartFailed) and adopted_engine is not None:
                stop(adopted_engine, 10.0)
                remove_record(self.state_dir, self.name, "engine")
            if isinstance(exc, StartFailed) and exc.exit_status == ExitStatus.ADAPTERS and adopted_proxy is not None:
                stop(adopted_proxy, 10.0)  # it would serve an engine that was stopped
                remove_record(self.state_dir, self.name, "proxy")
        except KeyboardInterrupt:
            left = [
                f"{r.component} (pid {r.pid})"
                for r in [*self.started, *([adopted_engine] if adopted_engine else [])]
                if members(r)
            ]
            what = ", ".join(left) or "nothing"
            raise MolctlError(
                f"interrupted again while stopping: still running: {what}; the engine may keep its GPUs "
                f"and ports: run `molctl down {self.name}` to stop it",
                ExitStatus.INTERRUPTED,
            ) from None
        if interrupted:
            kept = " (the engine started earlier keeps running: molctl down stops it)" if adopted_engine else ""
            raise MolctlError(
                f"interrupted{interrupted_by()}; everything this command started was stopped{kept}",
                ExitStatus.INTERRUPTED,
            ) from None
