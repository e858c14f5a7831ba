"""One client interface to any engine: `EngineClient` speaks the OpenAI-compatible HTTP API (the
strop server, vLLM, SGLang), `InProcessClient` calls an `Engine` in the same process. Both return
`Generation`s with the token ids, per-token logprobs and, where the server provides them, policy
versions and routed experts, so a harness or an RL worker cannot tell them apart.

Against vLLM, start it with `--enable-return-routed-experts` to get routing; the extra request
fields (`return_token_ids`, `return_routed_experts`) are ignored by servers that do not know them.
"""

from dataclasses import dataclass

import numpy as np


@dataclass
class Generation:
    text: str  # for chat: the raw assistant text (content and tool-call blocks), stop token excluded
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_token_ids: list[int] | None = None
    versions: list[int] | None = None  # policy version per token (strop engines)
    routed_experts: np.ndarray | None = None  # [positions, MoE layers, top_k]
    content: str | None = None  # chat: parsed message content
    tool_calls: list[dict] | None = None  # chat: OpenAI-format tool calls


class EngineError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"engine returned {status}: {message}")
        self.status, self.message = status, message


def _sampling(max_tokens: int, temperature: float, top_p: float, stop: list[str] | None, seed: int | None) -> dict:
    body = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
    if stop:
        body["stop"] = stop
    if seed is not None:
        body["seed"] = seed
    return body


class EngineClient:
    """Blocking HTTP client; thread-safe (one httpx connection pool), so rollout threads share one."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str = "EMPTY", timeout: float = 600.0):
        import httpx

        self.base = base_url.rstrip("/").removesuffix("/v1")
        self.http = httpx.Client(timeout=timeout, headers={"Authorization": f"Bearer {api_key}"})
        self._model = model

    def _post(self, path: str, body: dict) -> dict:
        r = self.http.post(self.base + path, json=body)
        return self._json(r)

    def _json(self, r) -> dict:
        if r.status_code >= 400:
            try:
                message = r.json().get("error", {}).get("message") or r.text
            except ValueError:
                message = r.text
            raise EngineError(r.status_code, message)
        return r.json()

    def models(self) -> list[str]:
        return [m["id"] for m in self._json(self.http.get(self.base + "/v1/models"))["data"]]

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self.models()[0]
        return self._model

    def health(self) -> bool:
        try:
            return self.http.get(self.base + "/health").status_code == 200
        except Exception:  # any transport failure means "not healthy"
            return False

    def complete(self, prompt: str | list[int], max_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0,
                 stop: list[str] | None = None, seed: int | None = None, routed_experts: bool = False) -> Generation:
        body = {"model": self.model, "prompt": prompt, "logprobs": 1, "return_token_ids": True,
                "return_routed_experts": routed_experts, **_sampling(max_tokens, temperature, top_p, stop, seed)}
        choice = self._post("/v1/completions", body)["choices"][0]
        lp = choice.get("logprobs") or {}
        return Generation(choice["text"], choice.get("token_ids") or [], lp.get("token_logprobs") or [],
                          choice["finish_reason"], choice.get("prompt_token_ids"), choice.get("policy_versions"),
                          _routing(choice))

    def chat(self, messages: list[dict], tools: list[dict] | None = None, max_tokens: int = 512, temperature: float = 1.0,
             top_p: float = 1.0, stop: list[str] | None = None, seed: int | None = None, routed_experts: bool = False) -> Generation:
        body = {"model": self.model, "messages": messages, "logprobs": True, "return_token_ids": True,
                "return_routed_experts": routed_experts, **_sampling(max_tokens, temperature, top_p, stop, seed)}
        if tools:
            body["tools"] = tools
        choice = self._post("/v1/chat/completions", body)["choices"][0]
        msg = choice["message"]
        lps = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
        return Generation(_chat_text(msg), choice.get("token_ids") or [], lps, choice["finish_reason"],
                          choice.get("prompt_token_ids"), choice.get("policy_versions"), _routing(choice),
                          msg.get("content"), msg.get("tool_calls"))

    def weights_version(self) -> int:
        return int(self._json(self.http.get(self.base + "/weights/version"))["version"])

    def update_weights(self, path: str, version: int | None = None) -> dict:
        """Make the server load weights from a safetensors file or model directory it can read."""
        return self._post("/weights/update", {"path": path, "version": version})

    def close(self) -> None:
        self.http.close()


def _routing(choice: dict) -> np.ndarray | None:
    r = choice.get("routed_experts")
    return None if r is None else np.asarray(r, dtype=np.int16)


def _chat_text(message: dict) -> str:
    from strop.data.chat import render_message

    body = render_message({"role": "assistant", **message})  # "<|im_start|>assistant\n...<|im_end|>\n"
    return body[len("<|im_start|>assistant\n") : -len("<|im_end|>\n")]


class InProcessClient:
    """The same interface over an `Engine` in this process (harness and RL in one process)."""

    def __init__(self, engine, model: str = "strop"):
        self.engine, self.model = engine, model

    def models(self) -> list[str]:
        return [self.model]

    def health(self) -> bool:
        return True

    def complete(self, prompt: str | list[int], max_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0,
                 stop: list[str] | None = None, seed: int | None = None, routed_experts: bool = False) -> Generation:
        from strop.engine.engine import SamplingParams

        ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        c = self.engine.generate([ids], SamplingParams(max_tokens, temperature, top_p, list(stop or []), [], seed))[0]
        return Generation(c.text, c.token_ids, c.logprobs, c.finish_reason, c.prompt_ids, c.versions,
                          c.routing if routed_experts else None)

    def chat(self, messages: list[dict], tools: list[dict] | None = None, max_tokens: int = 512, temperature: float = 1.0,
             top_p: float = 1.0, stop: list[str] | None = None, seed: int | None = None, routed_experts: bool = False) -> Generation:
        from strop.data.chat import IM_END, parse_assistant, render
        from strop.engine.engine import SamplingParams

        tok = self.engine.tokenizer
        ids = tok.encode(render(messages, tools, add_generation_prompt=True))
        sp = SamplingParams(max_tokens, temperature, top_p, list(stop or []), [tok.convert_tokens_to_ids(IM_END)], seed)
        c = self.engine.generate([ids], sp)[0]
        turn = parse_assistant(c.text)
        calls = [tc.to_openai() for tc in turn.tool_calls] or None
        finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        return Generation(c.text, c.token_ids, c.logprobs, finish, c.prompt_ids, c.versions,
                          c.routing if routed_experts else None, turn.content or None, calls)

    def weights_version(self) -> int:
        return self.engine.version

    def update_weights(self, path: str, version: int | None = None) -> dict:
        from strop.engine.engine import load_weights_file

        pause = self.engine.update_weights(tensors=load_weights_file(path), version=version).wait(300)
        return {"version": self.engine.version, "pause_s": pause}
