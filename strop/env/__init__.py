"""The environment: a world (sandbox), the production harness and its tools, the reward checker,
the reward-hack monitor, and the task suites. It knows nothing of the trainer or of a particular
engine: the harness is handed a policy client."""
