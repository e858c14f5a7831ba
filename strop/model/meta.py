"""A policy built without its weights: parameters on the meta device (no memory, no init cost),
buffers (rotary frequencies, computed from the config) real, then given storage on a device.

Two users: a sharded trainer builds on meta, shards, and has each rank read its own rows
(`strop.train.shard_load`); an engine on a node without the policy builds it from the config the
weight store holds and fills it from the store (`strop.engine.bootstrap`). torchtitan's order:
build on meta, transform, materialise, load.
"""

import contextlib

import torch


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside it get their parameters on the meta device (no memory, no init cost)
    and their buffers on the CPU, as usual."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:  # one already there is kept: ties stay ties
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def build_on_meta(config):
    """An fp32 causal LM of the Hugging Face `config`, its parameters on meta, its buffers on the CPU."""
    from transformers import AutoModelForCausalLM

    from strop.model.policy import experts_implementation

    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, experts_implementation=experts_implementation()
        )


@torch.no_grad()
def materialize(model, device: torch.device | str) -> None:
    """Give a model built on meta (and perhaps sharded since) storage on `device`: its parameters
    uninitialised, its buffers with the values they were built with, tied parameters (a head tied
    to the embedding) still one parameter."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    places: dict[int, list[tuple[torch.nn.Module, str]]] = {}  # id(parameter) -> where it is registered
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)  # buffers too: restored next
    for (first, first_name), *others in places.values():  # to_empty gives each registration its own copy
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    for name, b in model.named_buffers():
        b.copy_(buffers[name])
