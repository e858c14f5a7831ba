"""What a request may cost the server before the engine sees it.

A prompt that cannot fit the engine's context is refused before it is tokenized: no token of the
vocabulary is longer than `longest_token_chars` characters, so a text longer than `max_len` times
that is more than `max_len` tokens whatever it says (tokenizing a 5 MB prompt took 11-21 s and
~2 GB here). The request body is bounded the same way, with room for JSON escapes and message
structure (`BodyLimit`, an ASGI middleware: a bigger body gets 413 before anything parses it).
"""

import json

BODY_BYTES_PER_CHAR = (
    8  # JSON escapes (a \u escape of four hex digits is 6 bytes a character) and the messages' structure
)
BODY_MIN_BYTES = 1 << 20  # small contexts still take tool definitions and a few messages


def longest_token_chars(tokenizer) -> int:
    """Characters of the longest vocabulary entry: an upper bound on the characters one token
    covers (byte-level BPE entries spell one character per byte, and decoding never lengthens them)."""
    return max(len(t) for t in tokenizer.get_vocab())


def body_limit(max_len: int, token_chars: int) -> int:
    """Largest request body (bytes) whose prompt could fit `max_len` tokens."""
    return max(BODY_MIN_BYTES, BODY_BYTES_PER_CHAR * max_len * token_chars)


class BodyLimit:
    """ASGI middleware: reads each HTTP request body up to `max_bytes` and hands it on; a larger one
    (by Content-Length or as it arrives) gets 413 and never reaches the app."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._too_large(send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: the disconnect, when the client goes away

        await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        payload = json.dumps(
            {
                "error": {
                    "message": f"request body larger than {self.max_bytes} bytes; no prompt that "
                    "long fits this engine's context",
                    "type": "invalid_request_error",
                    "code": 413,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})
