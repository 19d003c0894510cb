"""Fine-tuning under a launcher: two gloo ranks (torchrun) with batch 8 each train exactly like one
process with batch 16 (same global batches, averaged gradients), and only rank 0 writes output."""
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fastbert.tasks.finetune import run_finetune
from fastbert.tasks.trainer import TrainArgs


@pytest.fixture(scope="module")
def tiny_dropout_free(tmp_path_factory, minilm_dir):
    from fastbert import BertConfig, BertModel
    d = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
              ).save_pretrained(d)
    for name in ("vocab.txt", "tokenizer_config.json"):
        shutil.copyfile(minilm_dir / name, d / name)
    return d


def test_two_ranks_equal_one_process(tmp_path, data_dir, tiny_dropout_free):
    glue = data_dir / "glue"
    two = tmp_path / "two_ranks"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
           "-m", "fastbert.cli", "finetune", "--task", "sst2", "--data", str(glue), "--model", str(tiny_dropout_free),
           "--output", str(two), "--max-train-samples", "96", "--max-eval-samples", "64", "--batch-size", "8",
           "--epochs", "1", "--lr", "1e-3", "--seed", "3"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('"task": "sst2"') == 1        # rank 0 reports, rank 1 stays quiet
    one = run_finetune("sst2", glue, tiny_dropout_free, output=str(tmp_path / "one"), max_seq_len=128,
                       args=TrainArgs(epochs=1, lr=1e-3, batch_size=16, seed=3, progress=False),
                       max_train_samples=96, max_eval_samples=64)
    import json
    two_summary = json.loads((two / "metrics.json").read_text())
    assert two_summary["train"]["world_size"] == 2 and two_summary["train"]["steps"] == one["train"]["steps"] == 6
    a, b = load_file(str(two / "model.safetensors")), load_file(str(tmp_path / "one" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)
    assert two_summary["metrics"]["accuracy"] == one["metrics"]["accuracy"]
