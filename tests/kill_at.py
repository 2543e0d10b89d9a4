"""`python tests/kill_at.py MOLCTL-ARGS...`: molctl, SIGKILLed by itself at the moment named by
$KILL_AT (a fault a terminal closing or the OOM killer can cause at any point):
  before_record:COMPONENT  right after COMPONENT was spawned, before its record is written."""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import molctl.lifecycle.starter as start  # noqa: E402


def main() -> None:
    point, _, component = os.environ.get("KILL_AT", "").partition(":")
    if point == "before_record":
        real = start.write_record

        def write_record(state_dir, profile, record):
            if record.component == component:
                os.kill(os.getpid(), signal.SIGKILL)
            real(state_dir, profile, record)

        start.write_record = write_record
    from molctl.cli import main as molctl_main

    sys.argv[0] = "molctl"
    molctl_main()


if __name__ == "__main__":
    main()
