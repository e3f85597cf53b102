"""The Envoy ext_proc wire types, imported from one place.

Every module that speaks the ext_proc protocol imports the generated messages from here, so where
the stubs come from is decided in this file alone: extproc/_proto/, compiled by
scripts/generate_protos.py (`make generate`) from the Envoy API files vendored in proto/ (see
proto/README.md for their commits). Those stubs register the .proto files in protobuf's default
descriptor pool under their Envoy names, so no other copy of them (xds-protos, say) may be imported
in the same process.
"""

from __future__ import annotations

from extproc._proto.envoy.config.core.v3 import base_pb2
from extproc._proto.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from extproc._proto.envoy.service.ext_proc.v3 import (
    external_processor_pb2 as pb,
    external_processor_pb2_grpc as pb_grpc,
)
from extproc._proto.envoy.type.v3 import http_status_pb2

__all__ = ["base_pb2", "http_status_pb2", "pb", "pb_grpc", "processing_mode_pb2"]
