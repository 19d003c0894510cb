"""Helpers for the pretraining tests: a prepared slice of the real corpus, torchrun launches on the
CPU (gloo, DeepSpeed's CPU accelerator), and reading the metrics JSONL."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WIKI = "pretrain/enwiki_wikiextractor"
VOCAB = "vocab/bert-base-uncased/vocab.txt"


def prepare_slice(data_dir: Path, out: Path, num_files: int = 2, seq_len: int = 64, nsp: bool = False,
                  val_fraction: float = 0.05) -> Path:
    from fastbert.data.prepare import PrepareConfig, prepare
    files = sorted((data_dir / WIKI).glob("*.xz"))[:num_files]
    prepare(PrepareConfig(corpus=[str(f) for f in files], vocab=str(data_dir / VOCAB), out=str(out), seq_len=seq_len,
                          nsp=nsp, val_fraction=val_fraction, workers=1), progress=False)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env() -> dict:
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"), CUDA_VISIBLE_DEVICES="")
    return env


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(json.dumps(cfg, indent=1))
    return path


def torchrun_cmd(config: Path, nproc: int = 2, nnodes: int = 1, node_rank: int = 0, port: int | None = None,
                 overrides=()) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
           f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port or free_port()}",
           "-m", "fastbert.commands.pretrain", "--config", str(config), *overrides]
    return cmd


def launch(cmd: list[str], log_path: Path) -> subprocess.Popen:
    """Start a launcher in its own process group (so kill -9 reaches every rank)."""
    return subprocess.Popen(cmd, cwd=REPO, env=cpu_env(), stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Pids of all descendants of ``pid`` (from /proc; torchrun puts its workers in their own sessions)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill9(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it at once (a crashed node)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    proc.wait()


def wait(proc: subprocess.Popen, log_path: Path, timeout: float = 240) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill9(proc)
        raise AssertionError(f"run timed out; log:\n{log_path.read_text()[-4000:]}")
    assert rc == 0, f"run failed (exit {rc}); log:\n{log_path.read_text()[-6000:]}"


def run(cmd: list[str], log_path: Path, timeout: float = 240) -> None:
    wait(launch(cmd, log_path), log_path, timeout)


def records(out_dir: Path, event: str = "train") -> list[dict]:
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:      # a line cut by kill -9
            continue
        if r["event"] == event:
            out.append(r)
    return out


def by_step(recs: list[dict]) -> dict[int, dict]:
    """The LAST record of each step (a resumed run re-logs the steps after its checkpoint)."""
    return {r["step"]: r for r in recs}


def wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None, what: str = "condition") -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"run ended (exit {proc.returncode}) before {what}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
