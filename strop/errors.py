"""The one exception type for user mistakes; the CLI prints its message and exits 2."""


class UserError(Exception):
    """Bad input from a person (a path, a config key, a flag): reported as one line, exit code 2."""


def one_line(e: BaseException) -> str:
    """An exception as one short line for a UserError message: its type and its first line (the
    loaders of damaged files raise many types, with messages that can run to pages)."""
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text[:300]}"
