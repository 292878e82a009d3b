"""Engines: the Engine protocol and its backends."""
