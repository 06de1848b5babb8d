"""The gRPC metadata plane: handshake, release, directory, health."""
