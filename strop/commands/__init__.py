"""Command modules: each one's arguments and wiring (`add_arguments`, `run`); library code lives in the core packages."""
