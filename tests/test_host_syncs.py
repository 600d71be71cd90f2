"""The training step queues work without waiting for the device: no host sync between log
intervals, the divergence guard decided on the device with today's exact behaviour, and under DDP
one small flag reduce per step besides the gradients'."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from gptcore import train
from gptcore.train import Trainer
from tests.conftest import free_ports
from tests.test_train import make_config, poison_batches

aten = torch.ops.aten


class CountHostSyncs(TorchDispatchMode):
    """Counts the ops that make the host wait for the device: reading a scalar (`.item()`,
    `float(t)`, `bool(t)`: `_local_scalar_dense`) and copies from a device to the CPU. On a CPU
    nothing waits, but the same ops would on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten._local_scalar_dense.default, aten.item.default):
            self.count += 1
        elif func in (aten._to_copy.default, aten.copy_.default):
            source = args[1] if func is aten.copy_.default else args[0]
            target = kwargs.get("device") if func is aten._to_copy.default else args[0].device
            if source.device.type != "cpu" and target is not None and torch.device(target).type == "cpu":
                self.count += 1
        return func(*args, **kwargs)


class CountToList(TorchFunctionMode):
    """`Tensor.tolist()`, which reads a CPU tensor without a dispatched op (on a GPU it copies
    to the CPU first, which `CountHostSyncs` sees), added to `counter`."""

    def __init__(self, counter: CountHostSyncs) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.counter.count += 1
        return func(*args, **(kwargs or {}))


def syncs_per_step(trainer: Trainer, **fit) -> list[int]:
    """Fit `trainer` and return the host syncs of each loop iteration: its train_step plus, at a
    log point, the host's read of the queued steps."""
    counter, starts = CountHostSyncs(), []
    step = trainer.train_step

    def counting() -> dict:
        starts.append(counter.count)
        return step()

    trainer.train_step = counting
    with counter, CountToList(counter):
        trainer.fit(**fit)
    ends = [*starts[1:], counter.count]
    return [end - start for start, end in zip(starts, ends, strict=True)]


def test_no_host_sync_between_log_intervals(tiny_data, tmp_path):
    cfg = make_config(
        tiny_data, tmp_path, "train.max_steps=12", "train.log_interval=4", "train.eval_interval=12"
    )
    syncs = syncs_per_step(Trainer(cfg, log=None))
    assert len(syncs) == 12
    # Steps 4 and 8 log: one read of the four steps queued; step 12 also evaluates and checkpoints.
    assert [s for i, s in enumerate(syncs, 1) if i % 4] == [0] * 9
    assert syncs[3] == syncs[7] == 1


def test_a_skipped_step_costs_no_sync_either(tiny_data, tmp_path):
    cfg = make_config(
        tiny_data, tmp_path, "train.max_steps=8", "train.log_interval=4", "train.eval_interval=8"
    )
    trainer = Trainer(cfg, log=None)
    poison_batches(trainer, {1, 2})
    syncs = syncs_per_step(trainer)
    assert trainer.bad_steps == 2 and trainer.step == 8 and trainer.batch_index == 10
    assert syncs[:3] == [0, 0, 0] and syncs[3] == 1  # read at the 4th batch: the step is only 2


