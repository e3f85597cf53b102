"""Cluster-wide admission control for LLM inference, as an Envoy ext_proc service."""

__version__ = "0.1.0"
