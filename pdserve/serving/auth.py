"""Who may call what: a shared token on the internal endpoints, API keys on the router, TLS on every gRPC link.

- Internal (router -> prefill/decode gRPC, prefill -> decode KV over TCP): every call carries the shared
  `--internal-token` (gRPC metadata `authorization: Bearer <token>`; the TCP HELLO's `token`). Workers started with
  a token refuse anything else with UNAUTHENTICATED (the KV receiver with HELLO_ERROR).
- Client-facing: a router started with `--api-key K` (repeatable) accepts only `authorization: Bearer K`.
- TLS: `--tls-cert/--tls-key` make a server speak TLS; `--tls-ca` is the CA a process trusts when it dials
  (the router dialing workers, `pdserve bench` dialing the router).

Tokens are compared with hmac.compare_digest. The gRPC health service stays open so load balancers and
orchestrators can probe without secrets; it reveals nothing but SERVING / NOT_SERVING.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import grpc

from pdserve.serving.grpc_shell import deny

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


@dataclass(frozen=True)
class SecurityConfig:
    internal_token: Optional[str] = None  # required by workers; sent by the router and prefill workers
    api_keys: tuple[str, ...] = ()  # router only: accepted client keys (empty: no key needed)
    tls_cert: Optional[str] = None  # PEM file: this server's certificate chain
    tls_key: Optional[str] = None  # PEM file: its private key
    tls_ca: Optional[str] = None  # PEM file: the CA this process trusts when it dials a TLS server

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both (PEM files) or neither")
        if self.internal_token == "":
            raise ValueError("--internal-token must not be empty")
        if any(not k for k in self.api_keys):
            raise ValueError("--api-key must not be empty")

    def server_credentials(self) -> Optional[grpc.ServerCredentials]:
        if not self.tls_cert:
            return None
        return grpc.ssl_server_credentials([(_read(self.tls_key), _read(self.tls_cert))])

    def channel(self, address: str, options: Sequence[tuple] = ()) -> grpc.aio.Channel:
        """An asyncio channel to a server of this deployment: TLS when a CA is given, else plaintext."""
        if self.tls_ca:
            creds = grpc.ssl_channel_credentials(root_certificates=_read(self.tls_ca))
            return grpc.aio.secure_channel(address, creds, options=list(options))
        return grpc.aio.insecure_channel(address, options=list(options))

    def internal_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata for calls to workers."""
        return bearer_metadata(self.internal_token)


def bearer_metadata(token: Optional[str]) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def token_accepted(presented: Optional[str], accepted: Iterable[str]) -> bool:
    """Constant-time comparison against every accepted token (no early exit on the first match)."""
    if presented is None:
        return False
    ok = False
    for token in accepted:
        ok |= hmac.compare_digest(presented.encode(), token.encode())
    return ok


def presented_token(metadata) -> Optional[str]:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call (except health checks) whose `authorization: Bearer` token is not accepted."""

    def __init__(self, accepted: Iterable[str], what: str):
        self.accepted, self.what = tuple(accepted), what  # what: e.g. "--internal-token", named in the refusal

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        if token_accepted(presented_token(details.invocation_metadata), self.accepted):
            return handler
        return deny(handler, grpc.StatusCode.UNAUTHENTICATED,
                    f"missing or wrong credentials: send metadata 'authorization: Bearer <token>' with the "
                    f"server's {self.what}")


def internal_auth(security: SecurityConfig) -> list[grpc.aio.ServerInterceptor]:
    """The token check of a worker's gRPC server (none without --internal-token)."""
    if security.internal_token is None:
        return []
    return [BearerAuthInterceptor([security.internal_token], "--internal-token")]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