# What main's guard (host reads every step: loss.item(), grad_norm.item()) produced for these
# runs on this project's CPU, recorded before the guard moved to the device. A bad batch at a log
# point logs a second line for that step; a streak rolls back to the last checkpoint (or, before
# the first checkpoint, only halves the lr).
SCENARIOS = {
    # Rollback at batch 11, read at batch 12: batch 12 is dropped and run again.
    "rollback read late": (
        {4, 9, 10, 11, 17},
        ("train.max_steps=20", "train.max_bad_steps=3"),
        dict(
            counters=[20, 25, 2560, 5, 1, 0.5],
            lines=[
                "step      4/20 | loss 5.3477 | lr 2.92e-03 | grad norm 1.446",
                "eval step 4 | val loss 5.1406 | ppl 170.82 | bpb 2.1553",
                "warning: non-finite loss (nan) at step 4; batch skipped (1 in a row)",
                "step      4/20 | loss nan | lr 2.82e-03 | grad norm nan",
                "step      8/20 | loss 4.6122 | lr 2.32e-03 | grad norm 1.457",
                "eval step 8 | val loss 4.4908 | ppl 89.19 | bpb 1.8829",
                "warning: non-finite loss (nan) at step 8; batch skipped (1 in a row)",
                "step      8/20 | loss nan | lr 2.11e-03 | grad norm nan",
                "warning: non-finite loss (nan) at step 8; batch skipped (2 in a row)",
                "step      8/20 | loss nan | lr 2.11e-03 | grad norm nan",
                "warning: non-finite loss (nan) at step 8; batch skipped (3 in a row)",
                "warning: rolled back to step 8 with lr scale 0.5 (rollback 1/3)",
                "step      8/20 | loss nan | lr 2.11e-03 | grad norm nan",
                "step     12/20 | loss 4.3315 | lr 7.08e-04 | grad norm 1.256",
                "eval step 12 | val loss 4.3022 | ppl 73.86 | bpb 1.8038",
                "warning: non-finite loss (nan) at step 13; batch skipped (1 in a row)",
                "step     16/20 | loss 4.2333 | lr 3.08e-04 | grad norm 1.804",
                "eval step 16 | val loss 4.2147 | ppl 67.68 | bpb 1.7671",
                "step     20/20 | loss 4.1489 | lr 1.50e-04 | grad norm 1.321",
                "eval step 20 | val loss 4.1784 | ppl 65.26 | bpb 1.7519",
            ],
            reports=[
                [4.0, 512.0, 5.347680568695068, 5.140619853186229],
                [8.0, 1024.0, 4.612210750579834, 4.490787089817108],
                [12.0, 1536.0, 4.331541061401367, 4.302191249907962],
                [16.0, 2048.0, 4.233334541320801, 4.214732200380356],
                [20.0, 2560.0, 4.148900985717773, 4.178449222019741],
            ],
            weights=[-15.718709601989758, -0.0007524027414547163, 63.848229348659515, 0.017027448397129774],
        ),
    ),
    # Rollback at batch 2 before any checkpoint: the device halves the lr of the steps after it.
    "rollback before a checkpoint": (
        {1, 2, 6},
        ("train.max_bad_steps=2", "train.grad_accum=2"),
        dict(
            counters=[12, 15, 3072, 3, 1, 0.5],
            lines=[
                "warning: non-finite loss (nan) at step 1; batch skipped (1 in a row)",
                "warning: non-finite loss (nan) at step 1; batch skipped (2 in a row)",
                "warning: rolled back to step 1 with lr scale 0.5 (rollback 1/3)",
                "step      4/12 | loss 5.4510 | lr 1.37e-03 | grad norm 1.440",
                "eval step 4 | val loss 5.3644 | ppl 213.66 | bpb 2.2491",
                "warning: non-finite loss (nan) at step 4; batch skipped (1 in a row)",
                "step      4/12 | loss nan | lr 1.22e-03 | grad norm nan",
                "step      8/12 | loss 5.0551 | lr 6.16e-04 | grad norm 1.557",
                "eval step 8 | val loss 5.0590 | ppl 157.43 | bpb 2.1211",
                "step     12/12 | loss 4.9852 | lr 1.50e-04 | grad norm 1.490",
                "eval step 12 | val loss 4.9782 | ppl 145.21 | bpb 2.0872",
            ],
            reports=[
                [4.0, 1024.0, 5.450998783111572, 5.364396950555226],
                [8.0, 2048.0, 5.055116176605225, 5.058976294502379],
                [12.0, 3072.0, 4.985164642333984, 4.978155908130464],
            ],
            weights=[-9.656989739909477, 0.02989930156581977, 63.929290652275085, 0.016434380842838436],
        ),
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_guard_decided_on_the_device_is_todays(tiny_data, tmp_path, name):
    bad, overrides, expected = SCENARIOS[name]
    logs: list[str] = []
    trainer = Trainer(make_config(tiny_data, tmp_path, *overrides), log=logs.append)
    poison_batches(trainer, bad)
    calls = []
    step = trainer.train_step
    trainer.train_step = lambda: calls.append(trainer.batch_index) or step()
    reports = []
    trainer.fit(on_report=lambda m, _s: reports.append([m["step"], m["tokens"], m["loss"], m["val_loss"]]))
    keep = ("step ", "warning: non-finite", "warning: rolled back", "eval step")
    assert [" | ".join(line.split(" | ")[:4]) for line in logs if line.startswith(keep)] == expected["lines"]
    t = trainer
    assert [t.step, t.batch_index, t.tokens_seen, t.bad_steps, t.rollbacks, t.lr_scale] == expected[
        "counters"
    ]
    # Recorded from the guard read every step, with the loss by F.cross_entropy; the chunked loss
    # (gptcore.model.LinearCrossEntropy) rounds its gradients differently, by float noise: 7e-8
    # on a parameter sum of 0.03 after 24 steps. A skip or rollback in the wrong place would move
    # these by far more.
    assert sum(reports, []) == pytest.approx(sum(expected["reports"], []), rel=1e-6)
    weights = [float(p.detach().double().sum()) for p in trainer.model.parameters()][:4]
    assert weights == pytest.approx(expected["weights"], rel=1e-6, abs=1e-6)
    if name == "rollback read late":  # batch 12 ran twice: before and after the rollback
        assert calls == [*range(13), *range(12, 25)]


def ddp_rank(rank: int, port: int, cfg, out) -> None:
    """One rank of a 2-process gloo DDP run: the collectives of every loop iteration to `out`."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        calls: list[str] = []
        all_reduce = dist.all_reduce
        train.dist.all_reduce = lambda tensor, *a, **kw: (
            calls.append(tensor.numel()) or all_reduce(tensor, *a, **kw)
        )

        def wrap(model):  # DDP's gradient all-reduce through torch.distributed.all_reduce, counted
            ddp = DistributedDataParallel(model)
            ddp.register_comm_hook(None, allreduce_hook)
            return ddp

        trainer = Trainer(cfg, rank=rank, world_size=2, wrap=wrap, log=None)
        step, starts = trainer.train_step, []
        trainer.train_step = lambda: starts.append(len(calls)) or step()
        trainer.fit()
        ends = [*starts[1:], len(calls)]
        per_step = [calls[a:b] for a, b in zip(starts, ends, strict=True)]
        torch.save((per_step, sum(p.numel() for p in trainer.model.parameters())), out / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ddp_reduces_one_flag_per_step_besides_the_gradients(tiny_data, tmp_path):
    cfg = make_config(
        tiny_data, tmp_path, "train.max_steps=8", "train.log_interval=4", "train.eval_interval=8"
    )
    torch.multiprocessing.spawn(ddp_rank, args=(free_ports(1)[0], cfg, tmp_path), nprocs=2)
    for rank in range(2):
        per_step, params = torch.load(tmp_path / f"{rank}.pt")
        assert len(per_step) == 8
        # The tiny model's gradients fit one DDP bucket; the flag is one number.
        assert [calls for i, calls in enumerate(per_step, 1) if i % 4] == [[params, 1]] * 6
        # At step 4 the host reads the queued steps: one reduce of their four losses.
        assert per_step[3] == [params, 1, 4]
