"""``HeteroDeepSpeedStrategy``: a real ``Trainer.fit`` on an uneven 2 x 2 pipeline plan matches one process.

The multiprocess case starts rank 0 of ``_ds_strategy_worker.py`` (Lightning
launches ranks 1..3 by re-running it) and compares every rank's parameters and
per-step losses with a single-process reference: the same layers, SGD with
momentum, the mean MSE over all 8 samples of each global batch, the batches in
the order of Lightning's (shuffling) training sampler with one replica.  The
same run then resumes from its epoch-boundary checkpoint with a new Trainer and
model (``fit(ckpt_path=...)``, epoch 2) and compares with 6 reference steps,
and resumes the same checkpoint in another plan (re-sharded layer by layer; refused for ZeRO 2).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

import _ds_engine_worker as base  # noqa: E402  (tests/ is on sys.path under pytest)
import _ds_strategy_worker as worker  # noqa: E402

from het_strategy.core.errors import ConfigError  # noqa: E402
from het_strategy.emulation.local_ranks import free_port  # noqa: E402

WORKER = Path(__file__).with_name("_ds_strategy_worker.py")
TIMEOUT_S = 300  # four ranks of DeepSpeed on two shared cores
TOL = dict(rel=1e-6, abs=1e-6)
CLUSTER = {"name": "local", "nodes": [{"name": "local", "devices": [{"name": f"cpu{i}", "type": "CPU"}
                                                                    for i in range(4)]}]}


def _fit(out_dir: Path, zero_stage: int, mode: str = "pipe", world: int = 4) -> list[dict]:
    repo = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK",
                                                                 "PL_GLOBAL_SEED")}
    env.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    log = out_dir / "log.txt"
    with open(log, "w") as fh:
        # own session: Lightning's ranks 1..3 are its children; a hang or failure kills the whole group
        proc = subprocess.Popen([sys.executable, str(WORKER), str(out_dir), str(zero_stage), mode], env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        while time.monotonic() < deadline and len(list(out_dir.glob("rank*.json"))) < world and proc.returncode == 0:
            time.sleep(0.2)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    files = sorted(out_dir.glob("rank*.json"))
    if proc.returncode != 0 or len(files) != world:
        pytest.fail(f"trainer.fit exited {proc.returncode} with {len(files)} rank files:\n{log.read_text()[-5000:]}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


def _reference(epochs: int = 1) -> tuple[list[float], float, dict[str, list[float]]]:
    """One process: (loss per step, validation loss after, parameters), batches in DistributedSampler(
    num_replicas=1) order of each epoch (reshuffled per epoch, as Lightning's fit loop does)."""
    from torch.utils.data import DistributedSampler

    data = worker.dataset()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    model = torch.nn.Sequential(*base.build_layers())
    opt = base.optimizer(model.parameters())
    losses = []
    orders = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert order != sorted(order)  # shuffled: the test would not see a wrong order otherwise
        orders.append(order)
        for step in range(base.STEPS):
            x, y = data[order[step * base.BATCH:(step + 1) * base.BATCH]]
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    assert len({tuple(o) for o in orders}) == epochs  # each epoch its own order
    with torch.no_grad():
        val = float(torch.nn.functional.mse_loss(model(base.batch()[0]), base.batch()[1]))
    return losses, val, {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero_stage, mode", [(0, "pipe"), (1, "pipe"), (0, "asym"), (1, "asym"), (2, "dp")])
def test_trainer_fit_on_uneven_pipelines_matches_one_process(tmp_path, zero_stage, mode):
    # pipe: 2 aligned pipelines x 2 stages; asym: 3 replicas of different shapes (see _ds_engine_worker; at ZeRO 1
    # the optimizer state sharded within its holder sets);
    # dp: 4 one-stage replicas at ZeRO 2 (see _ds_strategy_worker.dp_plan)
    ranks = _fit(tmp_path, zero_stage, mode)
    ref_losses, ref_val, ref_params = _reference()
    covered: set[str] = set()
    for r in ranks:
        assert r["global_step"] == base.STEPS
        assert r["losses"] == pytest.approx(ref_losses, **TOL), f"rank {r['rank']}"
        assert r["logged"] == pytest.approx(ref_losses[-1], rel=1e-6)
        assert r["val_loss"] == pytest.approx(ref_val, rel=1e-6)  # validation after the last step
        for name, values in r["params"].items():
            assert values == pytest.approx(ref_params[name], **TOL), f"rank {r['rank']}: {name}"
        covered |= set(r["params"])
        assert r["restored"] == r["params"], f"rank {r['rank']}: checkpoint round trip"
        assert r["ckpt"] == {"global_step": base.STEPS, "plan": True, "loops": True, "is_dir": True}
    assert covered == set(ref_params)
    # fit(ckpt_path=...) by a new Trainer and model: epoch 2 continues as one process would over 6 steps
    ref6_losses, _, ref6_params = _reference(epochs=2)
    for r in ranks:
        res = r["resumed"]
        assert res["global_step"] == 2 * base.STEPS, f"rank {r['rank']}"
        assert res["losses"] == pytest.approx(ref6_losses[base.STEPS:], **TOL), f"rank {r['rank']}"
        assert set(res["params"]) == set(r["params"])
        for name, values in res["params"].items():
            assert values == pytest.approx(ref6_params[name], **TOL), f"rank {r['rank']}: resumed {name}"
        # resumed mid-epoch (after step 2 of 3): steps 3..6 as one process makes them
        mid = r["mid_resumed"]
        assert mid["global_step"] == 2 * base.STEPS, f"rank {r['rank']}"
        assert mid["losses"] == pytest.approx(ref6_losses[2:], **TOL), f"rank {r['rank']}: mid-epoch resume"
        for name, values in mid["params"].items():
            assert values == pytest.approx(ref6_params[name], **TOL), f"rank {r['rank']}: mid-resumed {name}"
        # a checkpoint of another plan (another ZeRO stage; asym -> the aligned plan) continues layer by layer in it,
        # as one process would; a ZeRO-2 one has no per-layer state and is refused, naming the field
        if zero_stage == 2:
            assert r["refused"] is not None and r["refused"]["field"] == "ckpt_path", r["refused"]
            assert "zero_stage" in r["refused"]["message"] and "per-layer state" in r["refused"]["message"]
        else:
            assert r["refused"] is None, r["refused"]
            assert r["replanned"]["global_step"] == 2 * base.STEPS
            for name, values in r["replanned"]["params"].items():
                assert values == pytest.approx(ref6_params[name], **TOL), f"rank {r['rank']}: re-planned {name}"
    held = [sorted({int(n.split(".")[0]) for n in r["params"]}) for r in ranks]
    if mode == "asym":  # plan order: rank 0 all, ranks 1 -> 2 split at 2, rank 3 all
        assert held == [list(range(6)), [0, 1], [2, 3, 4, 5], list(range(6))]
    elif mode == "dp":  # every replica holds the whole model
        assert held == [list(range(6))] * 4
    else:  # rank = stage * dp + pipeline: ranks 0, 1 hold layers [0, 4), ranks 2, 3 hold [4, 6)
        assert held == [[0, 1, 2, 3]] * 2 + [[4, 5]] * 2


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero_stage, mode", [(0, "asym_bf16"), (1, "asym_bf16"), (0, "asym_per_device")])
def test_trainer_fit_in_bf16_mixed_on_asymmetric_replicas_tracks_fp32(tmp_path, zero_stage, mode):
    """``Trainer(precision="bf16-mixed")`` with the asymmetric plan in bf16: at ZeRO 0 DeepSpeed's bf16 optimizer
    (fp32 master weights) on every replica and the holder-set reduction of its fp32 gradients, at ZeRO 1 the fp32
    masters and the optimizer state sharded within the holder sets (restored exactly from a checkpoint); within
    bf16's rounding of the fp32 single-process run.  ``PerDevicePrecision`` with bf16 and fp16 ranks: the
    runtime's whole fp32 masters on each holder at ZeRO 0 (restored exactly too)."""
    ranks = _fit(tmp_path, zero_stage, mode)
    ref_losses, ref_val, ref_params = _reference()
    tol = dict(rel=2e-2, abs=4e-3)  # bf16 keeps 8 mantissa bits (the parameters are compared as held, in bf16)
    per_device = mode == "asym_per_device"
    for r in ranks:
        assert r["param_dtype"] == ("torch.float16" if per_device and r["rank"] % 2 else "torch.bfloat16")
        assert r["optimizer"] == ("BF16_Optimizer" if zero_stage == 0 and not per_device else "SGD")
        if zero_stage == 1 or per_device:
            assert r["masters_restored"] == r["masters"] and any(any(c) for c in r["masters"])
        assert r["global_step"] == base.STEPS
        assert r["losses"] == pytest.approx(ref_losses, **tol), f"rank {r['rank']}"
        assert r["val_loss"] == pytest.approx(ref_val, **tol)
        for name, values in r["params"].items():
            assert values == pytest.approx(ref_params[name], **tol), f"rank {r['rank']}: {name}"
    assert len({tuple(r["losses"]) for r in ranks}) == 1


@pytest.mark.multiprocess
def test_a_loader_batch_other_than_the_global_batch_is_refused(tmp_path):
    (result,) = _fit(tmp_path, 0, "badbatch", world=1)
    assert result["field"] == "DataLoader.batch_size", result


@pytest.mark.parametrize("kwargs, field", [
    (dict(cluster=CLUSTER), "workload"),  # no plan: the strategy plans, and needs the workload's layers
    (dict(cluster=CLUSTER, workload="tiny_gpt"), "global_batch_size"),
    (dict(cluster=CLUSTER, workload="tiny_gpt", global_batch_size=8, planner_mode="fast"), "planner_mode"),
    (dict(cluster=CLUSTER, plan=42), "plan"),
    (dict(plan="PLAN"), "cluster"),
    (dict(cluster=CLUSTER, plan="PLAN", zero_stage=4), "zero_stage"),
    (dict(cluster=CLUSTER, plan="PLAN", zero_stage=2), "plan.zero_stage"),  # a pipeline plan: ZeRO 0 or 1
    (dict(cluster=CLUSTER, plan="PLAN", emulation="no"), "emulation"),
    (dict(cluster=CLUSTER, plan="PLAN", gradient_clipping=-1.0), "gradient_clipping"),
    (dict(cluster={"name": "two", "nodes": [{"name": "n", "devices": [{"name": "a", "type": "CPU"}]}]},
          plan="PLAN"), "plan.pipelines[0].stages[0].devices[0]"),  # a plan of another cluster
])
def test_bad_construction_is_refused_naming_the_field(kwargs, field):
    from het_strategy import HeteroDeepSpeedStrategy

    kwargs = {k: (base.pipe_plan() if v == "PLAN" else v) for k, v in kwargs.items()}
    with pytest.raises(ConfigError) as err:
        HeteroDeepSpeedStrategy(**kwargs)
    assert err.value.field == field
    assert f"`{field}`" in str(err.value)


def test_construction():
    import lightning.pytorch as pl

    from het_strategy import HeteroDeepSpeedStrategy

    s = HeteroDeepSpeedStrategy(cluster=CLUSTER, plan=base.pipe_plan(), zero_stage=1, gradient_clipping=0.5)
    assert isinstance(s, pl.strategies.DDPStrategy)
    assert s.plan.zero_stage == 1 and s.strategy_name == "hetero_deepspeed"
    assert s.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    assert s.run.runner is None and s.run.last_loss is None and s.run.plan_summary is None and s.cluster.name == "local"
    # one-stage replicas run at every ZeRO stage (DeepSpeed's pipeline engine is not involved)
    assert HeteroDeepSpeedStrategy(cluster=CLUSTER, plan=worker.dp_plan(), zero_stage=3).plan.zero_stage == 3


@pytest.mark.parametrize("elastic", [False, True])
def test_a_best_plan_that_leaves_a_device_idle_is_refused_naming_it_and_why(elastic):
    """Every hetero_deepspeed rank holds a stage: when the best plan leaves a device out (b is 1000x slower), rank
    0's planning says which and why, and what to do (under torchrun: stop that device's agent)."""
    from het_strategy.core.cluster import load_cluster
    from het_strategy.strategy.deepspeed_plan import DeepSpeedPlanHolder

    devices = [{"name": "a", "type": "CPU", "tflops": {"fp32": 1.0}},
               {"name": "b", "type": "CPU", "tflops": {"fp32": 0.001}}]
    cluster = load_cluster({"name": "two", "nodes": [{"name": "n", "devices": devices}]})
    holder = DeepSpeedPlanHolder(cluster, workload="tiny_gpt", global_batch_size=16, max_tp=1)
    if elastic:
        holder.use_devices_present(["a", "b"])
    with pytest.raises(ConfigError) as err:
        holder.ensure(0, 1)
    field = "HET_STRATEGY_DEVICE" if elastic else "cluster"
    assert str(err.value).startswith(f"`{field}` is ") and "leaves b idle (b: too slow" in str(err.value)
    assert ("stop the agents of the idle devices" in str(err.value)) == elastic


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_a_checkpoint_io_plugin_is_refused_in_the_trainer(namespace):
    """DeepSpeed writes the checkpoint files itself: an ``AsyncCheckpointIO`` would be passed over, so
    ``Trainer(plugins=[...])`` refuses it, on both Lightning packages; without one the default stays."""
    import importlib

    from het_strategy import HeteroDeepSpeedStrategy
    from het_strategy.strategy.pytorch_lightning_classes import HeteroDeepSpeedStrategyPL

    pl = importlib.import_module(namespace)
    io = importlib.import_module(f"{namespace}.plugins.io")
    cls = HeteroDeepSpeedStrategy if namespace == "lightning.pytorch" else HeteroDeepSpeedStrategyPL
    with pytest.raises(ConfigError) as err:
        pl.Trainer(strategy=cls(cluster=CLUSTER, plan=base.pipe_plan()), accelerator="cpu", devices=4,
                   plugins=[io.AsyncCheckpointIO()], logger=False)
    assert err.value.field == "Trainer.plugins" and "AsyncCheckpointIO" in str(err.value)
    trainer = pl.Trainer(strategy=cls(cluster=CLUSTER, plan=base.pipe_plan()), accelerator="cpu", devices=4,
                         logger=False)
    assert type(trainer.strategy.checkpoint_io).__name__ == "TorchCheckpointIO"


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_hetero_deepspeed_is_registered_on_each_lightning_package(namespace):
    pytest.importorskip(namespace)
    code = "\n".join([
        "import pickle",
        "import het_strategy",
        f"import {namespace} as pl",
        "from het_strategy.core.errors import ConfigError",
        f"cls = het_strategy.HeteroDeepSpeedStrategy{'' if namespace == 'lightning.pytorch' else 'PL'}",
        "assert pl.strategies.StrategyRegistry['hetero_deepspeed']['strategy'] is cls",
        "assert issubclass(cls, pl.strategies.DDPStrategy) and pickle.loads(pickle.dumps(cls)) is cls",
        "try:",
        "    pl.Trainer(strategy='hetero_deepspeed', accelerator='cpu', devices=1, logger=False)",
        "    raise SystemExit('no ConfigError')",
        "except ConfigError as exc:",
        "    assert exc.field == 'cluster', exc",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert out.returncode == 0, out.stderr[-3000:]
