"""Weight sync: a lossless delta codec for bf16/fp32 state dicts (`codec`), a versioned store of
snapshots and deltas with manifests (`store`), per-cluster relays (`relay`) and in-place engine
apply (`apply`). The codec knows nothing of training; engines and trainers call into it."""
