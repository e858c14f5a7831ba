"""The server `strop serve` exposes: the engine's OpenAI-compatible API (`strop.engine.server`) behind
API keys (`strop.online.auth`), with every completion logged and ratings taken (`strop.online.store`),
and weight changes only from the run's own store (`strop.online.versions`).

    POST /v1/feedback     a rating of a logged completion (`strop.online.feedback`)        feedback
    POST /weights/update  {"version": V}: load V from the run's weight store              admin
    POST /weights/rollback {"to": V}: go back to an earlier version V of the store        admin
                          -> {"version", "pause_s"}; a body naming a path is a 400

The weight routes exist only with a key file (without keys nothing is admin) and a weight store.
A completion is committed to the log before its response is sent: a request whose completion
cannot be logged gets a 503, not an answer the log lacks.
"""

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from strop.engine.engine import Engine
from strop.engine.server import ClientError, Served, create_app
from strop.env.harness.sessions import append_conversations, served_conversations
from strop.online.auth import Guard, KeyFile
from strop.online.feedback import FeedbackEvent
from strop.online.store import CompletionRow, Store
from strop.online.versions import UnknownVersion, Versions

STATUS_OF_FEEDBACK = {"unknown": 404, "conflict": 409}


class _VersionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_path(cls, data: Any) -> Any:
        if isinstance(data, dict) and "path" in data:
            raise ValueError("weights come only from this run's weight store: name a version, never a path")
        return data


class UpdateRequest(_VersionBody):
    version: int = Field(ge=0)


class RollbackRequest(_VersionBody):
    to: int = Field(ge=0)


def completion_rows(request: Request, served: Served) -> list[CompletionRow]:
    key = request.scope.get("state", {}).get("key")
    now = time.time()
    return [
        CompletionRow(
            served.id,
            i,
            now,
            key,
            served.endpoint,
            served.model,
            served.request,
            served.prompt_ids,
            c.token_ids,
            c.logprobs,
            c.versions,
            None if c.routing is None else c.routing.tolist(),
            c.versions[0] if c.versions else -1,
            c.finish_reason,
            c.text,
            served.latency_s,
        )
        for i, c in enumerate(served.outs)
    ]


def create_serving_app(
    engine: Engine,
    model_name: str,
    keys: KeyFile | None,
    store: Store | None,
    versions: Versions | None,
    sessions: str | None = None,
    chat_format=None,
) -> FastAPI:
    """The app around an engine whose loop thread is running (see the module docstring); with
    `sessions`, every chat completion is also appended to that JSONL file (`strop.env.harness.sessions`);
    `chat_format`: the one completions render in (`strop.engine.server.create_app`)."""

    async def log(request: Request, served: Served) -> None:
        if sessions and served.endpoint == "chat":
            conversations = served_conversations(served.request, [c.text for c in served.outs])
            await asyncio.to_thread(append_conversations, sessions, conversations, "--log-sessions")
        if store is None:
            return
        try:
            await asyncio.wrap_future(store.log_completions(completion_rows(request, served)))
        except Exception as e:  # the database refused or is gone: answer nothing the log does not hold
            raise ClientError(503, f"the completion log is unavailable: {type(e).__name__}") from None

    logging = store is not None or sessions
    on_served = log if logging else None
    app = create_app(engine, model_name, path_updates=False, on_served=on_served, chat_format=chat_format)

    if store is not None:

        @app.post("/v1/feedback")
        async def feedback(event: FeedbackEvent, request: Request):
            row = event.row(request.scope.get("state", {}).get("key"))
            status = await asyncio.wrap_future(store.add_feedback(row))
            if status == "unknown":
                raise ClientError(
                    404, f"no completion {event.completion_id!r} with choice {event.choice} was served here"
                )
            if status == "conflict":
                raise ClientError(409, f"event_id {event.event_id!r} was already used for a different event")
            return {"event_id": event.event_id, "status": status}

    if keys is not None and versions is not None:

        async def load(version: int, rollback: bool) -> dict:
            def load_and_apply() -> float:  # rebuilding and checking the tensors is CPU work: off the event loop
                if not rollback and version < engine.version:  # the served one again: reloaded from the store
                    raise ValueError(
                        f"version {version} is older than the served {engine.version}; use /weights/rollback to go back"
                    )
                if rollback and version >= engine.version:
                    raise ValueError(f"a rollback goes to an older version than the served {engine.version}")
                tensors = versions.tensors(version)
                return engine.update_weights(tensors=tensors, version=version, rollback=rollback).wait(300)

            try:
                pause = await asyncio.to_thread(load_and_apply)
            except UnknownVersion as e:
                raise ClientError(404, str(e)) from None
            except ValueError as e:
                raise ClientError(400, str(e)) from None
            return {"version": engine.version, "pause_s": pause}

        @app.post("/weights/update")
        async def weights_update(req: UpdateRequest):
            return await load(req.version, rollback=False)

        @app.post("/weights/rollback")
        async def weights_rollback(req: RollbackRequest):
            return await load(req.to, rollback=True)

    if keys is not None:
        app.add_middleware(Guard, keys=keys)  # added last: the outermost layer, before the body is read
    return app
