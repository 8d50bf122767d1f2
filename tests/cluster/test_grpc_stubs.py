"""The checked-in gRPC stubs are what `make proto` generates from the proto today."""

from __future__ import annotations

from halfmoon.cluster.api import generate_stubs


def test_checked_in_stubs_are_current(capsys):
    assert generate_stubs.main(["--check"]) == 0
    assert capsys.readouterr().out == "gRPC stubs are current\n"


def test_stubs_import_through_the_halfmoon_package():
    from halfmoon.cluster.api import halfmoon_pb2_grpc

    assert halfmoon_pb2_grpc.halfmoon_dot_cluster_dot_api_dot_halfmoon__pb2.__name__ == (
        "halfmoon.cluster.api.halfmoon_pb2"
    )
