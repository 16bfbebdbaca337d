"""pdserve.decode_service (see the README for its role)."""
