"""The serving kit the tiers share: the gRPC shell (health, reflection, drain, status mapping), auth, Prometheus
metrics, proto <-> dataclass conversion, the engine thread (`engine_loop`), worker warm-up and what both worker
services share (`worker_common`). `grpc_shell`, `auth`, `metrics` and `rpc_convert` import no torch (the router
uses them); the rest drive an engine."""
