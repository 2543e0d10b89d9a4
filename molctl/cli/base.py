"""What the command modules share: the per-invocation `Context` (state dir, profile folders),
`handle_errors` (a MolctlError as one line and its exit code, Ctrl-C as 130) and the common
options (`--json`, `--set`, `--model-root`, `--skip`, the API-key and timeout options)."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Callable, List, Optional

import typer

# The owners of profile checks register them when imported (molctl.profilechecks): every command
# that loads a profile runs them.
import molctl.engines  # noqa: F401
import molctl.proxy.store.factory  # noqa: F401
import molctl.proxy.tracing  # noqa: F401
from molctl.errors import ExitStatus, MolctlError


class Context:
    """Global options, resolved once per invocation."""

    def __init__(self, state_dir: Optional[Path], profiles_dirs: List[Path]):
        from molctl.state import default_state_dir

        self.state_dir = state_dir.expanduser().absolute() if state_dir else default_state_dir()
        self.profiles_dirs = profiles_dirs

    def dirs(self) -> list[Path]:
        from molctl.profiles import profile_dirs

        return profile_dirs(self.profiles_dirs)


def handle_errors(fn: Callable) -> Callable:
    """Map MolctlError to its one-line message and exit code; Ctrl-C to 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from molctl.output import Output

        try:
            return fn(*args, **kwargs)
        except MolctlError as exc:
            if exc.exit_status == ExitStatus.INTERRUPTED:  # already interrupted: a late Ctrl-C must not cut the report
                from molctl.lifecycle.stopsignals import ignore_stop_signals

                ignore_stop_signals()
            Output().error(str(exc))
            raise typer.Exit(int(exc.exit_status)) from None
        except KeyboardInterrupt:
            from molctl.lifecycle.stopsignals import interrupted_by

            Output().error(f"interrupted{interrupted_by()}")
            raise typer.Exit(int(ExitStatus.INTERRUPTED)) from None
        except OSError as exc:  # a file molctl needs (state dir, log, lock): one line, not a traceback
            where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
            Output().error(f"{exc.strerror or exc}{where}")
            raise typer.Exit(int(ExitStatus.ERROR)) from None

    return wrapper


JSON_OPT = typer.Option(False, "--json", help="Print the machine-readable result (the shapes are in docs/contract.md).")


SET_OPT = typer.Option(
    [],
    "--set",
    metavar="KEY=VALUE",
    help="Override a profile field before validation, e.g. engine.port=9000 (repeatable).",
)


MODEL_ROOT_OPT = typer.Option(
    None, "--model-root", help="Use this model root (base/ and loras/L0..L3) instead of the profile's model_root."
)


SKIP_OPT = typer.Option(
    [],
    "--skip",
    metavar="CATEGORY",
    help="Skip a check category: engine, gpu, model, adapter, template, port, state, security, "
    "adapter-effect (the adapter efficacy canary) (repeatable).",
)


def overrides_from(model_root: Optional[Path], sets: List[str]) -> list[tuple[str, object]]:
    from molctl.profileyaml import parse_set_option

    out: list[tuple[str, object]] = []
    if model_root is not None:
        out.append(("model_root", str(model_root.expanduser().absolute())))
    out.extend(parse_set_option(s) for s in sets)
    return out


KEY_FILE_OPT = typer.Option(
    None,
    "--api-key-file",
    envvar="MOLCTL_API_KEY_FILE",
    help="Proxy API keys, one per line (mode 0600). Or set MOLCTL_API_KEY.",
)


UNAUTH_OPT = typer.Option(False, "--allow-unauthenticated", help="Run the proxy without an API key.")


def _positive(value: Optional[float]) -> Optional[float]:
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise typer.BadParameter(f"{value:g}: expected a number of seconds > 0")
    return value


def _not_negative(value: Optional[float]) -> Optional[float]:
    # nan would pass `< 0` and make every deadline expire at once (no drain, an instant SIGKILL)
    if value is not None and not (value >= 0 and math.isfinite(value)):
        raise typer.BadParameter(f"{value:g}: expected a number of seconds >= 0")
    return value


TIMEOUT_OPT = typer.Option(
    None, "--timeout", callback=_positive, help="Seconds to wait for the engine (> 0; default: engine.start_timeout_s)."
)


DRAIN_OPT = typer.Option(
    600.0,
    "--drain-timeout",
    callback=_not_negative,
    help="Seconds the proxy may take to finish in-flight requests on stop.",
)


STOP_OPT = typer.Option(
    60.0,
    "--stop-timeout",
    callback=_not_negative,
    help="Seconds the engine may take after SIGTERM before SIGKILL (when a running stack is stopped).",
)


VERIFY_OPT = typer.Option(
    False, "--verify", help="Also compare the host with a `molctl lock` manifest (the `lock` check category)."
)
MANIFEST_OPT = typer.Option(
    None,
    "--manifest",
    metavar="PATH",
    help="The manifest for --verify (implies it; default: the profile's newest in STATE/PROFILE/manifests).",
)
FULL_HASH_OPT = typer.Option(
    False,
    "--full-hash",
    help="With --verify (implies it): read every pinned file and compare its SHA-256, not only sizes and mtimes.",
)


def _verify_options(verify: bool, manifest: Optional[Path], full_hash: bool):
    """A `molctl.checks.verify.Verify` when --verify, --manifest or --full-hash is given, else None."""
    if not (verify or manifest is not None or full_hash):
        return None
    from molctl.checks.verify import Verify

    return Verify(manifest=manifest.expanduser().absolute() if manifest is not None else None, full_hash=full_hash)
