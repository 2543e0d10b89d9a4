"""`molctl bench --compare A B`: two runs' summaries read back (`load_run`, checked against the
shape `bench` writes) and compared cell by cell (`compare`: B/A ratios)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from molctl.bench import ratio
from molctl.errors import UsageError


def load_run(state_dir: Path, profile: str | None, ref: str) -> dict:
    """A run's summary.json by directory, or by run id under STATE/PROFILE/bench (any profile when None)."""
    if profile is not None:
        from molctl.profiles import check_profile_name

        check_profile_name(profile)
    path = Path(ref).expanduser()
    candidates = [path] if path.is_dir() else []
    if not candidates:
        roots = [Path(state_dir) / profile / "bench"] if profile else sorted(Path(state_dir).glob("*/bench"))
        candidates = [r / ref for r in roots if (r / ref).is_dir()]
    if not candidates:
        raise UsageError(f"no bench run {ref!r} (a run id under STATE/PROFILE/bench/ or a run directory)")
    if len(candidates) > 1:  # two profiles benched in the same second: never pick one silently
        raise UsageError(
            f"bench run {ref!r} is in more than one profile "
            f"({', '.join(c.parent.parent.name for c in candidates)}): give PROFILE "
            f"(molctl bench PROFILE --compare ...) or the run directory"
        )
    summary = candidates[0] / "summary.json"
    try:
        if summary.exists() and not summary.is_file():  # a FIFO would block the read forever
            raise UsageError(f"{summary} is not a regular file")
        data = json.loads(summary.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"bench run {candidates[0]} has no summary.json (an interrupted or failed run)") from None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise UsageError(f"{summary} cannot be read: {why}") from None
    problem = _summary_problem(data)
    if problem:
        raise UsageError(f"{summary} is not a molctl bench summary: {problem}")
    return data


def _summary_problem(data: Any) -> str | None:
    """The first thing `compare` needs that a (hand-edited, damaged) summary lacks, or None."""

    def number(v) -> bool:
        return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))

    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        return "no 'results' list"
    for i, c in enumerate(data["results"]):
        where = f"results[{i}]"
        if not isinstance(c, dict):
            return f"{where} is not an object"
        if not isinstance(c.get("series"), str) or not isinstance(c.get("concurrency"), int):
            return f"{where} lacks a string 'series' or an integer 'concurrency'"
        for key in ("ttft_s", "total_s"):
            if not isinstance(c.get(key), dict) or not all(number(c[key].get(p)) for p in ("p50", "p95")):
                return f"{where}.{key} is not an object of numbers p50, p95"
        for key in ("requests_per_s", "output_tokens_per_s"):
            if not number(c.get(key)):
                return f"{where}.{key} is not a number"
        if not isinstance(c.get("errors"), dict) or not all(isinstance(n, int) for n in c["errors"].values()):
            return f"{where}.errors is not an object of counts"
    return None


def compare(a: dict, b: dict) -> dict[str, Any]:
    """Per series and concurrency present in either run: A, B and B/A of the main figures."""
    keys = ("ttft_p50", "ttft_p95", "total_p50", "total_p95", "requests_per_s", "output_tokens_per_s", "errors")

    def figures(c: dict | None) -> dict | None:
        if c is None:
            return None
        return {
            "ttft_p50": c["ttft_s"]["p50"],
            "ttft_p95": c["ttft_s"]["p95"],
            "total_p50": c["total_s"]["p50"],
            "total_p95": c["total_s"]["p95"],
            "requests_per_s": c["requests_per_s"],
            "output_tokens_per_s": c["output_tokens_per_s"],
            "errors": sum(c["errors"].values()),
        }

    index_a = {(c["series"], c["concurrency"]): c for c in a["results"]}
    index_b = {(c["series"], c["concurrency"]): c for c in b["results"]}
    order = list(dict.fromkeys([*index_a, *index_b]))
    rows = []
    for key in order:
        fa, fb = figures(index_a.get(key)), figures(index_b.get(key))
        rows.append(
            {
                "series": key[0],
                "concurrency": key[1],
                "a": fa,
                "b": fb,
                "ratio": {k: ratio(fb[k], fa[k]) for k in keys if k != "errors"} if fa and fb else None,
            }
        )
    return {
        "a": {"run_id": a.get("run_id"), "run_dir": a.get("run_dir"), "profile": a.get("profile")},
        "b": {"run_id": b.get("run_id"), "run_dir": b.get("run_dir"), "profile": b.get("profile")},
        "rows": rows,
    }
