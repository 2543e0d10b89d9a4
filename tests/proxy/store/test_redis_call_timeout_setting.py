"""`proxy.store_call_timeout_s`: the round trip one Redis call may take before the store counts as
degraded (0.5 s by default), from the profile to the replica's RedisState."""

from __future__ import annotations

import asyncio

import pytest

from molctl.errors import ProfileError
from molctl.profiles import load_profile, profile_dirs
from molctl.proxy.store.factory import build_shared_state
from molctl.proxy.store.redis.target import StoreUnavailable


def _state(redis, *overrides):
    profile = load_profile("tiny", profile_dirs(), [("proxy.store", redis.url), *overrides])
    return build_shared_state(profile, "http://127.0.0.1:8100", 8300, "a", None)


def test_a_call_may_take_as_long_as_the_profile_says(redis):
    async def slow_call(state):
        try:
            return await state.call("slow", lambda: asyncio.sleep(0.8, "done"))
        finally:
            await state.close()

    patient = _state(redis, ("proxy.store_call_timeout_s", 2.5))
    assert patient.call_timeout_s == 2.5
    assert asyncio.run(slow_call(patient)) == "done"
    default = _state(redis)
    assert default.call_timeout_s == 0.5
    with pytest.raises(StoreUnavailable):
        asyncio.run(slow_call(default))
    assert default.degraded


@pytest.mark.parametrize("bad", [0, -1, 61, "fast"])
def test_a_call_timeout_out_of_range_names_the_field(bad):
    with pytest.raises(ProfileError, match=r"proxy\.store_call_timeout_s"):
        load_profile("tiny", profile_dirs(), [("proxy.store_call_timeout_s", bad)])
