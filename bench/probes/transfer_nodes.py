"""`halfmoon bench transfer --across-nodes`: moving KV between two Ray nodes (issue 48), three
paths side by side in one run. `ray`: today's path, the KV as Ray objects (ray.put on the
sender's node, ray.get on the receiver's: copied through both nodes' object stores, then into the
receiver's buffer). `engine`: Mooncake's Transfer Engine over TCP through halfmoon's wrapper
(kvstore/transfer/engine.py), writing straight into the receiver's registered buffer, the landed
notify with the last piece. `tcp`: the machine's raw limit, one plain socket between the same
two processes. `nixl`, when NIXL is there (--nixl DIR, by default .peers-nixl of `make
nixl-peer`; else skipped, the reason printed): NIXL's UCX over TCP (bench/probes/transfer_nixl.py,
which also prints the report), a peer to compare the engine with. The nodes are a head and one
more node of a ray.cluster_utils.Cluster on this machine (every address 127.0.0.1), an actor
pinned on each by a custom resource.

Per path, the median over --repeats of three moves. The unit (--unit-mib) sent whole, nothing
paced: its bytes/s. One layer (the unit / --layers) alone: one layer's move. The stall after the
last layer: the unit sent as --layers layers, each once it is "computed" (--layer-compute-ms
apart; by default twice the slowest path's one-layer move, so compute is slower than every
move, as in a real prefill), timed from the last layer being ready on the sender to the
receiver knowing all landed (the engine's notify read, the Ray object held and copied, the
socket's bytes read), over one layer's move. The engine is tried at each --pieces (pieces of one
batch write) and --in-flight (writes outstanding at once, from as many threads: the unit split
that many ways; a layer is sent whole, alone as in the paced run); each variant and the best are
reported. Every time is CLOCK_MONOTONIC, one clock for all the processes of the machine."""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate

import numpy as np
import ray
from ray._private import ray_constants
from ray.cluster_utils import Cluster as RayCluster

from halfmoon.bench.device import int_list
from halfmoon.bench.options import bench_parser
from halfmoon.bench.probes import transfer_nixl as nixl
from halfmoon.kvstore.config import TransferSettings
from halfmoon.kvstore.transfer.engine import open_endpoint

MiB = 1 << 20
HOST = "127.0.0.1"
POLL_S = 0.0002  # between reads of the engine's notifies, as decode_worker/engine_receive.py
WAIT_S = 120.0  # the longest one move may take
GOALS = {  # issue 48's: each ratio at least (>=) or at most (<=) its bound
    "engine_over_tcp": (">=", 0.6),
    "engine_over_ray": (">=", 2.5),
    "engine_stall_over_layer": ("<=", 1.5),
}


def split(num_bytes: int, parts: int) -> list[int]:
    """`num_bytes` in `parts` near-equal sizes."""
    base, extra = divmod(num_bytes, parts)
    return [base + (i < extra) for i in range(parts)]


def offsets(sizes: list[int]) -> list[int]:
    return list(accumulate(sizes[:-1], initial=0))


