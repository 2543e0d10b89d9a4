"""Exit codes and the typed errors the CLI maps onto them (one place; the contract: docs/contract.md)."""

from __future__ import annotations

import enum


class ExitStatus(enum.IntEnum):
    OK = 0
    ERROR = 1  # unexpected error
    USAGE = 2  # command-line usage error
    CHECK_FAILED = 3  # a preflight check or the profile itself failed
    CONFLICT = 4  # port held by a foreign process, another stack running, lock held
    START_FAILED = 5  # engine or proxy exited during start-up
    TIMEOUT = 6  # readiness timed out
    ADAPTERS = 7  # engine up but /v1/models lacks an adapter or names the wrong parent
    INTERRUPTED = 130


class MolctlError(Exception):
    """An error with a one-line message meant for the operator and a documented exit code."""

    exit_status: ExitStatus = ExitStatus.ERROR

    def __init__(self, message: str, exit_status: ExitStatus | None = None):
        super().__init__(message)
        if exit_status is not None:
            self.exit_status = exit_status


class ProfileError(MolctlError):
    """A profile file is missing, malformed or invalid (exit 3)."""

    exit_status = ExitStatus.CHECK_FAILED


class UsageError(MolctlError):
    exit_status = ExitStatus.USAGE


class ConflictError(MolctlError):
    exit_status = ExitStatus.CONFLICT
