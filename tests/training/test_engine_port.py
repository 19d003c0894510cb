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


def test_a_launcher_between_parent_and_child_keeps_its_world(monkeypatch):
    """torchrun/deepspeed started from a process that is itself a world of one (pytest after an
    in-process fine-tune) set their own RANK/WORLD_SIZE/MASTER_PORT: the marker the parent left must not
    erase them (it did once, and every distributed test ran as worlds of one and timed out)."""
    import os

    import fastbert.training.engine as eng
    parent = f"{os.getpid() + 1}:41000"
    launcher = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "29500"}
    for key, value in {**launcher, eng._OWN_WORLD: parent}.items():
        monkeypatch.setenv(key, value)
    eng._forget_inherited_world()
    assert {k: os.environ.get(k) for k in launcher} == launcher
    # torchrun --nproc-per-node 1 looks like a world of one, but on its own port: kept too
    one = {**eng._WORLD_OF_ONE, "MASTER_PORT": "29500"}
    for key, value in {**one, eng._OWN_WORLD: parent}.items():
        monkeypatch.setenv(key, value)
    eng._forget_inherited_world()
    assert {k: os.environ.get(k) for k in one} == one
    # inherited unchanged from the parent: forgotten
    for key, value in {**one, "MASTER_PORT": "41000", eng._OWN_WORLD: parent}.items():
        monkeypatch.setenv(key, value)
    eng._forget_inherited_world()
    assert not any(k in os.environ for k in one) and eng._OWN_WORLD not in os.environ
