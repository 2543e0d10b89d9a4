import signal
import sys


def _runs_proxy(argv: list[str]) -> bool:
    """Whether argv is `molctl [global options] proxy ...` (--state-dir and --profiles-dir take a value)."""
    i = 0
    while i < len(argv):
        if argv[i] in ("--state-dir", "--profiles-dir"):
            i += 2
        elif argv[i].startswith("-"):
            i += 1
        else:
            return argv[i] == "proxy"
    return False


if __name__ == "__main__":
    if _runs_proxy(sys.argv[1:]):
        # the proxy re-reads its keys on SIGHUP once it serves; until then (imports, stores: ~1 s) a
        # SIGHUP (`molctl reload` during a start) must not end it, as SIGHUP's default action would
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from molctl.cli import main

    main()
