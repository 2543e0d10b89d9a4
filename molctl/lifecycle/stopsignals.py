"""How `up` and `switch` meet a stop signal while they work: SIGTERM and SIGHUP interrupt as
Ctrl-C does (`interrupt_on_stop_signals`), so the clean-up stops what the command started; the
messages name the signal (`interrupted_by`); during the clean-up one more signal interrupts it
once (`_one_more_interrupt`), and once the report is due none may cut it (`ignore_stop_signals`)."""

from __future__ import annotations

import os

STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


_received: list[str] = []  # the stop signal (other than Ctrl-C's) that interrupted this command


_armed: set[str] = {"SIGINT"}  # the stop signals that interrupt this command (not those it inherited ignored)


def interrupt_on_stop_signals() -> None:
    """`up` and `switch`: SIGTERM (`timeout`, systemd, a cancelled CI job) and SIGHUP (a closed
    terminal or ssh session) interrupt as Ctrl-C does, so the clean-up stops what this command
    started (exit 130) instead of leaving an engine loading with nobody waiting for it. After a
    SIGHUP the terminal is gone: the output goes to /dev/null, so that writing it cannot cut the
    clean-up short. A signal this process was started ignoring (`nohup`, `trap '' HUP TERM`) stays
    ignored, as Python leaves an ignored SIGINT."""
    for name in ("SIGTERM", "SIGHUP"):
        if not _ignored(name):
            _armed.add(name)
            _set_handler(name, _interrupt)


def _ignored(name: str) -> bool:
    import signal

    return signal.getsignal(getattr(signal, name)) == signal.SIG_IGN


def _interrupt(signum, frame) -> None:
    import signal

    _received.append(signal.Signals(signum).name)
    if signum == signal.SIGHUP:
        _detach_terminal()
    raise KeyboardInterrupt


def interrupted_by() -> str:
    """' by SIGTERM' (or SIGHUP) for the messages of an interrupted command; '' for Ctrl-C."""
    return f" by {_received[0]}" if _received else ""


def _detach_terminal() -> None:
    """Standard output and error to /dev/null where they are a terminal (a hung-up one fails every
    write with EIO); files and pipes keep the report."""
    import stat

    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        devnull = os.fstat(null).st_rdev
        for fd in (1, 2):
            try:
                st = os.fstat(fd)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev != devnull:
                    os.dup2(null, fd)
            except OSError:
                pass
    finally:
        os.close(null)


def ignore_stop_signals() -> None:
    """Once a command reports its interruption: no later signal may cut the report or the exit."""
    import signal

    for name in STOP_SIGNALS:
        _set_handler(name, signal.SIG_IGN)


def _set_handler(name: str, handler) -> None:
    import signal

    try:
        signal.signal(getattr(signal, name), handler)
    except ValueError:  # not the main thread (tests calling in-process)
        pass


def _one_more_interrupt() -> None:
    """During the clean-up after an interruption: the next Ctrl-C, SIGTERM or SIGHUP interrupts it
    once (and is reported); any further one is ignored, so it cannot cut the report or the exit
    short."""

    def once(signum, frame):
        import signal

        ignore_stop_signals()
        if signum == signal.SIGHUP:
            _detach_terminal()
        raise KeyboardInterrupt

    for name in STOP_SIGNALS:
        if name in _armed:
            _set_handler(name, once)
