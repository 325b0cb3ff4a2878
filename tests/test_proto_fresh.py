"""The committed gRPC stubs are exactly what `make protos` generates from the .proto contracts."""

from pathlib import Path

from kvpool.proto.generate import PROTO_DIR, generate


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    written = generate(tmp_path)
    assert written, "protoc produced nothing"
    stale = [p.name for p in written if (PROTO_DIR / p.name).read_text() != p.read_text()]
    assert not stale, f"stale stubs (run `make protos`): {stale}"


def test_stubs_import_under_kvpool_namespace() -> None:
    from kvpool.proto import master_pb2, master_pb2_grpc, node_pb2_grpc

    assert master_pb2.MatchPrefixRequest(block_hashes=[b"\0" * 32]).block_hashes[0] == b"\0" * 32
    assert hasattr(node_pb2_grpc, "StorageNodeStub")
    assert not hasattr(master_pb2_grpc, "MasterStub")  # the master's calls travel only over the master wire
