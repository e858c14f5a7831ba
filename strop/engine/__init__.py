"""Inference: the in-process CPU engine (`engine`, over its own forward in `forward`), its
OpenAI-compatible HTTP server (`server`), and `client`, which talks to it, to vLLM or SGLang, or
to an engine in the same process through one interface."""
