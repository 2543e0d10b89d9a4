"""Fake sglang/srt/server_args.py (tests only): SGLang's parser for the flags the profiles pass.

Laid out as SGLang's own file before the June 2026 refactor (PR #28814/#28919 moved the flags to
dataclass annotations): `ServerArgs.add_cli_args(parser)` with one `parser.add_argument(...)` per
flag, its aliases in the same call ("--tensor-parallel-size", "--tp-size"; "--model-path",
"--model"), and `prepare_server_args(argv)`, which launch_server.py calls with sys.argv[1:]:
`parser.parse_args`, so an unknown flag ends the launch ("unrecognized arguments", exit 2) and
a flag is also taken by a prefix that names one option alone (argparse allow_abbrev: SGLang's
documented `--tp 2`, docs/advanced_features/server_arguments.md). SGLang has no `--tp` of its
own and no vLLM-style `--max-model-len` (its window is `--context-length`)."""

import argparse

# `choices` of --reasoning-parser and --tool-call-parser: server_args.py passes
# `choices=list(ReasoningParser.DetectorMap.keys())` (srt/parser/reasoning_parser.py) and
# `choices=list(FunctionCallParser.ToolCallParserEnum.keys())` (srt/function_call/
# function_call_parser.py), so an unknown parser is argparse's "invalid choice" (exit 2). The
# registries as of early 2026 (glm47 came with PR #15333, Dec 2025); later versions add more.
REASONING_PARSERS = [
    "deepseek-r1",
    "deepseek-v3",
    "glm45",
    "gpt-oss",
    "kimi",
    "kimi_k2",
    "mimo",
    "qwen3",
    "qwen3-thinking",
    "minimax",
    "minimax-append-think",
    "step3",
    "step3p5",
    "mistral",
    "nemotron_3",
    "interns1",
]
TOOL_CALL_PARSERS = [
    "deepseekv3",
    "deepseekv31",
    "deepseekv32",
    "glm",
    "glm45",
    "glm47",
    "gpt-oss",
    "kimi_k2",
    "llama3",
    "mimo",
    "mistral",
    "pythonic",
    "qwen",
    "qwen25",
    "qwen3_coder",
    "step3",
    "minimax-m2",
    "trinity",
    "interns1",
]


class ServerArgs:
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model-path", "--model", type=str, required=True)
        parser.add_argument("--served-model-name", type=str, default=None)
        parser.add_argument("--host", type=str, default="127.0.0.1")
        parser.add_argument("--port", type=int, default=30000)
        parser.add_argument("--context-length", type=int, default=None)
        parser.add_argument("--mem-fraction-static", type=float, default=None)
        parser.add_argument("--max-running-requests", type=int, default=None)
        parser.add_argument("--tensor-parallel-size", "--tp-size", type=int, default=1)
        parser.add_argument("--log-level", type=str, default="info")
        parser.add_argument("--enable-metrics", action="store_true")
        parser.add_argument("--enable-mfu-metrics", action="store_true")
        parser.add_argument("--enable-cache-report", action="store_true")
        parser.add_argument("--skip-server-warmup", action="store_true")
        parser.add_argument("--disable-radix-cache", action="store_true")
        parser.add_argument("--disable-cuda-graph", action="store_true")
        parser.add_argument("--disable-custom-all-reduce", action="store_true")
        parser.add_argument("--disable-overlap-schedule", action="store_true")
        parser.add_argument("--reasoning-parser", type=str, choices=REASONING_PARSERS, default=None)
        parser.add_argument("--tool-call-parser", type=str, choices=TOOL_CALL_PARSERS, default=None)
        parser.add_argument("--enable-lora", default=None, action="store_true")
        parser.add_argument("--max-lora-rank", type=int, default=None)
        parser.add_argument("--lora-paths", type=str, nargs="*", default=None)
        parser.add_argument("--max-loras-per-batch", type=int, default=8)
        parser.add_argument("--max-loaded-loras", type=int, default=None)
        parser.add_argument("--lora-use-virtual-experts", action="store_true")
        # priority scheduling (sgl-project/sglang#8746, merged 2025-09-17): README "Scheduling"
        parser.add_argument("--enable-priority-scheduling", action="store_true")
        parser.add_argument("--schedule-low-priority-values-first", action="store_true")
        parser.add_argument("--priority-scheduling-preemption-threshold", type=int, default=10)
        # request tracing (server_args.py; docs/references/production_request_trace.md)
        parser.add_argument("--enable-trace", action="store_true")
        parser.add_argument("--otlp-traces-endpoint", type=str, default="localhost:4317")


def prepare_server_args(argv: list[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    parser = parser or argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(argv)
