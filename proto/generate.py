"""Regenerate the gRPC/protobuf Python stubs next to the .proto files.

One documented command: ``make protos`` (= ``python -m kvpool.proto.generate``). The stubs are committed;
``tests/test_proto_fresh.py`` regenerates into a temp dir and fails if they differ.

protoc is run with the virtual include root ``kvpool/proto=proto`` so generated imports read
``from kvpool.proto import common_pb2`` (never a top-level ``proto`` package, which proto-plus owns).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("common.proto", "master.proto", "node.proto", "prefill.proto", "decode.proto")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc for every contract; write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` into out_dir."""
    import grpc_tools
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        well_known = Path(grpc_tools.__file__).parent / "_proto"
        args = [
            "protoc",
            f"-I{PROTO_DIR.parent}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(PROTO_DIR / name) for name in PROTO_FILES),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        written = []
        for path in sorted((Path(tmp) / PROTO_DIR.name).glob("*_pb2*")):
            text = path.read_text()
            # protoc writes `from proto import x_pb2`; our installed package is kvpool.proto
            text = text.replace("from proto import ", "from kvpool.proto import ")
            target = out_dir / path.name
            target.write_text(text)
            written.append(target)
        return written


def main() -> int:
    for path in generate(PROTO_DIR):
        print(f"wrote {path.relative_to(PROTO_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
