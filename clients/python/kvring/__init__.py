"""kvring: the Python client of a kvring KV-cache cluster.

    import kvring
    c = kvring.Client("127.0.0.1:7400", token)
    layout = kvring.Layout(block_tokens=16, layers=32, kv_heads=8, head_dim=128, dtype="bf16")
    keys = c.chain("llama-3-8b", layout, tokens)      # (n, 2) uint64: one key per full block
    held = c.lookup(keys)                              # longest cached prefix, in blocks
    c.put(keys[held:], blocks[held:], layout, parent=keys[held - 1] if held else None)
    found = c.get_into(keys[:held], layout, pool)      # straight into your array

Submodules: kvring.connector (what an engine calls: lookup/load/attend/save)
and kvring.engine (a tiny numpy transformer for tests and demos).
Errors raise kvring.Error subclasses named after the status code.
"""
from ._kvring import (  # noqa: F401
    AlreadyExistsError,
    Client,
    DataLossError,
    DeadlineExceededError,
    Error,
    FailedPreconditionError,
    InvalidArgumentError,
    Layout,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    create_tenant,
    merge,
)

__all__ = [
    "Client", "Layout", "merge", "create_tenant", "Error", "InvalidArgumentError", "NotFoundError",
    "AlreadyExistsError", "PermissionDeniedError", "UnauthenticatedError", "ResourceExhaustedError",
    "FailedPreconditionError", "UnavailableError", "DeadlineExceededError", "DataLossError",
]
