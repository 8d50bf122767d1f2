"""Ctrl-C while `halfmoon serve` is still starting stops what it started and exits 130 with a
line saying so, not a traceback."""

from __future__ import annotations

from halfmoon.cluster import serve as serve_module
from halfmoon.cluster.config import load_config


def test_ctrl_c_while_starting_stops_the_cluster_and_exits_130(monkeypatch, capsys):
    stopped = []

    class Starting(serve_module.Cluster):
        def start(self):
            raise KeyboardInterrupt

        def stop(self):
            stopped.append(True)

    monkeypatch.setattr(serve_module, "Cluster", Starting)
    assert serve_module.serve(load_config(None, {"model": "unused"})) == 130
    assert stopped == [True]
    assert "interrupted while starting" in capsys.readouterr().err
