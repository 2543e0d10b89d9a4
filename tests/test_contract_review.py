"""docs/contract.md checked against what the commands really do (a contract conformance review):
each test names the claim it holds the code (or the doc) to."""

from __future__ import annotations

import re

from tests.helpers import ROOT

CONTRACT = ROOT / "docs" / "contract.md"


# ------------------------------------------------------------------------- section 1, the synopsis

def _synopsis_lines() -> list[str]:
    block = CONTRACT.read_text().split("```", 2)[1]
    lines: list[str] = []
    for line in block.splitlines():
        if line.startswith("molctl"):
            lines.append(line)
        elif line.strip() and lines:
            lines[-1] += " " + line.strip()
    return lines


def test_the_synopsis_names_every_option_of_every_command():
    """Section 1's synopsis is what scripts read to know a command's options: every option a
    command accepts is in it, and it names none the command lacks (the proxy's --replica-id and
    --advertise-upstream were missing)."""
    import typer.main

    from molctl.cli import app

    root = typer.main.get_command(app)
    documented: dict[str, set[str]] = {}
    commands: dict[str, object] = {}
    for line in _synopsis_lines():
        cmd, path = root, []
        for word in line.split()[1:]:
            if hasattr(cmd, "commands") and word in cmd.commands:
                cmd = cmd.commands[word]
                path.append(word)
            else:
                break
        name = " ".join(path) or "(global)"
        commands[name] = cmd
        documented.setdefault(name, set()).update(re.findall(r"(--[a-z][a-z0-9-]*)", line))
    problems = []
    for name, cmd in commands.items():
        real = {o for p in cmd.params if getattr(p, "param_type_name", "") == "option"
                for o in [*p.opts, *p.secondary_opts] if o.startswith("--")} - {"--help"}
        if real - documented[name]:
            problems.append(f"{name}: undocumented {sorted(real - documented[name])}")
        if documented[name] - real:
            problems.append(f"{name}: documented but not accepted {sorted(documented[name] - real)}")
    assert not problems, problems
