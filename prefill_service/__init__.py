"""pdserve.prefill_service (see the README for its role)."""
