"""Fake sglang/srt/server_args.py (tests only): the flags molctl's engine check reads."""

import argparse


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context-length")
    parser.add_argument("--disable-cuda-graph")
    parser.add_argument("--disable-custom-all-reduce")
    parser.add_argument("--disable-overlap-schedule")
    parser.add_argument("--disable-radix-cache")
    parser.add_argument("--enable-cache-report")
    parser.add_argument("--enable-lora")
    parser.add_argument("--enable-metrics")
    parser.add_argument("--enable-mfu-metrics")
    parser.add_argument("--host")
    parser.add_argument("--log-level")
    parser.add_argument("--lora-paths")
    parser.add_argument("--lora-use-virtual-experts")
    parser.add_argument("--max-loaded-loras")
    parser.add_argument("--max-lora-rank")
    parser.add_argument("--max-loras-per-batch")
    parser.add_argument("--max-model-len")
    parser.add_argument("--mem-fraction-static")
    parser.add_argument("--model-path")
    parser.add_argument("--port")
    parser.add_argument("--reasoning-parser")
    parser.add_argument("--served-model-name")
    parser.add_argument("--skip-server-warmup")
    parser.add_argument("--tool-call-parser")
    parser.add_argument("--tp")
    parser.add_argument("--tp-size")
