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


PARENT = r'''
import os, subprocess, sys
import fastbert.training.engine as eng
for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "FASTBERT_WORLD_OF_ONE"):
    os.environ.pop(k, None)
eng.init_distributed(timeout_s=30)          # holds MASTER_PORT and sets RANK=0 in os.environ
child = "import fastbert.training.engine as eng, os; i = eng.init_distributed(timeout_s=30); " \
        "print('CHILD', i.world_size, os.environ['MASTER_PORT'])"
res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=240)
assert res.returncode == 0, res.stderr[-3000:]
_, world, port = res.stdout.strip().splitlines()[-1].split()
assert world == "1" and port != os.environ["MASTER_PORT"], (port, os.environ["MASTER_PORT"])
print("OK")
'''


def test_a_child_of_a_world_of_one_forms_its_own_world():
    """A process that made itself a world of one (a test calling run_finetune in-process) leaves RANK and
    MASTER_PORT in its environment; a child fastbert process must not read them as a launcher's and
    fail to bind the port the parent holds (the CI failure: EADDRINUSE in every later subprocess)."""
    res = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "OK"
