"""The transfer engine between two "hosts": two network namespaces joined by a veth pair, each
with an address of its own, a process in each (no memory shared between the two sides). The
writer's layers land intact in the receiver's staging region, named by their landed notices.
Skipped, with the reason, where this machine cannot make namespaces (not root, no
CAP_NET_ADMIN, no `ip`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")
pytestmark = pytest.mark.timeout(180)

PEER = Path(__file__).with_name("netns_peer.py")
# Addresses of the test's own two hosts, in namespaces it makes (and only reachable there).
HOSTS = ("10.231.70.1", "10.231.70.2")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def namespaces():
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) to make network namespaces")
    tag = uuid.uuid4().hex[:6]
    names = (f"hm-a-{tag}", f"hm-b-{tag}")
    try:
        ip("netns", "add", names[0])
    except subprocess.CalledProcessError as error:
        pytest.skip(f"cannot make a network namespace here: {error.stderr.strip()}")
    try:
        ip("netns", "add", names[1])
        ip("link", "add", f"hmv-a-{tag}", "type", "veth", "peer", "name", f"hmv-b-{tag}")
        for name, end, host in zip(names, "ab", HOSTS, strict=True):
            link = f"hmv-{end}-{tag}"
            ip("link", "set", link, "netns", name)
            ip("-n", name, "addr", "add", f"{host}/24", "dev", link)
            ip("-n", name, "link", "set", link, "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield names
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_layers_written_from_one_namespace_land_intact_in_the_other(namespaces):
    writer_ns, receiver_ns = namespaces
    run = ["ip", "netns", "exec"]
    receiver = subprocess.Popen(
        [*run, receiver_ns, sys.executable, str(PEER), "receive", HOSTS[1]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        grant = json.loads(receiver.stdout.readline())
        assert grant["session"].startswith(HOSTS[1] + ":")
        written = subprocess.run(
            [*run, writer_ns, sys.executable, str(PEER), "write", HOSTS[0], json.dumps(grant)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert written.returncode == 0, written.stderr[-4000:]
        counters = json.loads(written.stdout.splitlines()[-1])
        outcome = json.loads(receiver.stdout.readline())
    finally:
        receiver.kill()
        receiver.wait()
    assert outcome == {"landed": [0, 1, 2, 3], "intact": True}
    assert counters["num_engine_writes"] == 8  # K and V of each of 4 layers
    assert counters["engine_bytes_written"] == 8 * 8 * 16 * 4 * 64 * 2
