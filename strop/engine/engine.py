"""The in-process CPU engine: continuous batching over a slot KV cache, sampling, in-flight weight
updates.

Each `step()` applies queued weight updates, admits waiting requests into free slots (their
prompts prefill in the same pass as everyone else's decode token), samples one token per running
request, and retires the finished ones. Every generated token carries its id, its logprob under
the distribution it was actually sampled from (after temperature and top-p), the policy version
that produced it, and for MoE models the experts every position was routed to.

Run it synchronously (`generate`) or on a background thread (`start`; then `submit` from any
thread, with callbacks for streaming). Weight updates land between steps, in place, without
dropping requests; tokens sampled after an update carry the new version (their KV-cache prefix
was computed by the old weights and is kept, as in-flight RL updates do).

Prefix reuse. A finished request's slot is parked with its KV (prompt and generated tokens but the
last, which was never fed back) and the routing of those positions. A new request whose prompt
shares at least `reuse_min` leading tokens with a parked sequence prefills only the rest: when the
prompt extends the whole parked sequence (the next turn of an agent episode, whose prompt is the
previous prompt + completion + tool output) it takes that slot over; when only a shorter prefix is
shared (the system prompt, a sibling of an RL group) the shared KV rows are copied into the slot the
request gets, and the parked entry stays. A request with no match takes a free slot, else evicts
the least recently parked one. Reused KV and routing are those the earlier request computed: after
a weight update they come from the older weights, the same approximation in-flight updates make
for running requests (prompt tokens carry no version); `stale_prefixes=False` (a server) drops
them at each update instead. In deterministic mode a suffix prefilled
against cached keys is bitwise what the full prompt's prefill gives (every op is batch invariant
and attention reads keys in a fixed order).

About 500 lines: the scheduler, the slot cache and prefix reuse share one lock and one step, so
they stay in one module (the forward pass and sampling are in `forward.py` and `sampling.py`).
"""

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from strop.engine.forward import Derived, Forward, Segment
from strop.engine.sampling import Uniforms, sample
from strop.policy_api import SamplingParams


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort" (cancelled, or the engine stopped) | "error"
    routing: np.ndarray | None = None  # [prompt + generated - 1, n_moe_layers, k]: every position the model read
    error: str | None = None


@dataclass
class _Parked:
    """A finished sequence whose KV stays in `slot` until evicted."""

    slot: int
    tokens: np.ndarray  # [T] ids whose KV is cached, positions 0..T-1
    routing: np.ndarray | None  # [T, n_moe_layers, k]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class Request:
    """One generation in flight. `done` is set when `result` is ready."""

    def __init__(
        self, prompt_ids: list[int], params: SamplingParams, on_token: Callable | None, on_done: Callable | None
    ):
        self.prompt_ids, self.params = list(prompt_ids), params
        self.on_token, self.on_done = on_token, on_done
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.routing: list[np.ndarray] = []
        self.text: str | None = None  # set early only when a stop string cut it
        self.slot = -1
        self.reused = 0  # leading prompt tokens whose KV came from a parked sequence
        self.generator = Uniforms(params.seed) if params.seed is not None else None
        self.cancelled = False  # set by Engine.cancel; the loop retires it at its next step
        self.submitted_at = time.perf_counter()
        self.done = threading.Event()
        self.result: Completion | None = None


