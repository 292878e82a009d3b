"""AMPD: multi-round LLM serving over prefill/decode-disaggregated workers (docs/architecture.md)."""
import os as _os

# gRPC's TCP endpoints: grpc's older iomgr ones, not its EventEngine ones (the default of grpcio
# 1.85). With EventEngine every message crosses one more thread hop on each side (an EventEngine
# thread, then the poller thread of grpc.aio, then the event loop); measured between two processes
# here, a call-stream round trip took P50 0.37-0.42 ms instead of 0.74-0.79 ms and ~30 % less CPU
# on both sides. grpc reads the variable once, when it is first imported: every AMPD process
# imports this package before grpc (services/__init__.py imports it first). An operator's own
# GRPC_EXPERIMENTS wins.
_os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_client,-event_engine_listener")