class Side:
    """One end of every path, on a node of its own: a unit's buffer (the sender's source, the
    receiver's destination), an engine endpoint and a socket."""

    def __init__(self, unit_bytes: int) -> None:
        self.buf = np.full(unit_bytes, 7, np.uint8)
        self.endpoint = self.nixl = None
        self.server = self.conn = None
        self.cond = threading.Condition()
        self.landed, self.expected = [], 0  # the current move's landed times, and how many
        self.held: list = []  # the sender's Ray objects of the last move

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def open_engine(self, register: bool) -> tuple[str, int]:
        """This process's engine endpoint: its session and the buffer's address."""
        self.endpoint, path = open_endpoint(TransferSettings(engine="mooncake"), HOST)
        if self.endpoint is None:
            raise RuntimeError(path)
        if register:  # the destination; the TCP transport reads any source
            self.endpoint.register(self.buf.ctypes.data, self.buf.nbytes)
        return self.endpoint.session, self.buf.ctypes.data

    def open_nixl(self, directory: str, name: str) -> tuple | str:
        """This process's NIXL agent, the buffer registered: its card, or why it failed."""
        try:
            self.nixl = nixl.NixlEnd(directory, name, self.buf.ctypes.data, self.buf.nbytes)
        except Exception as error:  # noqa: BLE001 - a broken peer is skipped, never a crash
            return f"NIXL did not start: {type(error).__name__}: {error}"
        return self.nixl.card()

    def meet_nixl(self, card: tuple) -> None:
        self.nixl.meet(card)

    def listen(self) -> int:
        self.server = socket.create_server((HOST, 0))
        return self.server.getsockname()[1]

    def connect(self, port: int) -> None:
        self.conn = socket.create_connection((HOST, port))
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def accept(self) -> None:
        self.conn, _ = self.server.accept()

    # The receiver's side.
    def expect(self, path: str, tag: str, sizes: list[int]) -> None:
        """Be ready for one move of layers of `sizes` (laid out in turn in the buffer)."""
        self.landed, self.expected = [], len(sizes)
        if path == "tcp":
            threading.Thread(target=self._read_socket, args=(sizes,), daemon=True).start()
        elif path == "engine":
            threading.Thread(target=self._read_notifies, args=(tag,), daemon=True).start()
        elif path == "nixl":
            nixl_args = (self.nixl, tag, len(sizes), self._land, POLL_S, WAIT_S)
            threading.Thread(target=nixl.poll_notifs, args=nixl_args, daemon=True).start()

    def _land(self, count: int = 1) -> None:
        now = time.monotonic()
        with self.cond:
            self.landed.extend([now] * count)
            self.cond.notify_all()

    def _read_socket(self, sizes: list[int]) -> None:
        view, at = memoryview(self.buf), 0
        for size in sizes:
            end = at + size
            while at < end:
                at += self.conn.recv_into(view[at:end])
            self._land()

    def _read_notifies(self, tag: str) -> None:
        seen, deadline = 0, time.monotonic() + WAIT_S
        while seen < self.expected and time.monotonic() < deadline:
            if count := sum(name == tag for name, _ in self.endpoint.notifies()):
                seen += count
                self._land(count)
            else:
                time.sleep(POLL_S)

    def take(self, refs: list, offset: int) -> None:
        """A layer of the Ray path: held, then copied into place."""
        layer = ray.get(refs[0])
        self.buf[offset : offset + layer.nbytes] = layer
        self._land()

    def wait_landed(self) -> list[float]:
        """When each layer of the move landed, once all have."""
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.landed) >= self.expected, WAIT_S):
                raise TimeoutError(f"{len(self.landed)} of {self.expected} layers landed")
            return list(self.landed)

    # The sender's side.
    def send(self, path, peer, tag, sizes, compute_s, pieces=1, in_flight=1):
        """Send layer i of `sizes` once it is ready (`compute_s` after the one before it, all
        at once for 0); returns the start and the last layer's ready time."""
        self.held = []
        start, jobs = time.monotonic(), []
        with ThreadPoolExecutor(in_flight) as pool:
            for i, (at, size) in enumerate(zip(offsets(sizes), sizes, strict=True)):
                ready = start + (i + 1) * compute_s
                time.sleep(max(0.0, ready - time.monotonic()))
                args = (path, peer, tag, at, size, pieces)
                if in_flight == 1:
                    self._send_one(*args)
                else:
                    jobs.append(pool.submit(self._send_one, *args))
            for job in jobs:
                job.result()
        return start, start + len(sizes) * compute_s

    def _send_one(self, path, peer, tag, at, size, pieces) -> None:
        if path == "tcp":
            self.conn.sendall(memoryview(self.buf)[at : at + size])
        elif path == "ray":
            ref = ray.put(self.buf[at : at + size])
            self.held.append((ref, peer.take.remote([ref], at)))
        elif path == "nixl":
            self.nixl.write(at, size, tag)
        else:
            session, dst = peer
            src, parts = self.buf.ctypes.data + at, split(size, pieces)
            spans = [(src + o, dst + at + o, n) for o, n in zip(offsets(parts), parts, strict=True)]
            self.endpoint.write(session, spans, notify=(tag, str(at)))


