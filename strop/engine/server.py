"""The engine behind an OpenAI-compatible HTTP API (FastAPI + uvicorn), plus weight endpoints.

    GET  /health              {"status": "ok", "version": v}
    GET  /v1/models           the served model
    POST /v1/completions      prompt: text or token ids; logprobs; stream
    POST /v1/chat/completions messages + tools (strop.data.chat renders and parses); logprobs; stream;
                              a special token spelt inside a message or tool is plain text, as in
                              the harness (`encode_chat`): a caller cannot forge a turn
    GET  /weights/version     {"version": v}
    POST /weights/update      {"path": safetensors file or model dir, "version": v?} -> {"version", "pause_s"}
                              (checked whole, then applied all at once: a 400 leaves the model as it was;
                              versions never go back). Only with `path_updates=True`: a client naming a
                              file for the server to load is for a trusted local process (the tests,
                              `serve_in_thread`); `strop serve` never mounts it (see `strop.online.app`).

Every choice carries what RL needs beyond the OpenAI fields: `token_ids` and `prompt_token_ids`
(vLLM's names), `routed_experts` when the request asks `return_routed_experts` (vLLM's field:
[positions, MoE layers, top_k], every position the model read), and `policy_versions` (one per
token). Requests from all connections meet in one engine loop thread, so concurrent requests
are batched together. Malformed requests get a 4xx with an OpenAI-style error body; nothing a
client sends can stop the server. CPU work (tokenizing, rendering chat, loading weights) runs off
the event loop, so one big request never stalls the others; bodies and prompts too long for the
engine's context are refused before they are parsed or tokenized (`strop.engine.request_limits`);
a request whose client goes away (closed stream or connection) stops generating at the next step.

`on_served(request, Served)`, when given, is awaited with every finished completion before any of
it is sent (for a stream: before its last chunks), so a completion log can make it durable first.
"""

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from strop.data.chat import IM_END, encode_chat, parse_assistant, render
from strop.engine.engine import Engine, load_weights_file
from strop.engine.request_limits import BodyLimit, body_limit, longest_token_chars
from strop.policy_api import SamplingParams

DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields (user, presence_penalty, ...) are ignored

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    return_routed_experts: bool = False
    stop_token_ids: list[int] | None = None  # vLLM's field: generation ends after one of these (kept in token_ids)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=1)


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | dict | None = None
    logprobs: bool = False


class WeightsRequest(BaseModel):
    path: str
    version: int | None = Field(None, ge=0)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


@dataclass
class Served:
    """One finished response, as `on_served` sees it."""

    id: str
    endpoint: Literal["completions", "chat"]
    model: str
    request: dict[str, Any]  # the parsed request body
    prompt_ids: list[int]
    outs: list  # the engine's `Completion` per choice
    latency_s: float  # from the request's arrival to the end of generation


OnServed = Callable[[Request, Served], Awaitable[None]]


class ClientError(Exception):
    def __init__(self, status: int, message: str):
        self.status, self.message = status, message


