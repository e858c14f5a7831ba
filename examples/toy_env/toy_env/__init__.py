"""strop-toy-env: a worked example of a strop environment package (docs/guides/harness.md)."""
