"""Command modules: each one's arguments and wiring (`add_arguments`, `run`); library code lives in
the core packages. `strop bench ...` programs are in `strop.bench`, the other edge package."""
