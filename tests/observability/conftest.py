"""The binaries this directory's tests need, as fixtures (defined in tools.py, which tests/helm imports too)."""

from .tools import prometheus_binary, promtool, redis_server_binary

__all__ = ["prometheus_binary", "promtool", "redis_server_binary"]