def create_app(
    engine: Engine,
    model_name: str,
    path_updates: bool = False,
    on_served: OnServed | None = None,
    chat_format=None,
) -> FastAPI:
    """The app around an engine whose loop thread is running. `chat_format`: the one chat completions
    render and parse in (`strop.data.chat_template.TemplateFormat`: a checkpoint's own template);
    None: strop's own (`strop.data.chat`)."""
    app = FastAPI(title="strop engine")
    tok = engine.tokenizer
    token_chars = longest_token_chars(tok)
    max_chars = engine.max_len * token_chars  # any longer text is more tokens than the context holds
    app.add_middleware(BodyLimit, max_bytes=body_limit(engine.max_len, token_chars))

    def check_length(text: str) -> None:
        if len(text) > max_chars:
            raise ClientError(
                400,
                f"prompt of {len(text)} characters is longer than this engine's context of "
                f"{engine.max_len} tokens can hold",
            )

    async def encode(text: str) -> list[int]:
        check_length(text)
        return await asyncio.to_thread(tok.encode, text)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        parts = [f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}" for e in exc.errors()[:5]]
        return _error(400, "invalid request: " + "; ".join(parts))

    @app.exception_handler(ClientError)
    async def _client_error(request: Request, exc: ClientError):
        return _error(exc.status, exc.message)

    @app.get("/health")
    async def health():
        return {"status": "ok", "version": engine.version}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "strop"}]}

    @app.get("/weights/version")
    async def weights_version():
        return {"version": engine.version}

    if path_updates:

        @app.post("/weights/update")
        async def weights_update(req: WeightsRequest):
            def load_and_apply() -> float:  # reading, checking and casting the tensors is CPU work: off the event loop
                return engine.update_weights(tensors=load_weights_file(req.path), version=req.version).wait(300)

            try:
                pause = await asyncio.to_thread(load_and_apply)
            except ValueError as e:
                raise ClientError(400, str(e)) from None
            return {"version": engine.version, "pause_s": pause}

    async def served(request: Request, endpoint, rid: str, req: _Sampling, ids: list[int], outs, t0: float) -> None:
        if on_served is not None:
            await on_served(
                request, Served(rid, endpoint, model_name, req.model_dump(), ids, outs, time.perf_counter() - t0)
            )

    def params(req: _Sampling, default_max: int, stop_ids: list[int] | None) -> SamplingParams:
        if req.model != model_name:
            raise ClientError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        max_tokens = req.max_completion_tokens or req.max_tokens or default_max
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            stop=stop,
            stop_token_ids=stop_ids,
            seed=req.seed,
        )

    async def run(prompt_ids: list[int], sp: SamplingParams, n: int, request: Request, stream_cb=None):
        """Submit n samples and await them; raises ClientError for requests the engine refuses.
        Whatever ends the wait early (the client went away, the task was cancelled) cancels the
        samples still generating."""
        loop = asyncio.get_running_loop()
        futures, submitted = [], []
        try:
            for i in range(n):
                fut = loop.create_future()
                spi = sp if sp.seed is None or i == 0 else dataclasses.replace(sp, seed=sp.seed + i)
                on_token = (lambda r, i=i: loop.call_soon_threadsafe(stream_cb, i, r)) if stream_cb else None
                try:
                    submitted.append(
                        engine.submit(
                            prompt_ids,
                            spi,
                            on_token=on_token,
                            on_done=lambda r, f=fut: loop.call_soon_threadsafe(_resolve, f, r.result),
                        )
                    )
                except ValueError as e:
                    raise ClientError(400, str(e)) from None
                futures.append(fut)
            everything = asyncio.gather(*futures)
            while not (await asyncio.wait({everything}, timeout=DISCONNECT_POLL_S))[0]:
                if await request.is_disconnected():
                    raise ClientError(499, "client closed the request")  # nobody reads it; ends the wait
            return everything.result()
        finally:
            for r in submitted:
                if not r.done.is_set():
                    engine.cancel(r)

    def extras(c, routed: bool) -> dict:
        out = {"token_ids": c.token_ids, "prompt_token_ids": c.prompt_ids, "policy_versions": c.versions}
        if routed and c.routing is not None:
            out["routed_experts"] = c.routing.tolist()
        return out

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        t0 = time.perf_counter()
        prompts = (
            req.prompt
            if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], (str, list))
            else [req.prompt]
        )
        if len(prompts) != 1:
            raise ClientError(
                400, "one prompt per request (send concurrent requests instead; they are batched together)"
            )
        prompt = prompts[0]
        ids = await encode(prompt) if isinstance(prompt, str) else list(prompt)
        sp = params(req, 16, req.stop_token_ids or [])  # plain completion: no implicit stop token
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return _stream(
                run,
                ids,
                sp,
                req.n,
                request,
                lambda outs: served(request, "completions", rid, req, ids, outs, t0),
                lambda i, delta, fin: {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model_name,
                    "choices": [{"index": i, "text": delta or "", "logprobs": None, "finish_reason": fin}],
                },
                tok.decode,
            )
        outs = await run(ids, sp, req.n, request)
        for c in outs:
            _raise_if_failed(c)
        await served(request, "completions", rid, req, ids, outs, t0)
        choices = []
        for i, c in enumerate(outs):
            lp = None
            if req.logprobs is not None:
                toks = [tok.decode([t]) for t in c.token_ids]
                lp = {"tokens": toks, "token_logprobs": c.logprobs, "top_logprobs": None, "text_offset": _offsets(toks)}
            choices.append(
                {
                    "index": i,
                    "text": c.text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    **extras(c, req.return_routed_experts),
                }
            )
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": choices,
            "usage": _usage(ids, outs),
        }

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        t0 = time.perf_counter()
        for i, m in enumerate(req.messages):
            if m.get("role") not in ("system", "user", "assistant", "tool") or not isinstance(
                m.get("content", ""), (str, type(None))
            ):
                raise ClientError(400, f"messages[{i}]: needs a role in system/user/assistant/tool and string content")
        tools = None if req.tool_choice == "none" else req.tools
        if chat_format is None:
            try:
                text = await asyncio.to_thread(render, req.messages, tools, add_generation_prompt=True)
            except (KeyError, TypeError, AttributeError) as e:
                raise ClientError(400, f"messages or tools are malformed: {type(e).__name__}: {e}") from None
            check_length(text)
            # as the harness does: a special token spelt inside a message is plain text, so no caller can forge a turn
            ids = await asyncio.to_thread(encode_chat, tok, req.messages, tools, add_generation_prompt=True)
            stops = [tok.convert_tokens_to_ids(IM_END)]
        else:  # the checkpoint's template, control tokens inside messages sanitized as the harness's are
            check_length("".join(str(m.get("content") or "") for m in req.messages))
            try:
                ids = await asyncio.to_thread(chat_format.prompt, list(req.messages), tools)
            except Exception as e:  # the template's own errors (Jinja raises many types) on a caller's messages
                raise ClientError(400, f"messages or tools do not render: {type(e).__name__}: {e}") from None
            if len(ids) >= engine.max_len:
                raise ClientError(400, f"prompt of {len(ids)} tokens leaves no room in this engine's context")
            stops = list(chat_format.stop_ids)
        sp = params(req, 512, [*stops, *(req.stop_token_ids or [])])
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return _stream(
                run,
                ids,
                sp,
                req.n,
                request,
                lambda outs: served(request, "chat", rid, req, ids, outs, t0),
                lambda i, delta, fin: {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model_name,
                    "choices": [
                        {
                            "index": i,
                            "delta": ({"role": "assistant", "content": delta} if delta is not None else {}),
                            "logprobs": None,
                            "finish_reason": fin,
                        }
                    ],
                },
                lambda ids: tok.decode([t for t in ids if t not in sp.stop_token_ids]),
            )
        outs = await run(ids, sp, req.n, request)
        for c in outs:
            _raise_if_failed(c)
        await served(request, "chat", rid, req, ids, outs, t0)
        choices = []
        for i, c in enumerate(outs):
            turn = parse_assistant(c.text) if chat_format is None else chat_format.parse(c.text)
            message = {"role": "assistant", "content": turn.content or None}
            if turn.tool_calls:
                message["tool_calls"] = [
                    dict(tc.to_openai(), id=f"call_{uuid.uuid4().hex[:12]}") for tc in turn.tool_calls
                ]
            finish = "tool_calls" if turn.tool_calls and c.finish_reason == "stop" else c.finish_reason
            lp = None
            if req.logprobs:
                lp = {
                    "content": [
                        {
                            "token": tok.decode([t]),
                            "logprob": l,
                            "bytes": list(tok.decode([t]).encode()),
                            "top_logprobs": [],
                        }
                        for t, l in zip(c.token_ids, c.logprobs)
                    ]
                }
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": finish,
                    **extras(c, req.return_routed_experts),
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model_name,
            "choices": choices,
            "usage": _usage(ids, outs),
        }

    return app


