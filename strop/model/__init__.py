"""Policy models: Hugging Face causal LMs (dense or MoE) built from a tiny config or loaded from a
local directory; routing capture and replay; the deterministic-ops mode. Knows nothing of training."""
