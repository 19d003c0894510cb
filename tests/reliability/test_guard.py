"""The spike / NaN guard: unit tests of its decisions and of the optimizer hook, and an end-to-end run
with injected faults (a NaN loss, a 100x loss spike, then three NaN steps in a row that force a
rollback): the run completes, the weights are never non-finite, skipped steps never update the
optimizer, every event is logged, and every checkpoint carries HF weights and a manifest."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from fastbert.training.checkpoint import MARKER, apply_retention, find_latest_good
from fastbert.training.guard import GuardError, SpikeGuard, install
from reliability_harness import by_step, checkpoint_tags, marker, prepare_slice, records, run_cli, tiny_config, \
    write_config


# ----------------------------------------------------------------------------------------- unit
class FakeEngine:
    """What the guard reads from a TrainEngine: the DeepSpeed optimizer, the module, skip status."""

    def __init__(self, module, ds_optimizer, applied=True, precision="fp32"):
        self.ds = SimpleNamespace(optimizer=ds_optimizer)
        self.module = module
        self.precision = precision
        self.loss_scale = None
        self._applied = applied

    def step_was_applied(self):
        return self._applied


class FakeZero:
    """Stands in for a DeepSpeed ZeRO optimizer: wraps the torch optimizer, knows the global norm."""

    def __init__(self, inner):
        self.optimizer = inner
        self._global_grad_norm = None

    def step(self, norm):
        self._global_grad_norm = norm
        self.optimizer.step()


def guarded(cfg=None, fused=False):
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)   # fused: the verdict goes in as found_inf
    zero = FakeZero(inner)
    guard = SpikeGuard(dict({"min_history": 3, "window": 10, "warmup_steps": 0, "grad_norm_factor": 10.0},
                            **(cfg or {})))
    engine = FakeEngine(model, zero)
    install(engine, guard)
    return guard, engine, zero, model


def only(verdicts):
    assert len(verdicts) <= 1
    return verdicts[0] if verdicts else None


def one_step(guard, engine, zero, model, loss, norm, step, settle=True):
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    guard.add_micro_loss(torch.tensor(loss))
    guard.check_loss(engine)
    before = [p.detach().clone() for p in model.parameters()]
    zero.step(norm)
    changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    verdicts = guard.end_step(engine, step, step, settle=settle)
    return (only(verdicts) if settle else verdicts), changed


def test_healthy_steps_update_and_build_history():
    guard, engine, zero, model = guarded()
    for s in range(5):
        verdict, changed = one_step(guard, engine, zero, model, 5.0 - 0.1 * s, 1.0, s)
        assert verdict is None and changed
    assert list(guard.losses) == pytest.approx([5.0, 4.9, 4.8, 4.7, 4.6])
    assert zero.optimizer.state[model.weight]["step"] == 5


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("loss,norm,reason", [
    (float("nan"), 1.0, "nonfinite_loss"),
    (float("inf"), 1.0, "nonfinite_loss"),
    (100.0, 1.0, "loss_spike"),              # > 3 x median 5
    (5.0, float("nan"), "nonfinite_grad_norm"),
    (5.0, 50.0, "grad_norm_spike"),          # > 10 x median 1
])
def test_bad_step_is_skipped_without_any_update(loss, norm, reason, fused):
    guard, engine, zero, model = guarded(fused=fused)
    for s in range(3):
        one_step(guard, engine, zero, model, 5.0, 1.0, s)
    adam_step = zero.optimizer.state[model.weight]["step"].clone()
    verdict, changed = one_step(guard, engine, zero, model, loss, norm, 3)
    assert verdict.skipped and verdict.reason == reason and not verdict.rollback
    assert not changed                                                    # no parameter update ...
    assert torch.equal(zero.optimizer.state[model.weight]["step"], adam_step)   # ... and no Adam step
    assert guard.consecutive_bad == 1 and not guard.healthy
    verdict, changed = one_step(guard, engine, zero, model, 5.0, 1.0, 4)
    assert verdict is None and changed and guard.healthy


def test_spike_checks_wait_for_history():
    guard, engine, zero, model = guarded()
    one_step(guard, engine, zero, model, 5.0, 1.0, 0)
    verdict, changed = one_step(guard, engine, zero, model, 500.0, 1.0, 1)   # 1 step of history < min_history 3
    assert verdict is None and changed
    verdict, _ = one_step(guard, engine, zero, model, float("nan"), 1.0, 2)   # non-finite: always
    assert verdict.reason == "nonfinite_loss"


def test_repeated_failures_ask_for_rollback_then_give_up():
    guard, engine, zero, model = guarded({"rollback_after": 2, "max_rollbacks": 1})
    for s in range(3):
        one_step(guard, engine, zero, model, 5.0, 1.0, s)
    v1, _ = one_step(guard, engine, zero, model, float("nan"), 1.0, 3)
    v2, _ = one_step(guard, engine, zero, model, float("nan"), 1.0, 4)
    assert not v1.rollback and v2.rollback
    guard.rolled_back()
    assert guard.rollbacks == 1 and guard.healthy
    one_step(guard, engine, zero, model, float("nan"), 1.0, 5)
    with pytest.raises(GuardError, match="keeps diverging.*max_rollbacks"):
        one_step(guard, engine, zero, model, float("nan"), 1.0, 6)


def test_verdicts_reach_the_host_a_step_late_and_a_rollback_drops_the_steps_after_it():
    """settle=False: the optimizer skips a bad step at once (on the device), the host reads its verdict
    at the next step; flush reads the last one; a rollback verdict takes the step after it along."""
    guard, engine, zero, model = guarded({"rollback_after": 2}, fused=True)
    for s in range(3):
        assert one_step(guard, engine, zero, model, 5.0, 1.0, s, settle=False)[0] == []
    assert guard.flush() == [] and guard.healthy
    verdicts, changed = one_step(guard, engine, zero, model, float("nan"), 1.0, 3, settle=False)
    assert verdicts == [] and not changed and guard.healthy            # skipped; the host does not know yet
    verdicts, changed = one_step(guard, engine, zero, model, 5.0, 1.0, 4, settle=False)
    assert [v.step for v in verdicts] == [3] and changed and not guard.healthy
    verdicts, changed = one_step(guard, engine, zero, model, 5.0, 1.0, 5, settle=False)
    assert verdicts == [] and guard.flush() == [] and guard.healthy
    assert one_step(guard, engine, zero, model, float("nan"), 1.0, 6, settle=False)[0] == []
    verdicts, _ = one_step(guard, engine, zero, model, float("nan"), 1.0, 7, settle=False)
    assert [(v.step, v.rollback) for v in verdicts] == [(6, False)]
    verdicts, changed = one_step(guard, engine, zero, model, 5.0, 1.0, 8, settle=False)
    assert [(v.step, v.rollback) for v in verdicts] == [(7, True)] and changed
    guard.rolled_back()                               # the loop reloads the last good checkpoint ...
    assert guard.flush() == [] and guard.healthy       # ... and step 8, taken before the verdict, goes with it
    assert guard.skipped_total == 3


def test_device_thresholds_are_the_host_statistics():
    """The spike threshold computed on the device equals statistics.median / MAD over the window."""
    from statistics import median
    guard = SpikeGuard({"window": 7, "min_history": 2, "warmup_steps": 0})
    values = [5.0, 4.0, 7.5, 6.25, 3.0, 9.0, 4.5, 8.0, 5.5]
    guard.load_state_dict({"losses": values, "norms": values[:4]})
    for row, hist in ((0, values[-7:]), (1, values[:4])):
        mid = median(hist)
        mad = median(abs(x - mid) for x in hist)
        expect = max(3.0 * mid, mid + guard.noise_sigmas * 1.4826 * mad)
        assert float(guard.threshold(row, 3.0)) == pytest.approx(expect, rel=1e-12)
    assert guard.losses == values[-7:] and guard.norms == values[:4]
    assert float(SpikeGuard({"min_history": 3}).threshold(0, 3.0)) == math.inf


def test_deepspeed_overflow_skip_is_reported_but_fp16_does_not_count():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = SpikeGuard({})
    engine = FakeEngine(model, FakeZero(opt), applied=False, precision="fp16")
    guard.add_micro_loss(torch.tensor(3.0))
    guard.check_loss(engine)
    v = only(guard.end_step(engine, 0, 0))
    assert v.reason == "fp16_overflow" and not v.counts_as_failure and guard.healthy


def test_zero0_norm_comes_from_the_reduced_grads():
    model = torch.nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = SpikeGuard({})
    engine = FakeEngine(model, opt)                     # no wrapper: DeepSpeed drives torch's optimizer
    install(engine, guard)
    model.weight.grad = torch.tensor([[3.0, 4.0]])
    guard.add_micro_loss(torch.tensor(1.0))
    guard.check_loss(engine)
    opt.step()
    assert guard.end_step(engine, 0, 0) == [] and list(guard.norms) == [5.0]


def test_injection_faults_rank0_only():
    g0 = SpikeGuard({"inject_nan_steps": [3], "inject_spike_steps": [4], "inject_spike_factor": 100.0}, rank=0)
    g1 = SpikeGuard({"inject_nan_steps": [3]}, rank=1)
    loss = torch.tensor(2.0)
    assert math.isnan(g0.inject(loss, 3)) and g0.inject(loss, 4) == 200.0 and g0.inject(loss, 5) == 2.0
    assert g1.inject(loss, 3) == 2.0


def test_unknown_guard_setting_is_an_error():
    with pytest.raises(ValueError, match="unknown guard settings"):
        SpikeGuard({"loss_factr": 2})


def test_retention_never_deletes_the_last_good_checkpoint(tmp_path):
    for step, good in [(10, True), (20, False), (30, False), (40, False)]:
        d = tmp_path / f"step_{step:08d}"
        d.mkdir()
        (d / MARKER).write_text(json.dumps({"step": step, "good": good}))
    removed = apply_retention(tmp_path, keep=2)
    assert sorted(removed) == ["step_00000020"]
    assert find_latest_good(tmp_path) == "step_00000010"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000010", "step_00000030", "step_00000040"]


# ----------------------------------------------------------------------------------------- end to end
NAN_AT, SPIKE_AT, STREAK = 5, 7, (12, 13, 14)      # data-stream positions (0-based steps)


@pytest.fixture(scope="module")
def faulty_run(data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("guard")
    data = prepare_slice(data_dir, root / "data", num_files=1, seq_len=32)
    out = root / "out"
    cfg = tiny_config(data, out, steps=20, ckpt_every=5, keep=2,
                      guard={"min_history": 4, "warmup_steps": 0, "inject_nan_steps": [NAN_AT, *STREAK],
                             "inject_spike_steps": [SPIKE_AT], "inject_spike_factor": 100.0})
    run_cli(write_config(root / "cfg.json", cfg), root / "log.txt")
    return out, (root / "log.txt").read_text()


def test_faults_are_skipped_rolled_back_and_logged(faulty_run):
    out, console = faulty_run
    events = records(out, "guard")
    assert [(e["data_step"], e["reason"]) for e in events] == [
        (NAN_AT, "nonfinite_loss"), (SPIKE_AT, "loss_spike"),
        (STREAK[0], "nonfinite_loss"), (STREAK[1], "nonfinite_loss"), (STREAK[2], "nonfinite_loss")]
    assert events[1]["loss"] > 50 * events[1]["loss_median"]             # the injected 100x spike
    assert [e["rollback"] for e in events] == [False, False, False, False, True]
    rb = records(out, "guard_rollback")
    assert len(rb) == 1 and rb[0]["tag"] == "step_00000010" and rb[0]["step"] == 10
    assert rb[0]["data_skip"] == STREAK[-1] + 1 - 10 and rb[0]["weights_match"] is True
    assert "[guard] step 6: non-finite loss, update skipped" in console
    assert "rolling back to the last good checkpoint" in console
    done = records(out, "done")[-1]
    assert done["steps"] == 20 and done["guard_skipped"] == 5 and done["rollbacks"] == 1
    train = by_step(records(out))
    assert sorted(train) == list(range(1, 21))
    assert all(math.isfinite(r["loss"]) for s, r in train.items() if s > 10)   # after the rollback: all clean


def test_weights_never_nonfinite_and_skips_never_step_adam(faulty_run):
    from safetensors.torch import load_file
    out, _ = faulty_run
    ckpt_dir = out / "checkpoints"
    for tag in checkpoint_tags(ckpt_dir):
        m = marker(ckpt_dir, tag)
        assert m["finite"] and m["good"]
        weights = load_file(str(ckpt_dir / tag / "hf" / "model.safetensors"))
        assert all(torch.isfinite(t).all() for t in weights.values())
    assert all(torch.isfinite(t).all() for t in load_file(str(out / "hf" / "model.safetensors")).values())
    # Adam's step counter counts applied updates: 10 steps before the rollback point minus the NaN and
    # the spike skipped there, then 10 clean steps after rolling back to step 10.
    states = torch.load(ckpt_dir / "step_00000020" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    steps = {float(s["step"]) for s in states["optimizer_state_dict"]["base_optimizer_state"]["state"].values()}
    assert steps == {18.0}


def test_every_checkpoint_has_hf_weights_equal_to_deepspeed_state(faulty_run):
    import fastbert
    out, _ = faulty_run
    ckpt_dir = out / "checkpoints"
    tags = checkpoint_tags(ckpt_dir)
    assert tags == ["step_00000015", "step_00000020"]
    for tag in tags:
        hf = ckpt_dir / tag / "hf"
        assert {"config.json", "model.safetensors", "vocab.txt", "tokenizer_config.json"} <= {p.name for p in hf.iterdir()}
        ours = fastbert.BertForMaskedLM.from_pretrained(hf).state_dict()
        ds = torch.load(ckpt_dir / tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
        for k, v in ds.items():
            assert torch.equal(ours[k], v), k
    assert not list(ckpt_dir.glob("*/.hf.tmp"))                     # no half-written folders left


def test_manifests(faulty_run):
    out, _ = faulty_run
    final = json.loads((out / "manifest.json").read_text())
    assert final["final"] is True and final["step"] == 20 and final["seed"] == 42
    assert final["packages"]["torch"] == torch.__version__ and final["packages"]["deepspeed"]
    assert final["git"] is None or len(final["git"]["commit"]) == 40
    assert final["hardware"]["cpu_count"] >= 1 and final["config"]["train"]["max_steps"] == 20
    assert final["throughput"]["seq_per_s"] > 0 and final["eval"]["mlm_tokens"] > 0
    assert final["guard"] == {"skipped_steps": 5, "rollbacks": 1}
    m15 = json.loads((out / "checkpoints" / "step_00000015" / "manifest.json").read_text())
    assert m15["step"] == 15 and m15["final"] is False and m15["data"]["data_skip"] == 5


def test_two_ranks_skip_in_agreement(data_dir, tmp_path):
    """Faults injected on rank 0 only (ZeRO-2, two ranks): both ranks skip the same steps, so every
    optimizer partition took the same number of Adam steps."""
    from reliability_harness import run, torchrun_cmd
    data = prepare_slice(data_dir, tmp_path / "data", num_files=1, seq_len=32)
    out = tmp_path / "out"
    cfg = tiny_config(data, out, steps=8, ckpt_every=None,
                      guard={"min_history": 2, "warmup_steps": 0, "inject_nan_steps": [3], "inject_spike_steps": [5]},
                      train={"zero_stage": 2})
    run(torchrun_cmd(write_config(tmp_path / "cfg.json", cfg), nproc=2), tmp_path / "log.txt")
    assert [(e["data_step"], e["reason"]) for e in records(out, "guard")] == [(3, "nonfinite_loss"), (5, "loss_spike")]
    tag = out / "checkpoints" / "step_00000008"
    for rank in (0, 1):
        states = torch.load(tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", weights_only=False)
        steps = {float(s["step"]) for s in states["optimizer_state_dict"]["base_optimizer_state"]["state"].values()}
        assert steps == {6.0}, (rank, steps)
    assert marker(out / "checkpoints", "step_00000008")["finite"]


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["torch-fused", "fastbert"])
def test_on_cuda_a_step_reads_nothing_back_and_a_bad_step_is_skipped_on_the_device(optimizer):
    """CUDA, torch's fused AdamW and fastbert's (the default there: its kernel's step while it writes the weights'
    16-bit copies): check, step and a late verdict run with torch.cuda.set_sync_debug_mode("error"); a NaN step
    leaves weights and Adam state untouched."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = torch.nn.Linear(32, 16).cuda()
    if optimizer == "fastbert":
        from fastbert.ops import weight_casts
        from fastbert.training.optim import AdamW
        inner = AdamW(model.parameters(), lr=0.1)
        inner.weight_casts = weight_casts.WeightCasts()
        with inner.weight_casts.active():
            weight_casts.cast(model.weight, torch.bfloat16)
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    guard = SpikeGuard({"min_history": 3, "window": 10, "warmup_steps": 0}, device="cuda")
    engine = FakeEngine(model, inner)
    install(engine, guard)

    def step(loss, s):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        before = [p.detach().clone() for p in model.parameters()]
        torch.cuda.set_sync_debug_mode("error")
        try:
            guard.add_micro_loss(torch.full((), loss, device="cuda"))
            guard.check_loss(engine)
            inner.step()
            verdicts = guard.end_step(engine, s, s, settle=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return verdicts, changed

    for s in range(4):
        verdicts, changed = step(5.0, s)
        assert verdicts == [] and changed
    adam_step = inner.state[model.weight]["step"].clone()
    verdicts, changed = step(float("nan"), 4)
    assert verdicts == [] and not changed and torch.equal(inner.state[model.weight]["step"], adam_step)
    verdicts, changed = step(5.0, 5)
    assert [v.reason for v in verdicts] == ["nonfinite_loss"] and changed
    assert guard.flush() == [] and guard.losses == [5.0] * 5