def _resolve(fut: asyncio.Future, result) -> None:
    if not fut.done():
        fut.set_result(result)


def _raise_if_failed(c) -> None:
    if c.finish_reason == "error":
        raise ClientError(500, f"generation failed: {c.error}")


def _usage(prompt_ids: list[int], outs) -> dict:
    n = sum(len(c.token_ids) for c in outs)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}


def _offsets(tokens: list[str]) -> list[int]:
    out, at = [], 0
    for t in tokens:
        out.append(at)
        at += len(t)
    return out


def _stream(run, ids, sp, n, request, record, chunk, decode) -> StreamingResponse:
    """Server-sent events: a chunk per new piece of text, a last chunk with finish_reason, [DONE];
    `record(outs)` is awaited before the last chunks.
    (Text streamed before a stop string is recognised is not taken back.) A stream the client
    closes stops its generation: the response is cancelled, and with it `run`."""
    queue: asyncio.Queue = asyncio.Queue()
    sent = [""] * n

    async def events():
        task = asyncio.ensure_future(
            run(ids, sp, n, request, stream_cb=lambda i, r: queue.put_nowait((i, list(r.token_ids))))
        )
        get = None
        try:
            while True:
                get = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    i, token_ids = get.result()
                    text = decode(token_ids)
                    if len(text) > len(sent[i]) and text.startswith(sent[i]) and not text.endswith("\ufffd"):
                        yield f"data: {json.dumps(chunk(i, text[len(sent[i]) :], None))}\n\n"  # (split UTF-8 waits)
                        sent[i] = text
                    continue
                try:
                    outs = task.result()
                    for c in outs:
                        _raise_if_failed(c)
                    await record(outs)
                except ClientError as e:
                    yield f"data: {json.dumps({'error': {'message': e.message, 'code': e.status}})}\n\n"
                    break
                for i, c in enumerate(outs):
                    if len(c.text) > len(sent[i]) and c.text.startswith(sent[i]):
                        yield f"data: {json.dumps(chunk(i, c.text[len(sent[i]) :], None))}\n\n"
                    yield f"data: {json.dumps(chunk(i, None, c.finish_reason))}\n\n"
                break
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away mid-stream: cancelling `run` cancels the generation
            task.cancel()
            if get is not None:
                get.cancel()

    return StreamingResponse(events(), media_type="text/event-stream")


def serve_in_thread(
    engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 0, app: FastAPI | None = None
):
    """Start the engine loop and a uvicorn server on a thread; returns (base_url, stop_fn). The app
    defaults to the trusted local one (weight updates from paths: tests and in-process tools)."""
    import uvicorn

    engine.start()
    app = create_app(engine, model_name, path_updates=True) if app is None else app
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    bound = server.servers[0].sockets[0].getsockname()[1]

    def stop():
        server.should_exit = True
        thread.join(timeout=10)
        engine.stop()

    return f"http://{host}:{bound}", stop
