"""Where components run: `inline` (one process, threads) or `ray/` (actors placed on trainer and
inference nodes by label); `rl_run.py` builds an RL run from a config and runs or resumes it;
`trainers.py` and `ranks.py` the trainer in a process and its local ranks; `engines.py` the engines
by `rollout.engine`; `cpus.py` how a machine's cores are split; `weights.py` keeps any runtime's
engines current through the weight transport (`strop.sync`)."""


def record_trained(runtime) -> list:
    """Wrap `runtime.train` to record every trained trajectory's key, for the runs that check that
    nothing is trained twice when engines join and die (the runtime tests, `strop bench scaleout`)."""
    trained: list = []
    train = runtime.train

    def recording_train(samples):
        trained.extend(s.trajectory.key for s in samples)
        return train(samples)

    runtime.train = recording_train
    return trained
