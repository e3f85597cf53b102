"""The Envoy ext_proc wire types, imported from one place.

Every module that speaks the ext_proc protocol imports the generated messages from here, so where
the stubs come from is decided in this file alone.
"""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2

__all__ = ["base_pb2", "http_status_pb2", "pb", "pb_grpc", "processing_mode_pb2"]
