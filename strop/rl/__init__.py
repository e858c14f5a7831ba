"""Reinforcement learning: the trajectory record (`trajectory`), the staleness-bounded buffer that
paces rollout producers (`buffer`), group-relative advantages (`advantages`), the off-policy
corrected policy-gradient loss (`loss`) and the trainer that runs it and publishes versions
(`trainer`). The trainer is algorithm-blind: it is handed per-sample advantages and weights."""
