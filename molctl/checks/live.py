"""`molctl check PROFILE --live`: the checks of a running stack's engine, after the host checks.

The `adapter-effect` category is the adapter efficacy canary of `up` (molctl.lifecycle.canary), run
against the engine the stack's records name: `adapter-effect.L0`..`L3` pass when the adapter
changes the base model's greedy tokens or logprobs, fail when it does not;
`adapter-effect.distinct` warns about two adapters that answer identically;
`adapter-effect.running` fails when no engine of the profile runs or the canary could not ask it.
"""

from __future__ import annotations

from molctl.checks.result import CheckResult, Probes
from molctl.profiles import Profile
from molctl.routes import ROUTES


def run(profile: Profile, probes: Probes, ctx) -> list[CheckResult]:
    from molctl import stackconfig
    from molctl.engines import get_engine
    from molctl.lifecycle import canary
    from molctl.lifecycle.stacks import component_url, recorded_config
    from molctl.state import is_same_process, read_records

    cat = canary.CATEGORY
    records = read_records(ctx.state_dir, profile.name)
    engine_record = records.get("engine")
    if engine_record is None or not is_same_process(engine_record):
        return [
            CheckResult(
                f"{cat}.running",
                "fail",
                f"no live engine of {profile.name} is recorded in {ctx.state_dir} (molctl up {profile.name} starts it)",
            )
        ]
    # the stack as it was started (its overrides included), not the profile file as it is now
    running = stackconfig.profile_from(recorded_config(records)) or profile
    result = canary.run(running, get_engine(running.engine.kind), component_url(engine_record))
    if result["status"] == "error":
        return [CheckResult(f"{cat}.running", "fail", canary.failure_message(result))]
    out = [
        CheckResult(
            f"{cat}.running",
            "pass",
            f"asked the engine at {component_url(engine_record)} "
            f"({result['seconds']:.2f} s for the base and {len(ROUTES)} adapters)",
        )
    ]
    for route in ROUTES:
        a = result["adapters"][route]
        if a["effect"]:
            how = (
                "other greedy tokens"
                if not a["tokens_match"]
                else f"logprobs moved by up to {a['max_logprob_diff']:.2g}"
            )
            out.append(
                CheckResult(
                    f"{cat}.{route}",
                    "pass",
                    f"adapter {route} changes the base model's output on the canary prompt ({how})",
                )
            )
        else:
            line = next(p for p in result["problems"] if p.startswith(f"adapter {route} "))
            out.append(CheckResult(f"{cat}.{route}", "fail", line))
    if result["warnings"]:
        out.append(CheckResult(f"{cat}.distinct", "warn", "; ".join(result["warnings"])))
    else:
        out.append(CheckResult(f"{cat}.distinct", "pass", "no two adapters answer the canary prompt identically"))
    return out
