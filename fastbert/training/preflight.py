"""Distributed start-up preflight and a heartbeat watchdog: actionable errors instead of hangs.

``start(settings)`` replaces a bare ``init_distributed()`` for multi-rank jobs:

1. **Reachability**: ranks other than 0 open a TCP connection to ``MASTER_ADDR:MASTER_PORT`` (retrying
   until ``connect_timeout_s``), so a wrong address, a closed firewall port or a node 0 that never
   started is reported by name instead of hanging in the rendezvous.
2. **Process group** with ``collective_timeout_s`` (also the timeout of every later collective).
3. **All-reduce of a known tensor** (rank + 1 summed = W(W+1)/2) on the training device (NCCL on
   GPUs, gloo on the CPU), waited for with a timeout: the data path works end to end.
4. **Same software on every rank**: an all-gather of each rank's host, device and versions (python,
   torch, CUDA, NCCL, DeepSpeed, Triton, fastbert and its git commit); any difference is an error
   that lists which ranks have what.
5. **Heartbeat watchdog** (a daemon thread per rank, over the launcher's TCP store): each rank bumps
   a counter every ``heartbeat_s`` and watches the next rank's (a ring, O(world) store traffic). A
   counter that stops for ``heartbeat_timeout_s`` (the rank died, froze or lost its network), or a
   store that stops answering for that long (node 0 died), ends this rank with exit status 75 and
   posts an abort note that ends every other rank within one more ``heartbeat_s``. A rank that fails
   with an exception posts the note itself. So a dead rank ends the whole job within about
   ``heartbeat_timeout_s + 2 * heartbeat_s`` (plus the launcher's own teardown; torchrun's default
   ``--max-restarts 0`` then exits non-zero), where NCCL alone would wait for its collective timeout.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch

from fastbert.training.engine import DistInfo, init_distributed

DEFAULTS = {
    "preflight": True,
    "connect_timeout_s": 120.0,       # ranks > 0 wait this long for MASTER_ADDR:MASTER_PORT to accept
    "collective_timeout_s": 1800.0,   # init_process_group and every collective
    "heartbeat_s": 5.0,               # 0 = no watchdog
    "heartbeat_timeout_s": 120.0,
}
DEAD_RANK_EXIT = 75                   # EX_TEMPFAIL: the job can be requeued once the node is back
MUST_MATCH = ("python", "torch", "torch_cuda", "nccl", "deepspeed", "triton", "fastbert", "git_commit")


class PreflightError(RuntimeError):
    """The distributed set-up cannot work; the message says what to fix."""


class PeerLostError(RuntimeError):
    """A collective failed mid-run because another rank died or its connection broke."""


_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted",
              "NCCL error", "ncclRemoteError", "ncclSystemError", "Timed out", "timed out")


def describe_collective_failure(e: BaseException) -> Optional[str]:
    """One actionable line for a collective that failed because a peer went away, else None."""
    text = str(e)
    if not isinstance(e, RuntimeError) or not any(k in text for k in _PEER_LOST):
        return None
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return (f"a collective failed on rank {os.environ.get('RANK', '?')} ({first[:300]}): another rank died, hung "
            "or lost its network; the first error in the other nodes' logs is the cause (this rank is collateral)")


# ------------------------------------------------------------------------------------ checks
def wait_for_master(addr: str, port: int, timeout_s: float) -> float:
    """Connect to ``addr:port`` until it accepts or ``timeout_s`` passes; returns the seconds waited."""
    t0 = time.monotonic()
    last = None
    while True:
        left = timeout_s - (time.monotonic() - t0)
        if left <= 0:
            break
        try:
            with socket.create_connection((addr, port), timeout=min(5.0, max(0.1, left))):
                return time.monotonic() - t0
        except OSError as e:  # refused (not listening yet), unreachable, DNS, timeout
            last = e
            time.sleep(min(0.5, max(0.0, left)))
    raise PreflightError(
        f"cannot reach MASTER_ADDR:MASTER_PORT = {addr}:{port} from {socket.gethostname()} within "
        f"{timeout_s:.0f} s ({last.__class__.__name__}: {last}); check that node 0 is running, that "
        f"MASTER_ADDR is node 0's address as seen from this node, and that port {port} is open "
        "(raise dist.connect_timeout_s if nodes start far apart)")


def rank_info(dist: DistInfo) -> dict:
    from fastbert.training.manifest import git_info, package_versions
    info = {"rank": dist.rank, "host": socket.gethostname(), "device": str(dist.device)}
    if dist.device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(dist.device)
    v = package_versions()
    for key in MUST_MATCH:
        info[key] = v.get(key)
    git = git_info()
    info["git_commit"] = git["commit"] if git else None
    return info


def compare_ranks(infos: list[dict]) -> None:
    """Raise PreflightError when the ranks do not run the same software."""
    problems = []
    for key in MUST_MATCH:
        values: dict = {}
        for info in infos:
            values.setdefault(str(info.get(key)), []).append(f"{info['rank']}@{info['host']}")
        if len(values) > 1:
            listing = "; ".join(f"{v}: ranks {', '.join(r[:4])}{' ...' if len(r) > 4 else ''}"
                                for v, r in sorted(values.items()))
            problems.append(f"{key} differs ({listing})")
    if problems:
        raise PreflightError("ranks run different software: " + " | ".join(problems) +
                             "; install the same versions (and fastbert commit) on every node")


def known_all_reduce(dist: DistInfo, timeout_s: float) -> float:
    """All-reduce [rank + 1, 1] and check it gives [W(W+1)/2, W]; returns the seconds it took."""
    import torch.distributed as tdist
    t0 = time.monotonic()
    t = torch.tensor([dist.rank + 1.0, 1.0], dtype=torch.float32, device=dist.device)
    work = tdist.all_reduce(t, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise PreflightError(f"the test all-reduce did not finish within {timeout_s:.0f} s on rank {dist.rank} "
                             f"({e}); a rank is stuck or the {'NCCL' if dist.device.type == 'cuda' else 'gloo'} "
                             "network path is blocked (for NCCL try NCCL_DEBUG=INFO, NCCL_SOCKET_IFNAME)") from None
    w = dist.world_size
    got = t.tolist()
    if got != [w * (w + 1) / 2, float(w)]:
        raise PreflightError(f"the test all-reduce gave {got}, expected {[w * (w + 1) / 2, float(w)]}: the "
                             "collective backend corrupts data (driver / NCCL problem on some node)")
    return time.monotonic() - t0


def start(settings: Optional[dict] = None, log: Callable[[str], None] = print) -> tuple[DistInfo, dict]:
    """Initialise the process group with the checks above; returns ``(DistInfo, report)``. The report
    holds the per-rank infos and timings (for the manifest); ``report['watchdog']`` is the running
    watchdog (or None): call ``stop()`` on a clean finish, ``abort(msg)`` on an error."""
    s = dict(DEFAULTS, **(settings or {}))
    unknown = set(settings or {}) - set(DEFAULTS)
    if unknown:
        raise PreflightError(f"unknown dist settings {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    report: dict = {"watchdog": None}
    t0 = time.monotonic()
    if world > 1 and s["preflight"] and rank != 0:
        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
        report["connect_s"] = wait_for_master(addr, port, float(s["connect_timeout_s"]))
    try:
        dist = init_distributed(timeout_s=float(s["collective_timeout_s"]))
    except PreflightError:
        raise
    except ImportError as e:  # not a rendezvous problem: say what is missing
        raise PreflightError(
            f"training runs through DeepSpeed, which this Python ({sys.executable}) cannot import ({e}); install "
            "it into the same environment: scripts/install.sh does (README, Quick start), or "
            "pip install --no-build-isolation deepspeed") from None
    except Exception as e:  # noqa: BLE001 - torch raises several types for a failed rendezvous
        raise PreflightError(
            f"rank {rank} of {world}: the process group did not form within {s['collective_timeout_s']:.0f} s "
            f"({e.__class__.__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); check that "
            "all nodes were started with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE (--nnodes) and "
            "that every node can reach node 0") from None
    report["init_s"] = time.monotonic() - t0
    if dist.world_size > 1 and s["preflight"]:
        import torch.distributed as tdist
        report["all_reduce_s"] = known_all_reduce(dist, min(float(s["collective_timeout_s"]), 300.0))
        infos: list = [None] * dist.world_size
        tdist.all_gather_object(infos, rank_info(dist))
        compare_ranks(infos)
        report["ranks"] = infos
        report["preflight_s"] = time.monotonic() - t0
        if dist.is_main:
            hosts = sorted({i["host"] for i in infos})
            log(f"[fastbert] preflight ok: {dist.world_size} ranks on {len(hosts)} host(s), same software "
                f"(torch {infos[0]['torch']}, deepspeed {infos[0]['deepspeed']}), test all-reduce "
                f"{1000 * report['all_reduce_s']:.0f} ms, {report['preflight_s']:.1f} s in all")
    if dist.world_size > 1 and float(s["heartbeat_s"]) > 0:
        wd = Watchdog(dist.rank, dist.world_size, float(s["heartbeat_s"]), float(s["heartbeat_timeout_s"]))
        wd.start()
        report["watchdog"] = wd
    return dist, report


# ------------------------------------------------------------------------------------ watchdog
class Watchdog(threading.Thread):
    """Heartbeats over the rendezvous TCP store (see the module docstring)."""

    def __init__(self, rank: int, world: int, interval: float, timeout: float,
                 host: Optional[str] = None, port: Optional[int] = None,
                 on_dead: Optional[Callable[[str], None]] = None):
        super().__init__(daemon=True, name="fastbert-watchdog")
        self.rank, self.world = rank, world
        self.interval, self.timeout = interval, timeout
        self.host = host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.port = int(port or os.environ.get("MASTER_PORT", "29500"))
        run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.prefix = f"fastbert/watchdog/{run}/"
        self.neighbor = (rank + 1) % world
        self.on_dead = on_dead or _die
        self._stop_event = threading.Event()
        self._store = None

    def _key(self, what: str, rank: Optional[int] = None) -> str:
        return self.prefix + what + ("" if rank is None else f"/{rank}")

    def _connect(self):
        import torch.distributed as tdist
        return tdist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=max(1.0, min(self.timeout, 30.0))))

    def run(self) -> None:
        last_ok = time.monotonic()
        seen, seen_at = -1, time.monotonic()
        while not self._stop_event.wait(self.interval):
            try:
                if self._store is None:
                    self._store = self._connect()
                store = self._store
                store.add(self._key("beat", self.rank), 1)
                if store.check([self._key("abort")]):
                    note = store.get(self._key("abort")).decode(errors="replace")
                    return self.on_dead(f"rank {self.rank}: ending because another rank reported: {note}")
                now = time.monotonic()
                last_ok = now
                if store.check([self._key("done", self.neighbor)]):
                    seen_at = now
                    continue
                count = store.add(self._key("beat", self.neighbor), 0)
                if count != seen:
                    seen, seen_at = count, now
                elif now - seen_at > self.timeout:
                    note = (f"rank {self.neighbor} sent no heartbeat for {now - seen_at:.0f} s (it died, froze or "
                            f"lost its network; noticed by rank {self.rank} on {socket.gethostname()})")
                    try:
                        store.set(self._key("abort"), note)
                    except Exception:  # noqa: BLE001 - dying anyway
                        pass
                    return self.on_dead(note)
            except Exception as e:  # noqa: BLE001 - the store host (node 0) may be gone
                self._store = None
                if time.monotonic() - last_ok > self.timeout:
                    return self.on_dead(
                        f"rank {self.rank}: the rendezvous store {self.host}:{self.port} stopped answering for "
                        f"{time.monotonic() - last_ok:.0f} s ({e.__class__.__name__}); node 0 died or the "
                        "network is down")

    def stop(self) -> None:
        """Clean finish: tell the watcher of this rank not to worry, then stop."""
        self._stop_event.set()
        try:
            store = self._store or self._connect()
            store.set(self._key("done", self.rank), "1")
        except Exception:  # noqa: BLE001 - the job is over either way
            pass

    def abort(self, message: str) -> None:
        """This rank failed: end the others now rather than after their collective timeout."""
        self._stop_event.set()
        try:
            store = self._store or self._connect()
            store.set(self._key("abort"), f"rank {self.rank} failed: {message}")
        except Exception:  # noqa: BLE001
            pass


def _die(message: str) -> None:
    print(f"fastbert: error: {message}; ending the job (exit status {DEAD_RANK_EXIT})", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(DEAD_RANK_EXIT)
