"""Keep Python's cycle collector off the objects a process builds once and keeps.

A full collection visits every container object the process holds. After importing torch and
transformers and building a model, an RL run's trainer and engine processes hold ~400k of them
(functions, tuples, dicts of modules; the step's own data is a few tens of thousands), and each
full collection, a dozen in 12 RL steps, scanned them all again: 4-6 s of collections in each
process, up to 1.6 s at a time on the busy cores, the GIL held throughout, so the engines'
loops and the rollout threads stood still with it (measured with a `gc.callbacks` timer,
`strop train` on the demo's warm start, 12 steps; frozen: 1.5 s and 3.0 s). `freeze_long_lived`,
called once a process has set up, moves what is alive into the permanent generation, where
collections do not look.
Reference counting still frees those objects; only a reference cycle among them that dies later is
never collected, which setup objects (modules, models, engines) do not do before exit.
"""

import gc


def freeze_long_lived() -> None:
    """Collect what is garbage now, then exempt every surviving object from future collections."""
    gc.collect()
    gc.freeze()
