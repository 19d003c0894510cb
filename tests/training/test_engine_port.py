"""A world of one picks its own rendezvous port; if another process takes that port first (EADDRINUSE),
init_distributed picks another instead of failing."""
import subprocess
import sys

SCRIPT = r'''
import os, socket
from unittest import mock
import fastbert.training.engine as eng
held = socket.socket(); held.bind(("127.0.0.1", 0)); held.listen(); busy = held.getsockname()[1]
ports = iter([busy])
real = eng._free_port
with mock.patch.object(eng, "_free_port", side_effect=lambda: next(ports, None) or real()):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        os.environ.pop(k, None)
    info = eng.init_distributed(timeout_s=30)
assert info.world_size == 1 and int(os.environ["MASTER_PORT"]) != busy
print("OK", busy, os.environ["MASTER_PORT"])
'''


def test_single_process_init_survives_a_taken_port():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1].startswith("OK")
