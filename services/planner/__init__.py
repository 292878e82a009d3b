"""The planner service: plans deployments and serves stored profiles over gRPC."""
