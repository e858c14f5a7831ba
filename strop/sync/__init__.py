"""Weight sync: each new bf16 snapshot travels as a lossless delta against the previous one,
through a versioned store and one relay per cluster, into engines' live weights in place.
The codec knows nothing of training; trainers publish and engines apply through it.

    bits.py          Rice codes, fast set-bit positions (vectorised numpy)
    tensor_codec.py  one tensor's delta: exponent-class change masks + ordinal steps
    native_coder.py  the same coder's per-change loops in C (csrc.py: encoder, csrc_decode.py:
                     decoder), used when a C compiler is at hand; same bytes
    codec.py         the delta file: checksummed header, per-tensor payload/base/result crc32
    tensors.py       raw tensors as bit patterns; safetensors read/write without torch
    store.py         snapshot + delta chain with manifests (local dir or fsspec URL), GC
    replica.py       a receiver walking the chain, repairing damage one tensor at a time
    relay.py         HTTP origin and per-cluster relays with token-bucket links
    topology.py      a 4-cluster fan-out on 127.0.0.1: egress and time to all engines
    apply.py         swap a verified delta into an engine's live tensors between steps
    memory.py        keep freed heap memory (no page faults for short-lived arrays)
    synthetic.py     simulated AdamW updates (the benchmark's recipe)
    encode_cmd.py, decode_cmd.py   `strop sync encode` / `strop sync decode`
"""
