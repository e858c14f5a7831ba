"""The in-process `Engine` as the harness's `PolicyClient` (token ids in, `Generation` out).

Thread-safe: many rollout workers share one engine, whose loop thread batches their turns
together (without a loop thread, `generate` steps the engine itself).
"""

from strop.policy_api import Generation, SamplingParams, generated_routing


class EnginePolicy:
    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        c = self.engine.generate([prompt_ids], params)[0]
        if c.finish_reason == "error":
            raise RuntimeError(c.error)
        routing = generated_routing(c.routing, len(prompt_ids), len(c.token_ids))
        text = self.engine.tokenizer.decode(c.token_ids, skip_special_tokens=False)
        return Generation(c.token_ids, c.logprobs, c.versions, text, routing, c.finish_reason)
