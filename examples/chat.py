"""One chat request through the running MoL proxy with the official openai SDK.

    python examples/chat.py [--base-url URL] [--key-file F] "your message"

Defaults: the tiny profile's proxy (http://127.0.0.1:8300/v1) and the key `make demo` created."""

import argparse
import time
from pathlib import Path

import openai

parser = argparse.ArgumentParser()
parser.add_argument("message", nargs="?", default="Hello! Who are you, and can you write a tiny Python function?")
parser.add_argument("--base-url", default="http://127.0.0.1:8300/v1")
parser.add_argument("--key-file", default=str(Path(__file__).resolve().parent.parent / ".demo" / "api-key"))
parser.add_argument("--model", default="Macaron-Tiny-Demo")
args = parser.parse_args()

client = openai.OpenAI(base_url=args.base_url, api_key=Path(args.key_file).read_text().strip())
print(f"models: {[m.id for m in client.models.list().data]}")
t0 = time.monotonic()
reply = client.chat.completions.create(
    model=args.model, max_tokens=24, messages=[{"role": "user", "content": args.message}]
)
print(f"user: {args.message}")
print(
    f"assistant ({time.monotonic() - t0:.2f} s, {reply.usage.completion_tokens} tokens): {reply.choices[0].message.content!r}"
)
print("(the tiny model's weights are random: its words are noise; the stack around it is real)")
