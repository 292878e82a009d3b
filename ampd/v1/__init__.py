"""Generated from proto/ampd/v1 by `make proto`; do not edit."""
