"""Whether this process has a controlling terminal, which decides whether a sandbox starts in a
session of its own (see `has_ctty`)."""

import os


def has_ctty() -> bool:
    """Whether this process has a controlling terminal. Only then does bwrap start in a session of
    its own: a sandbox must not reach the terminal (TIOCSTI could type into the user's shell), and
    without one there is nothing to detach from. Not always: setsid() also makes a scheduler
    autogroup, and a process in a fresh one waits ~3 ms longer for a CPU on a busy machine."""
    try:
        os.close(os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC))
    except OSError:
        return False
    return True
