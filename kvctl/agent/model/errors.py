"""Errors of the model runtime. Each message names what is wrong and what to do about it."""


class CheckpointError(ValueError):
    """A checkpoint directory that kvctl cannot load; the message starts with the file at fault."""


class KVCacheFull(RuntimeError):
    """The contiguous KV cache has no room for a step: no free sequence slot, or a sequence would
    grow past the length its slot was reserved for."""
