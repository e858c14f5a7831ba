"""The one exception type for user mistakes; the CLI prints its message and exits 2."""


class UserError(Exception):
    """Bad input from a person (a path, a config key, a flag): reported as one line, exit code 2."""
