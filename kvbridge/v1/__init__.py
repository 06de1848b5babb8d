"""Generated protobuf/gRPC stubs for proto/kvbridge/v1 (do not edit; see proto/README.md)."""
