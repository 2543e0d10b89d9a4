"""docs/contract.md against what the commands really do: the synopsis, usage errors and exit codes,
JSON output shapes, the store a command uses, a closed output pipe. Each test names the claim it
holds the code (or the doc) to."""

from __future__ import annotations

import json
import re

import pytest

from molctl.errors import ExitStatus
from tests.helpers import ROOT, Molctl

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
        real = {
            o
            for p in cmd.params
            if getattr(p, "param_type_name", "") == "option"
            for o in [*p.opts, *p.secondary_opts]
            if o.startswith("--")
        } - {"--help"}
        if real - documented[name]:
            problems.append(f"{name}: undocumented {sorted(real - documented[name])}")
        if documented[name] - real:
            problems.append(f"{name}: documented but not accepted {sorted(documented[name] - real)}")
    assert not problems, problems


# ------------------------------------------------------------------------ section 2, one error line


@pytest.mark.parametrize(
    "args, names",
    [
        (["up", "tiny", "--timeout", "0", "--allow-unauthenticated"], ["--timeout", "0", "> 0"]),
        (["up", "tiny", "--drain-timeout", "nan", "--allow-unauthenticated"], ["--drain-timeout", "nan"]),
        (["lock", "tiny", "--jobs", "0"], ["--jobs", "1"]),
        (["logs", "tiny", "-n", "x"], ["--lines", "'x'"]),
        (["up", "tiny", "--no-such-option"], ["--no-such-option"]),
        (["up"], ["profile"]),
        (["no-such-command"], ["no-such-command"]),
        (["state", "stats"], ["profile"]),
    ],
)
def test_a_usage_error_of_the_parser_is_one_error_line_and_exit_2(tmp_path, args, names):
    """Section 2: "Every error is one line on stderr, `molctl: error: <message>`" and a bad
    option is exit 2. Errors the option parser finds (a value a callback refuses, an unknown
    option, a missing argument) were a 5-7 line box drawn by rich, with `Usage:` and `Try ...`
    lines: a script reading the last line of stderr got a box border."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    r = Molctl(state)(*args)  # a real process: `main()` is where the parser's errors are printed
    assert r.exit_code == ExitStatus.USAGE, r.stderr
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("molctl: error: "), r.stderr
    for name in names:
        assert name in r.stderr, (name, r.stderr)


def test_help_version_and_no_arguments_are_unchanged(tmp_path):
    cli = Molctl(None)
    r = cli("--help")
    assert r.exit_code == ExitStatus.OK and "Exit codes:" in r.stdout
    r = cli("--version")
    assert r.exit_code == ExitStatus.OK and r.stdout.startswith("molctl ")
    r = cli("up", "--help")
    assert r.exit_code == ExitStatus.OK and "--allow-unauthenticated" in r.stdout
    r = cli()  # no_args_is_help: the help, as before (exit 2, like click's)
    assert r.exit_code == ExitStatus.USAGE and "Commands" in r.stdout + r.stderr


# ------------------------------------------------------------- section 1, --skip is checked first


@pytest.mark.parametrize("command", ["up", "switch"])
@pytest.mark.parametrize("category", ["gpuu", "profile"])
def test_a_bad_skip_is_exit_2_before_the_state_lock_and_the_running_stack(molctl, state_dir, command, category):
    """ "--skip CATEGORY: one of engine gpu ... anything else is exit 2", and `up` step 1 fails
    usage before anything. `up` checked --skip only in its preflight: with the state lock held
    (or another profile running, or this one with another configuration) a typo was exit 4, and
    `up tiny --skip gpuu` of a stack already running was exit 0 `already_running`."""
    from molctl.state import StateLock

    with StateLock(state_dir, "down", "tiny"):
        r = molctl(command, "tiny", "--skip", category, "--allow-unauthenticated")
    assert r.exit_code == ExitStatus.USAGE, r.stderr
    assert f"--skip {category!r}" in r.stderr and "expected one of engine" in r.stderr


# ----------------------------------------------------------------- section 3, reload --json indent


def test_reload_json_is_one_document_with_indent_2(molctl, state_dir, tmp_path):
    """Section 3: "--json writes exactly one JSON document on stdout (indent 2)". `reload --json`
    printed its object on one line (json.dumps without indent), unlike every other command."""
    import subprocess
    import sys

    from molctl.processes import record_for
    from molctl.state import write_record

    # a stand-in proxy that molctl recorded: a process of ours, in its own session (SIGHUP ends it)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        write_record(state_dir, "tiny", record_for("proxy", proc, ["molctl", "proxy"], 1, tmp_path / "proxy.log"))
        r = molctl("reload", "tiny", "--json")
        assert r.exit_code == ExitStatus.OK, r.stderr
        assert r.stdout == json.dumps({"profile": "tiny", "pid": proc.pid, "signal": "SIGHUP"}, indent=2) + "\n"
        assert proc.wait(10) == -1  # it was signalled (SIGHUP: 1)
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------- state stats/prune: the store the stack uses


@pytest.mark.parametrize("command", ["stats", "prune"])
def test_state_stats_and_prune_use_the_store_the_stack_was_started_with(molctl, state_dir, tmp_path, command):
    """`state stats|prune PROFILE` act on "the profile's response store" while "safe while the
    proxy runs". They read the profile file only: after `up tiny --set proxy.store=sqlite:/ALT
    --set proxy.store_ttl_s=N` they described (and pruned) the default file with the file's 30-day
    TTL, not the store the proxy writes; a prune with the file's shorter TTL deleted responses the
    running proxy still serves. Like `status`, they now take the profile as recorded at the start."""
    from molctl import stackconfig
    from molctl.profiles import profile_dirs
    from molctl.state import Record, write_record

    alt = tmp_path / "alt.sqlite3"
    _, config = stackconfig.load(
        "tiny", profile_dirs([]), [("proxy.store", f"sqlite:{alt}"), ("proxy.store_ttl_s", 7776000)]
    )
    write_record(
        state_dir,
        "tiny",
        Record(
            component="proxy",
            pid=2**22 + 1,
            pgid=2**22 + 1,
            create_time=1.0,
            argv=["molctl", "proxy"],
            port=1,
            log="",
            started_at=1.0,
            config=config,
        ),
    )
    r = molctl("state", command, "tiny", "--json")
    assert r.exit_code == ExitStatus.OK, r.stderr
    out = r.json()
    assert out["path"] == str(alt) and out["bounds"]["ttl_s"] == 7776000, out
    assert out["exists"] is False and not alt.exists()  # never creates the file


# --------------------------------------------------------------- section 3, demo init --json shapes


def _documented_demo_shapes() -> str:
    text = CONTRACT.read_text()
    return text.split("### `demo init --json`", 1)[1].split("\n## ", 1)[0]


def test_demo_init_json_shapes_are_the_documented_ones(molctl, tmp_path):
    """Section 3 listed `{"root", "created", "vocab_size", "seed", "adapters", "template"}` as
    always present (no `?`), but `demo init --if-missing --json` on a complete model prints only
    root and created (a model already there has no known seed): the doc now says which keys each
    case prints; the code's shape is the better one (no invented seed)."""
    root = tmp_path / "tiny"
    first = molctl("demo", "init", str(root), "--json")
    assert first.exit_code == ExitStatus.OK, first.stderr
    assert set(first.json()) == {"root", "created", "vocab_size", "seed", "adapters", "template"}
    again = molctl("demo", "init", str(root), "--if-missing", "--json")
    assert again.exit_code == ExitStatus.OK, again.stderr
    assert again.json() == {"root": str(root), "created": False}
    assert '`{"root", "created": false}`' in _documented_demo_shapes()


# ------------------------------------------------------ section 3, down --json: one entry per stack


@pytest.mark.parametrize("corrupt", ["proxy", "engine"])
def test_down_force_of_a_stack_with_one_unreadable_record_is_one_entry_proxy_first(tmp_path, corrupt):
    """`down --json`: `{"stopped": [{"profile", "components": {"proxy", "engine"}}]}`, one entry per
    stack, and "per stack, the proxy (drain) then the engine". With one record unreadable,
    `down --force` listed the profile twice (one entry per record kind), and with the engine's
    record the unreadable one it stopped the engine before draining the proxy."""
    from tests.lifecycle_host import Host

    host = Host(tmp_path)
    try:
        r = host.up()
        assert r.exit_code == ExitStatus.OK, r.stderr
        (host.state / "tiny" / f"{corrupt}.json").write_text("{not json")
        r = host.molctl("down", "--force", "--json", "--drain-timeout", "5", "--stop-timeout", "5")
        assert r.exit_code == ExitStatus.OK, r.stderr
        out = r.json()
        assert [s["profile"] for s in out["stopped"]] == ["tiny"], out
        assert list(out["stopped"][0]["components"]) == ["proxy", "engine"], out
        assert set(out["stopped"][0]["components"].values()) == {"stopped"}, out
        assert host.molctl("status", "--json").json() == {"stacks": []}
    finally:
        host.molctl("down", "--force", "--drain-timeout", "2", "--stop-timeout", "2")
        host.cleanup()


@pytest.mark.parametrize("argv", [["check", "--help"], ["--help"], ["profiles"], ["up", "--wat"]])
def test_output_into_a_closed_pipe_is_no_traceback(argv, tmp_path):
    """`molctl check --help | head -2`: the reader is gone before molctl writes. After the parser's
    errors became one line (cli.main, not standalone), the BrokenPipe's SystemExit met an except
    clause naming a class this typer does not have: an AttributeError traceback."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout is EPIPE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "molctl", "--state-dir", str(tmp_path / "s"), *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode in (1, 2), proc.returncode
