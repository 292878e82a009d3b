import ampd  # noqa: F401 - before any service imports grpc: it sets gRPC's transport (ampd/__init__.py)
