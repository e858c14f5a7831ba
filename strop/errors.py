"""The exception types the CLI reports as one line: user mistakes (exit 2), and runs stopped by a
failure outside strop's control (exit 1)."""


class UserError(Exception):
    """Bad input from a person (a path, a config key, a flag): reported as one line, exit code 2."""


class RunStopped(Exception):
    """A run stopped by a failure outside strop (a trainer rank, its node or its process lost):
    reported as one line, exit code 1; the run's last checkpoint resumes it."""


def one_line(e: BaseException) -> str:
    """An exception as one short line for a UserError message: its type and its first line (the
    loaders of damaged files raise many types, with messages that can run to pages)."""
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text[:300]}"
