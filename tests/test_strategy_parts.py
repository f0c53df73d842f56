"""The hetero strategy's collaborators, each on its own (no process group), the pytorch_lightning classes, the
checkpoint format, and the ImportError a missing Lightning or torch gives."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from het_strategy.compression import CompressionConfig
from het_strategy.core.cluster import load_cluster
from het_strategy.core.errors import ConfigError
from het_strategy.core.workload import load_workload
from het_strategy.moe import HeteroMoE
from het_strategy.planning.strategy_plans import data_parallel_plan, shares_in_rank_order
from het_strategy.planning.rebalance import with_shares
from het_strategy.strategy import checkpoint as ckpt
from het_strategy.strategy.arguments import PROBE_MODES, ProbeMode
from het_strategy.strategy.compression_run import CommHookBuilder
from het_strategy.strategy.dp_extension import DataParallelExtension
from het_strategy.planning.experts import MoEPlacement
from het_strategy.strategy.expert_placer import ExpertPlacer, check_resumable
from het_strategy.strategy.loaders import BatchSplitter, LoaderMode, is_split, loader_mode, split_loader
from het_strategy.strategy.plan_holder import PlanHolder
from het_strategy.strategy.rank_context import RankContext
from het_strategy.strategy.step_timing import StepPacing

ROOT = Path(__file__).resolve().parents[1]
LEGACY = Path(__file__).parent / "data" / "checkpoint_v0.1.0.ckpt"


def _ctx(rank: int = 0, world: int = 2) -> RankContext:
    return RankContext(rank, world, torch.device("cpu"), "fp32")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)


# -- PlanHolder -----------------------------------------------------------------------------------------
def test_the_plan_holder_checks_the_cluster_against_the_world_once() -> None:
    holder = PlanHolder(load_cluster("local_cpu2"), None, None)
    with pytest.raises(ConfigError, match="as many devices as the launched world has ranks \\(3\\)"):
        holder.resolve_cluster(_ctx(world=3))
    cluster = holder.resolve_cluster(_ctx())
    assert holder.cluster is cluster and holder.resolve_cluster(_ctx(world=3)) is cluster  # kept once resolved


def test_the_plan_holder_drops_emulated_speeds_when_emulation_is_off() -> None:
    mixed = load_cluster("local_cpu4_mixed")
    emulated = PlanHolder(mixed, None, None).resolve_cluster(_ctx(world=4))
    plain = PlanHolder(mixed, None, None, emulation=False).resolve_cluster(_ctx(world=4))
    assert {d.emulated_speed for d in emulated.devices} != {d.emulated_speed for d in plain.devices}
    assert plain == mixed.without_emulation()


def test_apply_plan_checks_the_plan_and_the_loader_takes_its_shares_at_the_step() -> None:
    cluster, workload = load_cluster("local_cpu2"), load_workload("tiny_gpt", "fp32")
    holder = PlanHolder(cluster, None, None)
    with pytest.raises(ConfigError, match="apply_plan: no training DataLoader"):
        holder.apply_plan(data_parallel_plan(cluster, workload, 12, "fp32"), 12, "fp32")
    holder.resolve_cluster(_ctx())
    holder.workload = workload
    holder.plan = data_parallel_plan(cluster, workload, 12, "fp32")
    splitter = BatchSplitter(12)
    with pytest.raises(ConfigError, match="no training DataLoader has been split yet"):
        splitter.set_train_shares([9, 3], 2)
    splitter.split(DataLoader(list(range(48)), batch_size=6), LoaderMode.SPLIT, 12, [6, 6], 0, 2, lambda: 0)
    assert holder.current_shares(splitter.train_shares()) == [6, 6]
    shares = holder.apply_plan(with_shares(holder.plan, cluster, [9, 3]), splitter.train_global_batch(), "fp32")
    assert shares == [9, 3] and shares_in_rank_order(holder.plan, cluster) == [9, 3]  # the plan run (checkpointed)
    splitter.set_train_shares(shares, 2)
    assert holder.current_shares(splitter.train_shares()) == [9, 3]
    sizes = [len(batch) for batch in splitter.train_sampler]
    assert sizes == [6, 6, 9, 9]  # rank 0's batches: the new share from step 2 on


def test_the_plan_holder_estimates_the_workload_from_the_module() -> None:
    module = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    workload = PlanHolder("auto", None, None).resolve_workload(module, DataLoader([torch.zeros(4)]), "fp32")
    assert workload.name == "Sequential"
    given = PlanHolder("auto", None, "tiny_gpt").resolve_workload(module, DataLoader([torch.zeros(4)]), "fp32")
    assert given == load_workload("tiny_gpt", "fp32")


# -- BatchSplitter --------------------------------------------------------------------------------------
def test_the_splitter_takes_the_global_batch_from_the_option_or_the_loader() -> None:
    loader = DataLoader(list(range(40)), batch_size=5)
    assert BatchSplitter(12).global_batch(loader, 2) == 12
    assert BatchSplitter().global_batch(loader, 2) == 10  # batch_size x world
    with pytest.raises(ConfigError, match="DataLoader.batch_size"):
        loader_mode(DataLoader(list(range(4)), batch_size=None))

    class Stream(IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(4))

    with pytest.raises(ConfigError, match="DataLoader.dataset.*map-style"):
        loader_mode(DataLoader(Stream(), batch_size=2))


def test_the_splitter_follows_the_current_batch_and_weights_the_loss() -> None:
    splitter = BatchSplitter()
    loader = splitter.split(DataLoader(list(range(20)), batch_size=4), LoaderMode.SPLIT, 8, [6, 2], 1, 2, None)
    assert is_split(loader) and splitter.train_sampler is None  # evaluation: not kept
    assert [len(b) for b in loader] == [2, 2, 1]  # rank 1's 2 of 8, then its part of the short last batch
    assert splitter.begin_batch(loader, 0) == (2, 8) and splitter.local_samples == 2
    assert DataParallelExtension().loss_weight(splitter.counts, 2, None) == pytest.approx(2 * 2 / 8)
    assert splitter.begin_batch(DataLoader([1, 2]), 0) is None and splitter.counts is None
    with pytest.raises(ConfigError, match="no training DataLoader has been split yet"):
        splitter.next_safe_step(torch.device("cpu"))


# -- StepPacing -----------------------------------------------------------------------------------------
def test_pacing_pads_only_on_an_emulated_cluster_and_records_each_batch() -> None:
    workload = load_workload("tiny_gpt", "fp32")
    pacing = StepPacing()
    assert pacing.emulate(load_cluster("amp_v100_t4"), 0, workload, "fp32", experts=False) is None
    padding = pacing.emulate(load_cluster("local_cpu4_mixed"), 3, workload, "fp32", experts=False)
    assert padding is pacing.padding and padding.warn is False  # only rank 0 warns
    pacing.begin(5, 4, global_step=5)
    pacing.clock.forward_done()
    pacing.finish_padding(4)
    record = pacing.after_backward(4)
    assert (record.step, record.samples) == (5, 4) and record.compute_s >= padding.target_s > 0
    assert list(pacing.clock.records) == [record]


# -- CommHookBuilder ------------------------------------------------------------------------------------
class _Model:
    def register_comm_hook(self, state: Any, hook: Any) -> None:
        self.state, self.hook = state, hook


def test_the_hook_builder_registers_the_users_hook_counted_and_wrapped() -> None:
    def user_hook(state, bucket):  # type: ignore[no-untyped-def]
        raise AssertionError("not called here")

    wrapped = []
    builder = CommHookBuilder(None, user_hook, "user state", lambda hook: wrapped.append(hook) or hook)
    model = _Model()
    hook = builder.register(model, None, 2, 0, None, lambda: None, lambda: None)
    assert model.state == "user state" and model.hook is hook and wrapped == [hook]
    assert builder.compression_state is None and builder.run is None


def test_the_hook_builder_refuses_a_state_for_a_named_method() -> None:
    with pytest.raises(ConfigError, match="compression_state"):
        CommHookBuilder(CompressionConfig(method="fp16"), None, object())


def test_the_hook_builder_refuses_a_state_without_a_users_hook() -> None:
    with pytest.raises(ConfigError, match="`compression_state` is 'object'; it must go with a DDP comm hook"):
        CommHookBuilder(None, None, object())


# -- ExpertPlacer ---------------------------------------------------------------------------------------
def test_the_placer_leaves_a_dense_model_alone_and_refuses_resuming_experts() -> None:
    dense = nn.Linear(4, 4)
    placer = ExpertPlacer("uniform")
    assert placer.place(dense, load_cluster("local_cpu2"), "fp32", 0, 2) is None
    state = {"weight": torch.zeros(1)}
    assert placer.full_state(dense, state, 0, 2) is state
    check_resumable(dense)
    with pytest.raises(ConfigError, match="resuming a run with HeteroMoE layers"):
        check_resumable(nn.Sequential(HeteroMoE(4, lambda: nn.Linear(4, 4), num_experts=2)))


def test_the_placer_places_experts_once() -> None:
    module = nn.Sequential(HeteroMoE(4, lambda: nn.Linear(4, 4), num_experts=3))
    placer = ExpertPlacer([[[0, 1, 2]]], verbose=False)  # one layer; its placement on the one rank (no group)
    run = placer.place(module, load_cluster("local_cpu2"), "fp32", 0, 1)
    assert run is not None and run.source == "given" and run.placements[0].counts == [3]
    assert placer.place(module, load_cluster("local_cpu2"), "fp32", 0, 1) is run
    with pytest.raises(ConfigError, match="moe_placement"):
        ExpertPlacer("balanced").place(nn.Sequential(HeteroMoE(4, lambda: nn.Linear(4, 4), num_experts=2)),
                                       load_cluster("local_cpu2"), "fp32", 0, 1)


def test_the_options_are_typed_with_the_values_the_checks_accept() -> None:
    assert get_args(ProbeMode) == PROBE_MODES
    assert [str(m) for m in MoEPlacement] == ["planned", "uniform"]


# -- the pytorch_lightning classes -------------------------------------------------------------------------
def test_the_pytorch_lightning_strategy_builds_and_pickles_by_name() -> None:
    pl_pkg = pytest.importorskip("pytorch_lightning")
    import het_strategy

    strategy = het_strategy.HeteroStrategyPL(cluster="local_cpu2", global_batch_size=8)
    assert isinstance(strategy, pl_pkg.strategies.DDPStrategy) and strategy.run.plans.cluster_source.name == "local_cpu2"
    blob = pickle.dumps(het_strategy.HeteroStrategyPL).hex()
    out = _run(f"import pickle; cls = pickle.loads(bytes.fromhex({blob!r})); print(cls.__module__, cls.__name__)")
    assert out.returncode == 0 and out.stdout.split() == ["het_strategy.strategy.pytorch_lightning_classes",
                                                          "HeteroStrategyPL"], out.stderr[-2000:]


# -- checkpoint format ----------------------------------------------------------------------------------
def test_the_strategy_state_carries_the_format_and_loads_back() -> None:
    cluster, workload = load_cluster("local_cpu2"), load_workload("tiny_gpt", "fp32")
    plan = data_parallel_plan(cluster, workload, 12, "fp32")
    state = ckpt.strategy_state(cluster, plan, [6, 6], None)
    assert state[ckpt.FORMAT_KEY] == ckpt.CHECKPOINT_FORMAT
    assert ckpt.restored_state({ckpt.CHECKPOINT_KEY: state}, "run.ckpt") is state
    assert ckpt.restored_state({"state_dict": {}}, "plain.ckpt") is None  # a plain Lightning checkpoint


def test_a_checkpoint_without_the_format_or_of_another_is_refused_naming_it() -> None:
    legacy = torch.load(LEGACY, weights_only=False)
    with pytest.raises(ConfigError, match=f"checkpoint '{LEGACY}': its entry 'het_strategy' has no checkpoint "
                                          "format; .*reads format 2 only.*start the run afresh"):
        ckpt.restored_state(legacy, LEGACY)
    future = {ckpt.CHECKPOINT_KEY: {ckpt.FORMAT_KEY: 99}}
    with pytest.raises(ConfigError, match="'later.ckpt': its entry 'het_strategy' is of checkpoint format 99"):
        ckpt.restored_state(future, "later.ckpt")


def test_a_deepspeed_checkpoint_without_the_format_is_refused_before_loading(tmp_path: Path) -> None:
    from het_strategy.strategy.deepspeed_checkpoint import CHECKPOINT_TAG, PLAN_KEY, load_plan_checkpoint

    plan = data_parallel_plan(load_cluster("local_cpu2"), load_workload("tiny_gpt", "fp32"), 12, "fp32")
    (tmp_path / CHECKPOINT_TAG).mkdir()
    torch.save({PLAN_KEY: plan.to_dict()}, tmp_path / CHECKPOINT_TAG / "mp_rank_00_model_states.pt")
    with pytest.raises(ConfigError, match="client state entry 'het_strategy' has no checkpoint format"):
        load_plan_checkpoint(None, plan, tmp_path)  # type: ignore[arg-type]  # refused before the runner is used


# -- honest imports -------------------------------------------------------------------------------------
def test_the_hetero_strategy_refuses_a_pipeline_plan_at_construction() -> None:
    from het_strategy import HeteroStrategy
    from het_strategy.core.plan import Pipeline, Plan, Stage

    pipeline = Plan(cluster="c", cluster_devices=("d0", "d1"), model={"name": "m", "num_layers": 4},
                    global_batch_size=8, pipelines=(Pipeline((Stage(("d0",), (0, 2)), Stage(("d1",), (2, 4))),
                                                             micro_batch_size=1, samples=8),))
    with pytest.raises(ConfigError, match=r"`plan.pipelines\[0\].stages` is 2; it must be 1 stage"):
        HeteroStrategy(cluster="local_cpu2", plan=pipeline)


@pytest.mark.parametrize("hidden, name, call, needs", [
    ("lightning", "HeteroStrategy", "", "needs lightning"),
    ("torch", "HeteroStrategy", "", "needs torch"),
    ("pytorch_lightning", "HeteroStrategyPL", "", "needs pytorch_lightning: pip install 'het_strategy\\[pl\\]'"),
    ("lightning", "HeteroDeepSpeedStrategy", "", "needs lightning"),
    ("deepspeed", "HeteroDeepSpeedStrategy", "(cluster='local_cpu2')", "needs DeepSpeed.*het_strategy\\[deepspeed\\]"),
])
def test_a_strategy_without_its_packages_raises_import_error_naming_them(hidden: str, name: str, call: str,
                                                                         needs: str) -> None:
    code = "\n".join([
        f"import sys; sys.modules[{hidden!r}] = None",  # the package is not installed, as far as import goes
        "import het_strategy",  # the planning side still imports
        "try:",
        f"    het_strategy.{name}{call}",
        "except ImportError as exc:",
        "    print('ImportError:', exc)",
        "else:",
        "    print('no error')",
    ])
    out = _run(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"ImportError: {name} ") and re.search(needs, out.stdout), out.stdout


@pytest.mark.parametrize("first", ["het_strategy.callbacks.telemetry", "het_strategy.strategy.hetero_run",
                                   "het_strategy.strategy.pytorch_lightning_classes"])
def test_a_module_of_ours_that_imports_lightning_first_still_registers_every_strategy(first: str) -> None:
    """Lightning's import finishing inside one of our modules' imports waits for that module, then registers."""
    pytest.importorskip("pytorch_lightning")
    code = "\n".join([
        f"import {first}",
        "import lightning.pytorch as lp, pytorch_lightning as pl, het_strategy",
        "assert lp.strategies.StrategyRegistry['hetero']['strategy'] is het_strategy.HeteroStrategy",
        "assert lp.strategies.StrategyRegistry['hetero_deepspeed']['strategy'] is het_strategy.HeteroDeepSpeedStrategy",
        "assert pl.strategies.StrategyRegistry['hetero_spawn']['strategy'] is het_strategy.HeteroStrategyPL",
    ])
    out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_user_sampler_wrapped_by_lightning_gives_its_own_order() -> None:
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    class Backwards(torch.utils.data.Sampler):
        def __init__(self) -> None:
            self.draws = 0

        def __len__(self) -> int:
            return 10

        def __iter__(self):  # type: ignore[no-untyped-def]
            self.draws += 1
            return iter(range(9, -1, -1))

    user = Backwards()
    wrapped = DataLoader(list(range(10)), batch_size=2, sampler=DistributedSamplerWrapper(user, num_replicas=2,
                                                                                          rank=1, shuffle=False))
    loader = split_loader(wrapped, 4, [3, 1], 0, None)  # (the splitter then checks the order across ranks)
    assert [b.tolist() for b in loader] == [[9, 8, 7], [5, 4, 3], [1, 0]]  # the user's whole order, not rank 1's half
    assert user.draws >= 1
