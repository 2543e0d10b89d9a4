"""`molctl reload PROFILE`: make the running stack's proxy re-read its API key file (SIGHUP).

The proxy is found through its record, and signalled only when the recorded pid is still the
process molctl started (`state.is_same_process`); a foreign process is never signalled. The
proxy re-reads the file without dropping connections; a bad file keeps the old keys (its log
says why). See docs/contract.md, "Key reload"."""

from __future__ import annotations

import os
import signal
from typing import Any

from molctl.errors import ConflictError, ExitStatus, MolctlError
from molctl.lifecycle.stacks import known_or_recorded
from molctl.state import check_own_state_dir, is_same_process, read_records_checked


class NotRunning(MolctlError):
    """No live proxy of the profile (exit 3, a failed precondition)."""

    exit_status = ExitStatus.CHECK_FAILED


def reload(ctx, name: str, kill=os.kill) -> dict[str, Any]:
    """Send SIGHUP to PROFILE's proxy; returns {"profile", "pid", "signal"}. `kill` is injected for tests."""
    known_or_recorded(ctx, name)
    check_own_state_dir(ctx.state_dir)  # another user's record could name any pid
    records, problems = read_records_checked(ctx.state_dir, name)
    bad = next((p for p in problems if p.component == "proxy"), None)
    if bad is not None:
        raise ConflictError(
            f"the proxy record of {name} cannot be read: {bad.path}: {bad.error} (molctl status {name} shows what runs)"
        )
    record = records.get("proxy")
    if record is None:
        raise NotRunning(f"no proxy of {name} is recorded (molctl up {name} starts the stack)")
    if not is_same_process(record):
        raise NotRunning(f"the proxy of {name} (pid {record.pid}) is not running; nothing signalled")
    try:
        kill(record.pid, signal.SIGHUP)
    except ProcessLookupError:
        raise NotRunning(f"the proxy of {name} (pid {record.pid}) exited; nothing signalled") from None
    except PermissionError:
        raise ConflictError(f"not allowed to signal the proxy of {name} (pid {record.pid})") from None
    return {"profile": name, "pid": record.pid, "signal": "SIGHUP"}
