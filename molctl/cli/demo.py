"""`molctl demo init`: the tiny demo model."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from molctl.cli.base import (
    JSON_OPT,
    handle_errors,
)

demo_app = typer.Typer(
    help="The tiny demo model: a whole MoL stack on any machine, no GPU, no download.", no_args_is_help=True
)


@demo_app.command("init")
@handle_errors
def demo_init_cmd(
    ctx: typer.Context,
    directory: Optional[Path] = typer.Argument(
        None, help="Where to write it (default: the tiny profile's model_root)."
    ),
    seed: int = typer.Option(0, "--seed", help="Random seed (the output is deterministic per seed)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing non-empty directory."),
    if_missing: bool = typer.Option(
        False, "--if-missing", help="Do nothing when a complete tiny model is already there."
    ),
    template: str = typer.Option(
        "qwen3.6",
        "--template",
        help="Chat template rules: qwen3.6 (the Tall base's family; profile tiny) or glm5 (Venti's).",
    ),
    no_effect: List[str] = typer.Option(
        [],
        "--no-effect",
        metavar="ROUTE=KIND",
        help="Write adapter ROUTE with no effect, for the efficacy canary: zero-b (zero "
        "lora_B) or off-target (o_proj only: no effect under --lora-target-modules "
        "q_proj v_proj) (repeatable).",
    ),
    size_mb: Optional[int] = typer.Option(
        None,
        "--size-mb",
        min=1,
        max=100_000,
        help="Grow the base's MLP to about this many MB (load and prefetch benchmarks; layers and adapters stay tiny).",
    ),
    json_: bool = JSON_OPT,
) -> None:
    """Generate the tiny base model (tokenizer, config, chat template, 2 safetensors shards) and LoRA adapters L0-L3."""
    from molctl.demo import TEMPLATES, init_tiny, parse_no_effect
    from molctl.errors import UsageError
    from molctl.output import Output
    from molctl.profiles import load_profile

    if template not in TEMPLATES:
        raise UsageError(f"--template {template!r}: expected one of {', '.join(TEMPLATES)}")
    if seed < 0:  # numpy's seeds are non-negative: a traceback (exit 1) after --force had deleted the model
        raise UsageError(f"--seed {seed}: expected 0 or more")
    out = Output(as_json=json_)
    root = directory or load_profile("tiny", ctx.obj.dirs()).model_root
    result = init_tiny(
        root,
        seed=seed,
        force=force,
        if_missing=if_missing,
        template=template,
        no_effect=parse_no_effect(no_effect),
        size_mb=size_mb,
    )
    out.demo_init(result, template, seed)
