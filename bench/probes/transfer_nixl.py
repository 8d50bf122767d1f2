"""The `nixl` path of `halfmoon bench transfer --across-nodes` (bench/probes/transfer_nodes.py):
NIXL (PyPI nixl-cu12, its UCX backend) between the bench's same two actors, as issue 48 asks
when Mooncake's TCP transport misses its goal. NIXL is a peer to compare against, not a
dependency of halfmoon: `make nixl-peer` installs it into a side directory (.peers-nixl), which
the actors put on sys.path. UCX is held to TCP on loopback (UCX_TLS=tcp, UCX_NET_DEVICES=lo),
as the engine and the socket are. The sender WRITEs each layer straight into the receiver's
registered buffer, a notification with it; the receiver polls its notifications. Also the
bench's report, which has NIXL's row and lines when it ran."""

from __future__ import annotations

import os
import sys
import time

import ray

NIXL_DEFAULT_DIR = ".peers-nixl"
MiB = 1 << 20
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def nixl_dir(given: str | None) -> tuple[str | None, str]:
    """The NIXL directory to use (absolute), or None and why the path is skipped."""
    path = given or NIXL_DEFAULT_DIR
    if os.path.isdir(path):
        return os.path.abspath(path), ""
    if given is None:
        return None, f"no {NIXL_DEFAULT_DIR}/ here (`make nixl-peer` builds it)"
    return None, f"--nixl {given}: no such directory (`make nixl-peer` builds .peers-nixl)"


class NixlEnd:
    """One side's NIXL agent, its unit's buffer registered (a sender's source or a receiver's
    destination), and on the sender the receiver as a remote agent."""

    def __init__(self, directory: str, name: str, addr: int, size: int) -> None:
        for key, value in UCX_ENV.items():  # read by UCX when the backend starts, below
            os.environ[key] = value
        if directory not in sys.path:
            sys.path.insert(0, directory)
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        # No progress thread: it spins a core of the 2 the other paths share, even between
        # moves (they halved with it on); writes and notification reads make the progress.
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.agent = nixl_agent(name, config)
        self.addr, self.peer, self.peer_addr = addr, "", 0
        self.agent.register_memory(self.agent.get_reg_descs([(addr, size, 0, "")], "DRAM"))

    def card(self) -> tuple[bytes, int]:
        """What a peer needs to write here: this agent's metadata and the buffer's address."""
        return self.agent.get_agent_metadata(), self.addr

    def meet(self, card: tuple[bytes, int]) -> None:
        """Take the receiver's card (the sender's side)."""
        metadata, self.peer_addr = card
        self.peer = self.agent.add_remote_agent(metadata)

    def write(self, at: int, size: int, tag: str) -> None:
        """WRITE the `size` bytes at offset `at` into the same place of the receiver's buffer,
        `tag` notified with them; returns once NIXL says the write is done."""
        local = self.agent.get_xfer_descs([(self.addr + at, size, 0)], "DRAM")
        remote = self.agent.get_xfer_descs([(self.peer_addr + at, size, 0)], "DRAM")
        handle = self.agent.initialize_xfer("WRITE", local, remote, self.peer, tag.encode())
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL write of {size} bytes: {state}")
        finally:
            self.agent.release_xfer_handle(handle)

    def count(self, tag: str) -> int:
        """How many notifications of `tag` came since the last call (the receiver's side)."""
        wanted = tag.encode()
        notifs = self.agent.get_new_notifs()
        return sum(note == wanted for notes in notifs.values() for note in notes)


def start_nixl(args, sides) -> str:
    """Both sides' NIXL agents, the sender knowing the receiver; why not, if they did not."""
    if args.nixl_dir is None:
        return args.nixl_skipped
    cards = ray.get(
        [s.open_nixl.remote(args.nixl_dir, n) for s, n in zip(sides, ("tx", "rx"), strict=True)]
    )
    if failed := [card for card in cards if isinstance(card, str)]:
        return failed[0]
    ray.get(sides[0].meet_nixl.remote(cards[1]))
    return ""


def poll_notifs(end: NixlEnd, tag: str, expected: int, land, poll_s: float, wait_s: float):
    """Call `land(count)` as `tag`'s notifications come, until `expected` came or `wait_s`."""
    seen, deadline = 0, time.monotonic() + wait_s
    while seen < expected and time.monotonic() < deadline:
        if count := end.count(tag):
            seen += count
            land(count)
        else:
            time.sleep(poll_s)


def nixl_summary(by_path: dict, skipped: str) -> dict:
    """NIXL against raw TCP and Ray, and which of the engine and NIXL is closer to raw TCP."""
    if skipped:
        return {"measured": False, "skipped": skipped}
    tcp, ray = by_path["tcp"]["bytes_per_s"], by_path["ray"]["bytes_per_s"]
    nixl, engine = by_path["nixl"]["bytes_per_s"], by_path["engine"]["bytes_per_s"]
    return {
        "measured": True,
        "nixl_over_tcp": nixl / tcp,
        "nixl_over_ray": nixl / ray,
        "engine_over_tcp": engine / tcp,
        "closer_to_raw": "nixl" if nixl > engine else "engine",
    }


def nixl_lines(summary: dict) -> list[str]:
    """The report's lines on NIXL."""
    if not summary["measured"]:
        return [f"nixl: skipped ({summary['skipped']})"]
    closer = summary["closer_to_raw"]
    other = "engine" if closer == "nixl" else "nixl"
    return [
        f"nixl_over_tcp = {summary['nixl_over_tcp']:.2f}",
        f"nixl_over_ray = {summary['nixl_over_ray']:.2f}",
        f"closer to the raw TCP limit: {closer} (engine {summary['engine_over_tcp']:.2f}x tcp, "
        f"nixl {summary['nixl_over_tcp']:.2f}x tcp; {other} is farther)",
    ]


def name(row: dict) -> str:
    """A table row's name: its path, and for the engine its pieces and writes in flight."""
    knobs = f" p{row['pieces']} f{row['in_flight']}" if row["path"] == "engine" else ""
    return row["path"] + knobs


def report(summary: dict) -> None:
    """The bench's table (every path, every engine variant), its ratios and NIXL's lines."""
    unit, layer = summary["unit_bytes"] / MiB, summary["layer_bytes"] / MiB
    print(
        f"{unit:g} MiB unit, {summary['layers']} layers of {layer:g} MiB, "
        f"{summary['layer_compute_ms']:.2f} ms compute a layer, median of {summary['repeats']}"
    )
    print(
        f"{'path':<18} {'unit_ms':>8} {'GB/s':>7} {'layer_ms':>8} {'stall_ms':>8} "
        f"{'stall/layer':>11}"
    )
    paths = summary["paths"]
    rows = [paths[p] for p in ("ray", "tcp", "nixl") if p in paths] + summary["engine_variants"]
    for r in rows:
        print(
            f"{name(r):<18} {r['unit_ms']:>8.2f} {r['bytes_per_s'] / 1e9:>7.3f} "
            f"{r['layer_move_ms']:>8.3f} {r['stall_ms']:>8.3f} {r['stall_over_layer']:>11.2f}"
        )
    print(
        f"best engine bytes/s: {name(summary['paths']['engine'])}; "
        f"best engine stall: {name(summary['best_engine_stall'])}"
    )
    for key, ratio in summary["ratios"].items():
        verdict = "met" if ratio["met"] else "NOT met"
        print(f"{key} = {ratio['value']:.2f} (goal {ratio['goal']}: {verdict})")
    print("\n".join(nixl_lines(summary["nixl"])))