def move(sides, path, peer, sizes, compute_s=0.0, pieces=1, in_flight=1) -> tuple[float, float]:
    """One move: seconds from its start, and from its last layer being ready, to all landed."""
    sender, receiver = sides
    tag = uuid.uuid4().hex[:16]
    ray.get(receiver.expect.remote(path, tag, sizes))
    start, last_ready = ray.get(
        sender.send.remote(path, peer, tag, sizes, compute_s, pieces, in_flight)
    )
    done = max(ray.get(receiver.wait_landed.remote()))
    return done - start, done - last_ready


def variants(pieces: list[int], in_flight: list[int], with_nixl: bool) -> list[dict]:
    """Every path's variant: Ray, the socket (and NIXL) once, the engine at each pieces x in
    flight."""
    plain = [
        {"path": p, "pieces": 1, "in_flight": 1} for p in ("ray", "tcp", "nixl")[: 2 + with_nixl]
    ]
    return plain + [
        {"path": "engine", "pieces": p, "in_flight": f} for p in pieces for f in in_flight
    ]


def alone_moves(sides, peers, args, rows) -> None:
    """The unit and one layer, each moved alone, every repeat of every variant in turn."""
    for _ in range(args.repeats):
        for row in rows:
            peer, knobs = peers[row["path"]], (row["pieces"], row["in_flight"])
            unit_s, _ = move(sides, row["path"], peer, split(args.unit, knobs[1]), 0, *knobs)
            layer_s, _ = move(sides, row["path"], peer, [args.unit // args.layers], 0, *knobs)
            row.setdefault("unit", []).append(unit_s)
            row.setdefault("layer", []).append(layer_s)


def stall_moves(sides, peers, args, rows, compute_s: float) -> None:
    """The unit as --layers paced layers, every repeat of every variant in turn."""
    sizes = split(args.unit, args.layers)
    for _ in range(args.repeats):
        for row in rows:
            knobs = (row["pieces"], row["in_flight"])
            _, stall_s = move(sides, row["path"], peers[row["path"]], sizes, compute_s, *knobs)
            row.setdefault("stall", []).append(stall_s)


def summarize(row: dict, unit_bytes: int) -> dict:
    unit_s, layer_s = statistics.median(row.pop("unit")), statistics.median(row.pop("layer"))
    stall_s = statistics.median(row.pop("stall"))
    return {
        **row,
        "unit_ms": unit_s * 1e3,
        "bytes_per_s": unit_bytes / unit_s,
        "layer_move_ms": layer_s * 1e3,
        "stall_ms": stall_s * 1e3,
        "stall_over_layer": stall_s / layer_s,
    }


def ratios(by_path: dict, best_stall: dict) -> dict:
    values = {
        "engine_over_tcp": by_path["engine"]["bytes_per_s"] / by_path["tcp"]["bytes_per_s"],
        "engine_over_ray": by_path["engine"]["bytes_per_s"] / by_path["ray"]["bytes_per_s"],
        "engine_stall_over_layer": best_stall["stall_over_layer"],
    }
    return {key: judged(key, value) for key, value in values.items()}


def judged(key: str, value: float) -> dict:
    sense, bound = GOALS[key]
    met = value >= bound if sense == ">=" else value <= bound
    return {"value": value, "goal": f"{sense} {bound}", "met": met}


def start_nodes(args) -> RayCluster:
    """A head (the sender's node) and one more node (the receiver's), both on 127.0.0.1."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    store = max(128 * MiB, 4 * args.unit)
    node = {"num_cpus": 1, "object_store_memory": store, "node_ip_address": HOST}
    nodes = RayCluster(
        initialize_head=True,
        head_node_args={**node, "resources": {"bench_sender": 1}, "include_dashboard": False},
    )
    nodes.add_node(**node, resources={"bench_receiver": 1})
    nodes.wait_for_nodes(180)
    return nodes


def start_sides(args) -> tuple:
    """The two actors (each on its node), connected on every path; the peers per path."""
    env = dict(item.split("=", 1) for item in args.engine_env)
    cls = ray.remote(max_concurrency=8)(Side)
    sides = [
        cls.options(
            num_cpus=0, resources={res: 1}, runtime_env={"env_vars": env} if env else None
        ).remote(args.unit)
        for res in ("bench_sender", "bench_receiver")
    ]
    sender, receiver = sides
    if len(set(ray.get([s.node_id.remote() for s in sides]))) != 2:
        raise RuntimeError("the two sides landed on one Ray node")
    ray.get(sender.open_engine.remote(False))
    engine_peer = ray.get(receiver.open_engine.remote(True))
    ray.get(sender.connect.remote(ray.get(receiver.listen.remote())))
    ray.get(receiver.accept.remote())
    return sides, {"ray": receiver, "tcp": None, "engine": engine_peer}


def measure(args) -> dict:
    sides, peers = start_sides(args)
    skipped = nixl.start_nixl(args, sides)
    peers["nixl"] = None
    rows = variants(args.pieces, args.in_flight, not skipped)
    for row in rows:  # warm up: the engine's first write to a peer also connects
        move(sides, row["path"], peers[row["path"]], [args.unit], 0, row["pieces"])
    alone_moves(sides, peers, args, rows)
    slowest = max(statistics.median(row["layer"]) for row in rows)
    compute_s = args.layer_compute_ms / 1e3 if args.layer_compute_ms else 2 * slowest
    stall_moves(sides, peers, args, rows, compute_s)
    rows = [summarize(row, args.unit) for row in rows]
    engines = [r for r in rows if r["path"] == "engine"]
    best = max(engines, key=lambda r: r["bytes_per_s"])
    best_stall = min(engines, key=lambda r: r["stall_over_layer"])
    by_path = {r["path"]: r for r in rows if r["path"] != "engine"} | {"engine": best}
    return {
        "unit_bytes": args.unit,
        "layers": args.layers,
        "layer_bytes": args.unit // args.layers,
        "layer_compute_ms": compute_s * 1e3,
        "repeats": args.repeats,
        "engine_env": args.engine_env,
        "paths": by_path,
        "engine_variants": engines,
        "best_engine_stall": best_stall,
        "ratios": ratios(by_path, best_stall),
        "nixl": nixl.nixl_summary(by_path, skipped),
    }


def parse_args(argv: list[str] | None):
    parser = bench_parser("transfer --across-nodes", __doc__, json=False)
    parser.add_argument("--unit-mib", type=int, default=64, help="the unit's size (64 MiB)")
    parser.add_argument("--layers", type=int, default=32, help="layers of a unit (32)")
    parser.add_argument(
        "--layer-compute-ms",
        type=float,
        help="compute time a layer (default: twice the slowest path's one-layer move)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs per point, median (5)")
    parser.add_argument("--pieces", default="1,4,16", help="engine: pieces a write (1,4,16)")
    parser.add_argument("--in-flight", default="1,4", help="engine: writes in flight (1,4)")
    parser.add_argument(
        "--engine-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable of both sides' processes, e.g. MC_TCP_SLICE_SIZE=1048576",
    )
    parser.add_argument("--nixl", metavar="DIR", help="NIXL's directory (default: .peers-nixl)")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON line to PATH")
    args = parser.parse_args(argv)
    args.pieces = int_list(parser, "--pieces", args.pieces)
    args.in_flight = int_list(parser, "--in-flight", args.in_flight)
    if min(args.unit_mib, args.layers, args.repeats, *args.pieces, *args.in_flight) < 1:
        parser.error("sizes, counts and repeats must be at least 1")
    args.unit = args.unit_mib * MiB
    args.nixl_dir, args.nixl_skipped = nixl.nixl_dir(args.nixl)
    if args.unit // args.layers < max(args.pieces) * max(args.in_flight):
        parser.error("a layer must have at least --pieces x --in-flight bytes")
    if any("=" not in item for item in args.engine_env):
        parser.error("--engine-env takes KEY=VALUE")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Ray turns a loopback address given to ray.init into the machine's own address unless it
    # runs as on a laptop (no cluster): keep this driver on 127.0.0.1 as the nodes are.
    clustered, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    nodes = start_nodes(args)
    try:
        ray.init(address=nodes.address, log_to_driver=False)
        summary = measure(args)
    except RuntimeError as error:  # e.g. the engine did not start (raised in an actor)
        print(f"halfmoon bench transfer: {getattr(error, 'cause', error)}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
        nodes.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = clustered
    nixl.report(summary)
    line = json.dumps(summary)
    print(line)
    if args.json:
        with open(args.json, "w") as file:
            file.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
