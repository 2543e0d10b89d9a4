"""The state lock's holder is structured data (`LockHolder`), written and read as JSON fields."""

from __future__ import annotations

import os

import pytest

from molctl.errors import ConflictError, ExitStatus
from molctl.state import LockHolder, StateLock, lock_holder


def test_the_holder_is_read_back_as_fields(state_dir):
    assert lock_holder(state_dir) is None
    with StateLock(state_dir, "switch", "tiny-b"):
        holder = lock_holder(state_dir)
        assert (holder.pid, holder.action, holder.profile) == (os.getpid(), "switch", "tiny-b")
        assert holder.user and holder.since
        with pytest.raises(ConflictError) as err, StateLock(state_dir, "up", "tiny"):
            pass
        assert err.value.exit_status == ExitStatus.CONFLICT
        assert f"pid {os.getpid()} (molctl switch tiny-b, user {holder.user}" in str(err.value)
        assert f"kill -INT {os.getpid()}" in str(err.value)
    assert lock_holder(state_dir) is None


def test_a_down_of_every_stack_has_no_profile(state_dir):
    with StateLock(state_dir, "down"):
        holder = lock_holder(state_dir)
        assert (holder.action, holder.profile, holder.command) == ("down", None, "down")


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1, 2]", b'{"pid": "12", "action": 3}'])
def test_unreadable_content_gives_an_unnamed_holder(raw):
    holder = LockHolder.parse(raw)
    assert holder.pid is None and holder.action is None
    assert holder.describe().startswith("pid ? (molctl ?") and holder.stop_hint() == "wait for it"
