"""Errors of the model runtime. Each message names what is wrong and what to do about it."""


class CheckpointError(ValueError):
    """A checkpoint directory that kvctl cannot load; the message starts with the file at fault."""


def brief(text: str, limit: int = 120) -> str:
    """`text` fit for a one-line message: names read from a hostile file may be huge or hold
    newlines."""
    if not text.isprintable():
        text = repr(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class KVCacheFull(RuntimeError):
    """The contiguous KV cache has no room for a step: no free sequence slot, or a sequence would
    grow past the length its slot was reserved for."""
