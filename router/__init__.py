"""pdserve.router (see the README for its role)."""