@dataclass
class WeightUpdate:
    version: int
    tensors: dict | None
    apply_fn: Callable | None
    changed: Collection[str] | None  # the parameters it changes (None: any), whose derived weights are repacked
    derived: Derived | None  # their repacking, prepared off the engine thread (`Forward.prepare`), or None
    done: threading.Event = field(default_factory=threading.Event)
    pause_s: float = 0.0
    error: str | None = None

    def wait(self, timeout: float | None = None) -> float:
        """Block until applied; returns the pause (seconds the engine spent not decoding)."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"weight update to version {self.version} not applied within {timeout}s")
        if self.error:
            raise ValueError(self.error)
        return self.pause_s


def load_weights_file(path: str) -> dict[str, torch.Tensor]:
    """Tensors by live parameter name from a safetensors file or every *.safetensors in a model
    directory (per-expert checkpoint tensors fused as the live model holds them, see
    `strop.model.checkpoint_names`). Raises ValueError with the same message whatever went wrong
    (missing, not a file, not safetensors), so an HTTP client cannot tell which paths exist."""
    from pathlib import Path

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from strop.model.checkpoint_names import fuse_experts

    p = Path(path)
    try:
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
    except (OSError, SafetensorError, ValueError):
        out = {}
    if not out:
        raise ValueError(f"no safetensors weights could be read at {path!r}")
    return fuse_experts(out)


def _notify(callback: Callable | None, req: Request) -> None:
    """Run a caller's callback on the engine thread; its failure is reported, never the engine's."""
    if callback is None:
        return
    try:
        callback(req)
    except Exception:
        import traceback

        traceback.print_exc()


class Engine:
    def __init__(
        self,
        model,
        tokenizer,
        max_batch: int = 64,
        max_len: int | None = None,
        deterministic: bool = False,
        seed: int = 0,
        version: int = 0,
        reuse_min: int = 32,
        stale_prefixes: bool = True,
    ):
        limit = int(model.config.max_position_embeddings)
        if max_batch < 1:  # no slot would ever admit a request: every one would wait forever
            raise ValueError(f"max_batch must be at least 1 (got {max_batch})")
        if max_len is not None and not 2 <= max_len <= limit:
            raise ValueError(f"max_len must be in [2, {limit}] (the model's limit), got {max_len}")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_batch = max_batch
        self.max_len = max_len or min(limit, 2048)
        self.forward = Forward(model, max_batch, self.max_len, deterministic=deterministic)
        self.version = version
        self.generator = Uniforms(seed)
        self.end_ids = sorted(
            {
                i
                for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>"))
                if i is not None and i >= 0
            }
        )
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._updates: deque[WeightUpdate] = deque()
        self._free = list(range(max_batch))
        self.reuse_min = reuse_min  # shortest prefix worth reusing; 0 turns prefix reuse off
        # False: a weight update drops the parked KV, so every reply is what its version computes
        # (a server, whose rollback must serve the old version bit for bit)
        self.stale_prefixes = stale_prefixes
        self._parked: OrderedDict[int, _Parked] = OrderedDict()  # by slot, least recently parked first
        self._lock = threading.Condition()
        self._stepping = threading.Lock()  # without the loop thread, one `generate` caller steps at a time
        self._thread: threading.Thread | None = None
        self._stop = False
        self.pauses: list[float] = []
        self.tokens_generated = 0
        self.peak_batch = 0  # most sequences in one step so far
        self.prefilled_tokens = 0  # prompt tokens run through the model
        self.prefix_reused_tokens = 0  # prompt tokens whose KV came from a parked sequence instead
        self.decoded_tokens = 0  # rows fed back one token at a time (a running request's last token)
        # seconds of forward + sampling, split between prefill and decode by each step's share of their
        # rows (a step runs both in one pass); and seconds requests waited to be admitted (the step under
        # way, or no free slot)
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.queued_s = 0.0

    @classmethod
    def from_checkpoint(cls, path: str, **kwargs) -> "Engine":
        from strop.data.tokenizer import load_tokenizer
        from strop.model.policy import load_model

        return cls(load_model(path), load_tokenizer(path), **kwargs)

    # -- requests ----------------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        on_token: Callable | None = None,
        on_done: Callable | None = None,
    ) -> Request:
        """Queue a request. Raises ValueError for a prompt that cannot fit or bad parameters."""
        params = params or SamplingParams()
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.max_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; this engine holds at most {self.max_len - 1}")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.max_tokens < 1 or params.temperature < 0 or not 0 < params.top_p <= 1:
            raise ValueError("need max_tokens >= 1, temperature >= 0 and 0 < top_p <= 1")
        req = Request(prompt_ids, params, on_token, on_done)
        with self._lock:
            self._waiting.append(req)
            self._lock.notify()
        return req

    def cancel(self, req: Request) -> None:
        """Stop generating for `req` (its client went away): the loop finishes it with reason
        "abort" at its next step, keeping the tokens so far. A finished request is left as it is."""
        with self._lock:
            req.cancelled = True
            self._lock.notify()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Completion]:
        """Generate for every prompt (token ids); batches them together. Works with or without the loop thread."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.submit(p, sp) for p, sp in zip(prompts, plist)]
        if self._thread is None:
            while not all(r.done.is_set() for r in reqs):
                with self._stepping:  # callers on other threads: whoever holds it steps for all of them
                    if not all(r.done.is_set() for r in reqs):
                        self.step()
        for r in reqs:
            r.done.wait()
        return [r.result for r in reqs]

    def stats(self) -> dict:
        return {
            "version": self.version,
            "tokens_generated": self.tokens_generated,
            "peak_batch": self.peak_batch,
            "prefilled_tokens": self.prefilled_tokens,
            "prefix_reused_tokens": self.prefix_reused_tokens,
            "decoded_tokens": self.decoded_tokens,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "queued_s": self.queued_s,
            "swap_s": sum(self.pauses),
            "parked": len(self._parked),
        }

    # -- weights -------------------------------------------------------------------------------

    def update_weights(
        self,
        tensors: dict | None = None,
        apply_fn: Callable | None = None,
        version: int | None = None,
        changed: Collection[str] | None = None,
        derived: Derived | None = None,
        rollback: bool = False,
    ) -> WeightUpdate:
        """Queue new weights: full `tensors` by parameter name, and/or `apply_fn(named_tensors)` that
        mutates them in place (a delta applier), which names the parameters it touches in `changed`
        (only those are repacked; None: every one) and may bring their repacking already prepared
        (`derived`, from `self.forward.prepare`, so the pause only writes and installs). Applied between
        decode steps; returns a handle whose `wait()` gives the pause length.

        `tensors` is checked whole before anything is queued (names, shapes, dtypes, finite values
        after the cast to the live dtype) and `version` may not go back (unless this is a `rollback` to
        an earlier version's weights): a refused update raises ValueError here and leaves the served
        model untouched."""
        tensors = None if tensors is None else self._checked(tensors)
        if apply_fn is not None and changed is None:
            names = None
        else:
            names = {*(tensors or {}), *(changed or ())}
        with self._lock:
            last = self._updates[-1].version if self._updates else self.version
            version = last + 1 if version is None else version
            if version < max(last, 0) and not rollback:
                raise ValueError(f"weights version {version} is older than version {last}; versions never go back")
            upd = WeightUpdate(version, tensors, apply_fn, names, derived)
            self._updates.append(upd)
            self._lock.notify()
        if self._thread is None:
            self._apply_updates()
        return upd

    def _checked(self, tensors: dict) -> dict[str, torch.Tensor]:
        """`tensors` cast to the live dtypes, or ValueError naming the first tensor that does not fit."""
        if not tensors:
            raise ValueError("a weight update needs at least one tensor")
        named = self.named_tensors()
        out = {}
        for name, t in tensors.items():
            live = named.get(name)
            if live is None:
                raise ValueError(f"weight {name!r}: no such tensor in the model")
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(live.shape):
                raise ValueError(
                    f"weight {name!r}: shape {tuple(getattr(t, 'shape', ()))} does not match the "
                    f"model's {tuple(live.shape)}"
                )
            if t.dtype != live.dtype and not (t.dtype.is_floating_point and live.dtype.is_floating_point):
                raise ValueError(f"weight {name!r}: dtype {t.dtype} cannot replace the model's {live.dtype}")
            t = t.detach().to(live.dtype)
            if live.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
                raise ValueError(f"weight {name!r}: holds NaN or infinite values (as {live.dtype})")
            out[name] = t
        return out

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.forward.named)  # tied weights under every name (lm_head.weight too)

    def _apply_updates(self) -> None:
        while True:
            with self._lock:
                if not self._updates:
                    return
                upd = self._updates.popleft()
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    named = self.named_tensors()
                    for name, t in (upd.tensors or {}).items():  # checked whole by update_weights: cannot fail
                        named[name].copy_(t)
                    if upd.apply_fn is not None:
                        upd.apply_fn(named)
                if upd.derived is not None:
                    self.forward.install(upd.derived)
                else:
                    self.forward.refresh(upd.changed)
                self.version = upd.version
                if not self.stale_prefixes:
                    with self._lock:
                        self._free = sorted(self._free + list(self._parked))
                        self._parked.clear()
            except Exception as e:  # reported to the caller; the engine keeps serving
                upd.error = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            upd.pause_s = time.perf_counter() - t0
            self.pauses.append(upd.pause_s)
            upd.done.set()

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> bool:
        """One engine iteration; returns False when there was nothing to do."""
        self._apply_updates()
        with self._lock:
            aborted = [r for r in self._waiting if r.cancelled]
            if aborted:
                self._waiting = deque(r for r in self._waiting if not r.cancelled)
        for r in aborted:  # never admitted: no slot to give back
            self._finish(r, "abort")
        for r in [r for r in self._running if r.cancelled]:
            self._running.remove(r)
            self._finish(r, "abort")
        with self._lock:
            new = []
            while self._waiting and (self._free or self._parked):
                req = self._waiting.popleft()
                self._admit(req)
                new.append(req)
        batch = self._running + new
        if not batch:
            return False
        self.peak_batch = max(self.peak_batch, len(batch))
        segments = [Segment(r.slot, len(r.prompt_ids) + len(r.token_ids) - 1, [r.token_ids[-1]]) for r in self._running]
        segments += [Segment(r.slot, r.reused, r.prompt_ids[r.reused :]) for r in new]
        prefill = sum(len(r.prompt_ids) - r.reused for r in new)
        self.prefilled_tokens += prefill
        self.decoded_tokens += len(self._running)
        t0 = time.perf_counter()
        try:
            logits, routing = self.forward(segments)
            tokens, logprobs = self._sample(
                (logits if logits.dtype == torch.float32 else logits.float()).numpy(), batch
            )
            routing = None if routing is None else routing.numpy()
        except Exception as e:  # fail this batch's requests, keep the engine alive
            self._running = []
            for r in batch:
                self._finish(r, "error", f"{type(e).__name__}: {e}")
            return True
        dt = time.perf_counter() - t0
        share = prefill / (prefill + len(self._running))
        self.prefill_s += dt * share
        self.decode_s += dt * (1 - share)
        row = 0
        for r, seg in zip(batch, segments):
            n = len(seg.tokens)
            if routing is not None:
                r.routing.append(routing[row : row + n])
            row += n
        self._running = []
        for r, tok, lp in zip(batch, tokens, logprobs):
            r.token_ids.append(tok)
            r.logprobs.append(lp)
            r.versions.append(self.version)
            self.tokens_generated += 1
            reason = self._stopped(r)
            _notify(r.on_token, r)
            if reason:
                self._finish(r, reason)
            else:
                self._running.append(r)
        self._running.sort(key=lambda r: r.slot)  # decode rows in slot order read the cache without a gather
        return True

    def _admit(self, req: Request) -> None:
        """Give `req` a slot (caller holds the lock and knows one is free or parked), reusing the
        longest parked prefix of its prompt: `req.reused` leading tokens need no prefill."""
        best, m = None, 0
        if self.reuse_min > 0 and self._parked:
            prompt = np.asarray(req.prompt_ids)
            for entry in self._parked.values():
                n = _common_prefix(prompt, entry.tokens)
                if n > m:
                    best, m = entry, n
            if m < self.reuse_min:
                best, m = None, 0
        # A prompt that holds the whole parked sequence takes its slot over (nothing of it is lost).
        self.queued_s += time.perf_counter() - req.submitted_at
        take_over = best is not None and m == len(best.tokens)
        m = min(m, len(req.prompt_ids) - 1)  # the last prompt token is always run: it gives the logits
        if take_over:
            req.slot = self._parked.pop(best.slot).slot
        else:
            if self._free:
                req.slot = self._free.pop(0)
            else:
                req.slot = self._parked.popitem(last=False)[1].slot
            if best is not None and best.slot != req.slot:  # share a prefix: copy its KV rows
                for kc, vc in zip(self.forward.k_cache, self.forward.v_cache):
                    kc[req.slot, :, :m] = kc[best.slot, :, :m]
                    vc[req.slot, :, :m] = vc[best.slot, :, :m]
                self._parked.move_to_end(best.slot)
        if best is not None:
            req.reused = m
            if best.routing is not None:
                req.routing.append(best.routing[:m])
            self.prefix_reused_tokens += m

    def _sample(self, logits: np.ndarray, batch: list[Request]) -> tuple[list[int], list[float]]:
        """One token per row and its logprob under the distribution sampled from (temperature, then
        top-p renormalised); temperature 0 takes the argmax."""
        return sample(
            logits,
            [r.params.temperature for r in batch],
            [r.params.top_p for r in batch],
            [r.generator for r in batch],
            self.generator,
        )

    def _stopped(self, r: Request) -> str | None:
        p = r.params
        stop_ids = self.end_ids if p.stop_token_ids is None else p.stop_token_ids
        if r.token_ids[-1] in stop_ids:
            return "stop"
        if p.stop:
            text = self.tokenizer.decode(r.token_ids)
            for s in p.stop:
                at = text.find(s)
                if at >= 0:
                    r.text = text[:at]
                    return "stop"
        if len(r.token_ids) >= p.max_tokens or len(r.prompt_ids) + len(r.token_ids) >= self.max_len:
            return "length"
        return None

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        routing = np.concatenate(r.routing) if r.routing else None
        with self._lock:
            # The KV of every token but the last sampled one is cached: park it for a later prompt to extend.
            cached = len(r.prompt_ids) + len(r.token_ids) - 1
            if r.slot < 0:
                pass  # never admitted (aborted while waiting): no slot to give back
            elif reason != "error" and self.reuse_min > 0 and cached >= self.reuse_min:
                tokens = np.asarray(r.prompt_ids + r.token_ids[:-1])
                self._parked[r.slot] = _Parked(r.slot, tokens, None if routing is None else routing.copy())
            else:
                self._free.append(r.slot)
                self._free.sort()
        if r.text is None:  # the stop token itself is not part of the text
            r.text = self.tokenizer.decode(r.token_ids[:-1] if reason == "stop" else r.token_ids)
        r.result = Completion(r.prompt_ids, r.token_ids, r.logprobs, r.versions, r.text, reason, routing, error)
        r.done.set()
        _notify(r.on_done, r)

    def start(self) -> None:
        """Run `step` on a background thread until `stop`."""
        assert self._thread is None, "engine loop already running"
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="strop-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            if not self.step():
                with self._lock:
                    if not (self._waiting or self._updates or self._stop):
                        self._lock.wait(0.05)

    def stop(self) -> None:
        """Stop the loop thread; requests still waiting or running finish with reason "abort", so
        nobody waits on them forever."""
        self._stop = True
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        with self._lock:
            left, self._waiting = list(self._waiting) + self._running, deque()
            self._running = []
        for r in left:
            self._finish(r, "abort", "the engine stopped")
