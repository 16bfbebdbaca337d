"""Shared cluster state every tier may use: which prefill worker owns which prefix blocks (`ownership`), and
where the workers are (`worker_registry`, signed Redis registrations), and how what workers write to Redis is signed
and verified (`signing`). Torch-free: the router imports it."""
