"""The in-process `Engine` as the harness's `PolicyClient` (token ids in, `Generation` out).

Thread-safe: many rollout workers share one engine, whose loop thread batches their turns
together (without a loop thread, `generate` steps the engine itself).
"""

from strop.env.policy import Generation, SamplingParams


class EnginePolicy:
    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        from strop.engine.engine import SamplingParams as EngineParams

        c = self.engine.generate([prompt_ids], EngineParams(
            max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
            stop_token_ids=list(params.stop_token_ids), seed=params.seed))[0]
        if c.finish_reason == "error":
            raise RuntimeError(c.error)
        # engine routing covers every position it read; generated token j came out of position P - 1 + j
        routing = None if c.routing is None else c.routing[len(prompt_ids) - 1:].tolist()
        text = self.engine.tokenizer.decode(c.token_ids, skip_special_tokens=False)
        return Generation(c.token_ids, c.logprobs, c.versions, text, routing, c.finish_reason)
