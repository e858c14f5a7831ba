"""Weight sync: each new bf16 snapshot travels as a lossless delta against the previous one,
through a versioned store and one relay per cluster, into engines' live weights in place. It is
the one weight transport of every runtime (`strop.runtime`) and benchmark. The codec knows
nothing of training; trainers publish and engines apply through it. (`strop sync encode` and
`strop sync decode` are in `strop.commands`.)

    bits.py          Rice codes, fast set-bit positions (vectorised numpy)
    tensor_codec.py  one tensor's delta: exponent-class change masks + ordinal steps
    native_coder.py  the same coder's per-change loops in C (delta_encode.c: encoder, delta_decode.c:
                     decoder), used when a C compiler is at hand; same bytes
    codec.py         the delta file: checksummed header, per-tensor payload/base/result crc32
    tensors.py       raw tensors as bit patterns; safetensors read/write without torch
    store.py         snapshot + delta chain with manifests (local dir or fsspec URL), GC
    pieces.py        a version in pieces: each rank of a sharded trainer publishes its own shards
    publisher.py     the trainer's end, in the trainer's process: encode, store, serve (origin)
    relay.py         HTTP origin and per-cluster relays with token-bucket links
    replica.py       a receiver walking the chain, repairing damage one tensor at a time
    apply.py         an engine's end: verify, stage, swap into live tensors between steps
    synthetic.py     simulated AdamW updates (the benchmark's recipe)
"""
