"""pdserve.kv_transfer (see the README for its role)."""
