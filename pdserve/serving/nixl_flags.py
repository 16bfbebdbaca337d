"""--nixl-backend as both worker tiers and `pdserve up` take it. Torch-free: `up` checks it before any worker starts,
in the process that then runs the router, where torch's import would hold back every worker's start by seconds."""

from __future__ import annotations


def check_nixl_backend(kv_transport: str, nixl_backend: "str | None") -> None:
    """ValueError when a NIXL backend is named for a worker whose KV does not move over NIXL."""
    if nixl_backend is not None and kv_transport != "nixl":
        raise ValueError(f"--nixl-backend {nixl_backend} is for --kv-transport nixl (here: --kv-transport {kv_transport})")


def nixl_options(nixl_backend: "str | None") -> dict[str, str]:
    """The KV sender's and receiver's options for a named NIXL backend (their agents load it as they are made, so a
    backend NIXL does not have here stops the worker at start, naming the ones it has)."""
    return {} if nixl_backend is None else {"backend": nixl_backend}
