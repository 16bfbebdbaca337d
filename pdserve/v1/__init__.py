"""Generated gRPC code for the pdserve.v1 protos (scripts/gen_protos.sh); do not edit."""
