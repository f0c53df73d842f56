"""Straggler detection on synthetic series, the ladder's arguments, and the scheduled slowdowns of a cluster."""

from __future__ import annotations

import random
import re

import pytest

pytest.importorskip("lightning")

from het_strategy.callbacks.straggler import ShiftDetector, StragglerMitigation  # noqa: E402
from het_strategy.core.cluster import load_cluster  # noqa: E402
from het_strategy.emulation.speeds import emulated_factor  # noqa: E402
from het_strategy.core.errors import ConfigError  # noqa: E402
from het_strategy.core.plan import Plan  # noqa: E402
from het_strategy.planning.strategy_plans import data_parallel_plan, estimate_workload, shares_in_rank_order  # noqa: E402


def _run(values: list[float], **kwargs) -> list[tuple[int, float]]:  # type: ignore[no-untyped-def]
    det = ShiftDetector(**kwargs)
    return [(i, s.ratio) for i, v in enumerate(values) if (s := det.update(v)) is not None]


def _noisy(n: int, level: float, noise: float, rng: random.Random) -> list[float]:
    return [level * (1 + noise * (2 * rng.random() - 1)) for _ in range(n)]


def test_step_change_is_found_after_exactly_consecutive_steps() -> None:
    rng = random.Random(0)
    values = _noisy(30, 1.0, 0.1, rng) + _noisy(30, 3.0, 0.1, rng)
    shifts = _run(values, consecutive=4)
    assert len(shifts) == 1
    index, ratio = shifts[0]
    assert index == 30 + 4 - 1
    assert 2.5 < ratio < 3.5


def test_spikes_shorter_than_consecutive_never_trigger() -> None:
    rng = random.Random(1)
    values = _noisy(200, 1.0, 0.1, rng)
    for start in (40, 90, 150):
        values[start: start + 3] = [6.0, 8.0, 5.0]  # bursts of 3 < consecutive = 4
    values[120] = 50.0
    assert _run(values, consecutive=4) == []


def test_noise_of_ten_percent_never_triggers() -> None:
    for seed in range(5):
        assert _run(_noisy(2000, 1.0, 0.1, random.Random(seed))) == []


def test_a_drift_is_caught_while_it_happens() -> None:
    values = [1.0] * 40 + [1.0 + 2.0 * i / 100 for i in range(100)] + [3.0] * 40
    shifts = _run(values)
    assert shifts, "a drift from 1 to 3 must be declared"
    assert 40 < shifts[0][0] < 140 and shifts[0][1] > 1.25


def test_slowdown_then_recovery_gives_two_opposite_shifts() -> None:
    rng = random.Random(2)
    values = _noisy(30, 1.0, 0.1, rng) + _noisy(40, 3.0, 0.1, rng) + _noisy(30, 1.0, 0.1, rng)
    shifts = _run(values, consecutive=4)
    assert [i for i, _ in shifts] == [33, 73]
    assert shifts[0][1] > 2.5 and shifts[1][1] < 0.4


def test_restart_after_a_share_change_needs_only_consecutive_values() -> None:
    det = ShiftDetector(consecutive=3, warmup=8)
    for _ in range(20):
        det.update(1.0)
    det.restart()
    assert det.level == 1.0  # the last known level until the new regime has values
    for v in (2.0, 2.0, 2.0):
        assert det.update(v) is None  # these found the new regime, they are not a shift
    assert det.level == 2.0
    assert [det.update(6.0) for _ in range(3)][-1] is not None


def test_detector_state_round_trip_continues_identically() -> None:
    rng = random.Random(3)
    values = _noisy(50, 1.0, 0.1, rng) + _noisy(30, 2.0, 0.1, rng)
    a = ShiftDetector()
    for v in values[:45]:
        a.update(v)
    b = ShiftDetector()
    b.load_state_dict(a.state_dict())
    assert [a.update(v) for v in values[45:]] == [b.update(v) for v in values[45:]]


@pytest.mark.parametrize("kwargs, field", [
    ({"threshold": 0}, "threshold"), ({"threshold": -0.1}, "threshold"), ({"consecutive": 0}, "consecutive"),
    ({"window": 4, "consecutive": 4}, "window"), ({"min_share": 1.0}, "min_share"),
    ({"min_share": -0.1}, "min_share"), ({"evict_ratio": 1.0}, "evict_ratio"), ({"stop_ratio": 0.5}, "stop_ratio"),
    ({"evict_ratio": 3.0, "stop_ratio": 2.0}, "stop_ratio"), ({"every_n_steps": 0}, "every_n_steps"),
])
def test_bad_arguments_fail_at_construction(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        StragglerMitigation(**kwargs)


def test_min_share_above_one_over_world_is_refused_before_training() -> None:
    import lightning.pytorch as pl

    cb = StragglerMitigation(min_share=0.3)

    class _Trainer:
        world_size = 4
        strategy = _FakeStrategy([8, 8, 8, 8])

    with pytest.raises(ConfigError, match="min_share"):
        cb.setup(_Trainer(), pl.LightningModule(), "fit")  # type: ignore[arg-type]


def test_scheduled_slowdown_and_noise_in_a_cluster_config() -> None:
    raw = load_cluster("local_cpu4_equal").to_dict()
    raw["slowdowns"] = [{"device": "rank2", "factor": 3.0, "start_step": 50, "end_step": 150}]
    raw["emulation_noise"] = 0.1
    cluster = load_cluster(raw)
    assert [cluster.slowdown_factor("rank2", s) for s in (49, 50, 149, 150)] == [1.0, 3.0, 3.0, 1.0]
    assert cluster.slowdown_factor("rank1", 60) == 1.0
    factors = [emulated_factor(cluster, "rank0", s) for s in range(500)]
    assert all(0.9 <= f <= 1.1 for f in factors) and max(factors) - min(factors) > 0.15
    assert factors == [emulated_factor(cluster, "rank0", s) for s in range(500)]  # reproducible
    assert 2.7 <= emulated_factor(cluster, "rank2", 60) <= 3.3
    plain = cluster.without_emulation()  # emulation=False, real-compute benchmarks: speeds, schedule, noise gone
    assert not plain.slowdowns and plain.emulation_noise == 0
    assert all(d.emulated_speed is None for d in plain.devices) and plain.devices[0].tflops == cluster.devices[0].tflops
    raw["slowdowns"] = [{"device": "rank7", "factor": 3.0, "start_step": 50}]
    with pytest.raises(ConfigError, match="rank7"):
        load_cluster(raw)
    raw["slowdowns"] = [{"device": "rank1", "factor": 3.0, "start_step": 50, "end_step": 40}]
    with pytest.raises(ConfigError, match="end_step"):
        load_cluster(raw)


class _FakeStrategy:
    """Stands in for the hetero strategy and its run, through what callbacks may use of them (``HeteroRuntime``)."""

    @property
    def run(self) -> "_FakeStrategy":
        return self

    def __init__(self, shares: list[int], cluster: object = "local_cpu4_equal") -> None:
        self.cluster = load_cluster(cluster)
        workload = estimate_workload("fake", 1000, 1, "fp32")
        self.plan = data_parallel_plan(self.cluster, workload, sum(shares), "fp32")
        self.records: list = []
        self.current_local_samples = None
        self.compression_state = None
        self.calls: list[tuple[list[int], int]] = []
        self.shares = shares
        self.safe_step = 3

    def current_shares(self) -> list[int]:
        return list(self.shares)

    def next_safe_step(self) -> int:
        return self.safe_step

    def apply_plan(self, plan: Plan, first_step: int) -> None:
        self.plan = plan
        self.shares = shares_in_rank_order(plan, self.cluster)
        self.calls.append((self.shares, first_step))


class _FakeTrainer:
    global_rank = 0
    world_size = 4
    loggers: list = []
    default_root_dir = "."

    def __init__(self, shares: list[int], cluster: object = "local_cpu4_equal") -> None:
        self.strategy = _FakeStrategy(shares, cluster)
        self.world_size = len(shares)
        self.should_stop = False
        self.saved: list[str] = []

    def save_checkpoint(self, path: object) -> None:
        self.saved.append(str(path))


def _window(per_sample: list[list[float]], samples: list[int], first_step: int = 0):  # type: ignore[no-untyped-def]
    """A gathered telemetry window: per_sample[r][s] seconds per sample of rank r in step first_step + s."""
    import torch

    from het_strategy.callbacks.telemetry import FIELDS

    w = torch.zeros(len(per_sample), len(per_sample[0]), len(FIELDS), dtype=torch.float64)
    for r, series in enumerate(per_sample):
        for s, t in enumerate(series):
            w[r, s, FIELDS.index("step")] = first_step + s
            w[r, s, FIELDS.index("samples")] = samples[r]
            w[r, s, FIELDS.index("compute_s")] = t * samples[r]
    return w


def _feed(cb: StragglerMitigation, trainer: _FakeTrainer, slow: float, steps: int = 12) -> None:
    import lightning.pytorch as pl

    cb.setup(trainer, pl.LightningModule(), "fit")  # type: ignore[arg-type]
    base = [[0.01] * steps for _ in range(4)]
    cb.on_window(trainer, pl.LightningModule(), _window(base, [8] * 4), batch_idx=0)  # type: ignore[arg-type]
    after = [[0.01] * 4, [0.01] * 4, [0.01 * slow] * 4, [0.01] * 4]
    cb.on_window(trainer, pl.LightningModule(), _window(after, [8] * 4), batch_idx=1)  # type: ignore[arg-type]


def test_ladder_rebalances_by_measured_speed() -> None:
    cb, trainer = StragglerMitigation(verbose=False, log=False), _FakeTrainer([8, 8, 8, 8])
    _feed(cb, trainer, slow=3.0)
    ((shares, first_step),) = trainer.strategy.calls
    assert first_step == 3 and sum(shares) == 32 and shares[2] in (2, 3)
    # min-max of n x t with rank2 3x slower: the slowest rank-time is the optimum, 10 samples x 0.01 s
    assert max(n * t for n, t in zip(shares, [0.01, 0.01, 0.03, 0.01])) == pytest.approx(0.10)
    (d,) = cb.decisions
    assert d.action == "rebalance" and d.ranks == [2] and "rank2" in d.reason and "+200%" in d.reason


def test_ladder_gives_a_far_slower_rank_only_the_minimum_share() -> None:
    cb = StragglerMitigation(min_share=0.0625, evict_ratio=5.0, verbose=False, log=False)
    trainer = _FakeTrainer([8, 8, 8, 8])
    _feed(cb, trainer, slow=8.0)
    assert trainer.strategy.calls == [([10, 10, 2, 10], 3)]  # 6.25% of 32 = 2 samples
    assert cb.decisions[0].action == "minimum_share" and "minimum share 2" in cb.decisions[0].reason


def test_ladder_stops_with_a_checkpoint_naming_the_rank() -> None:
    cb = StragglerMitigation(evict_ratio=5.0, stop_ratio=20.0, verbose=False, log=False)
    trainer = _FakeTrainer([8, 8, 8, 8])
    _feed(cb, trainer, slow=30.0)
    assert trainer.should_stop and trainer.saved and trainer.saved[0].endswith(".ckpt")
    assert trainer.strategy.calls == []
    assert cb.decisions[0].action == "stop" and "rank2 slower than 20.0x the median" in cb.decisions[0].reason


def test_callback_state_round_trip() -> None:
    cb, trainer = StragglerMitigation(verbose=False, log=False), _FakeTrainer([8, 8, 8, 8])
    _feed(cb, trainer, slow=3.0)
    restored = StragglerMitigation(verbose=False, log=False)
    restored.load_state_dict(cb.state_dict())
    restored.setup(_FakeTrainer([10, 10, 2, 10]), None, "fit")  # type: ignore[arg-type]
    assert [d.state_dict() for d in restored.detectors] == [d.state_dict() for d in cb.detectors]
    assert restored.decisions == cb.decisions and restored.steps_seen == cb.steps_seen


# -- relative detection: a straggler is slower than the other ranks, not than its own past ---------------------
def _stream(cb: StragglerMitigation, trainer: _FakeTrainer, per_sample: list[list[float]],
            every: int = 2) -> list[int]:
    """Feed per_sample[r][s] window by window (as the telemetry exchange would, every ``every`` steps) with
    each rank's current share; the steps after which a decision was taken."""
    import lightning.pytorch as pl

    cb.setup(trainer, pl.LightningModule(), "fit")  # type: ignore[arg-type]
    steps = len(per_sample[0])
    decided = []
    for start in range(0, steps, every):
        cb.steps_seen = start + every
        shares = trainer.strategy.run.current_shares()
        window = _window([row[start: start + every] for row in per_sample], shares, first_step=start)
        before = len(cb.decisions)
        trainer.strategy.safe_step = start + every + 1  # one step already prefetched with the current shares
        cb.on_window(trainer, pl.LightningModule(), window, batch_idx=start + every - 1)  # type: ignore[arg-type]
        decided += [start + every] * (len(cb.decisions) - before)
    return decided


def _cluster(names: list[str]) -> dict:
    """local_cpu4_equal with its devices cut or renamed to ``names``."""
    raw = load_cluster("local_cpu4_equal").to_dict()
    devices = raw["nodes"][0]["devices"]
    raw["nodes"][0]["devices"] = [dict(devices[i % len(devices)], name=n) for i, n in enumerate(names)]
    return raw


def _busy_machine(steps: int, world: int, rng: random.Random) -> list[list[float]]:
    """Per-sample times on a shared, loaded host: each step a load factor common to all ranks (1x-3x, changing
    in bursts of 5-60 steps) times +-10% noise of each rank's own."""
    common, load = [], 1.0
    while len(common) < steps:
        load = rng.choice([1.0, 1.0, 1.5, 2.0, 3.0])
        common += [load] * rng.randint(5, 60)
    return [[0.01 * common[s] * (1 + 0.1 * (2 * rng.random() - 1)) for s in range(steps)] for _ in range(world)]


def test_a_load_that_slows_every_rank_alike_is_no_straggler() -> None:
    for seed in range(3):
        cb, trainer = StragglerMitigation(verbose=False, log=False), _FakeTrainer([8, 8, 8, 8])
        assert _stream(cb, trainer, _busy_machine(500, 4, random.Random(seed))) == []
        assert trainer.strategy.calls == []
    # the old rule (each rank against its own past) takes the same load for four stragglers
    det = ShiftDetector()
    assert [s for v in _busy_machine(500, 4, random.Random(0))[0] if (s := det.update(v)) is not None]


def test_a_step_change_of_every_rank_moves_the_levels_but_no_work() -> None:
    rng = random.Random(4)
    per_sample = [_noisy(40, 0.01, 0.05, rng) + _noisy(40, 0.02, 0.05, rng) for _ in range(3)]
    cb, trainer = StragglerMitigation(verbose=False, log=False), _FakeTrainer([8, 8, 8], _cluster(["a", "b", "c"]))
    assert _stream(cb, trainer, per_sample) == []
    assert all(lv.level == pytest.approx(0.02, rel=0.06) for lv in cb.levels)  # re-plans would price 20 ms


@pytest.mark.parametrize("seed", range(3))
def test_one_rank_three_times_slower_on_a_busy_machine_is_found_within_ten_steps(seed: int) -> None:
    rng = random.Random(seed)
    per_sample = _busy_machine(160, 4, rng)
    for s in range(100, 160):
        per_sample[2][s] *= 3.0
    cb, trainer = StragglerMitigation(verbose=False, log=False), _FakeTrainer([8, 8, 8, 8])
    decided = _stream(cb, trainer, per_sample)
    assert decided and decided[0] - 100 <= 10, decided
    d = cb.decisions[0]
    assert d.ranks == [2] and d.shares_after[2] < 8 and d.effective_step == d.step + 1
    ratio = float(re.search(r"-> ([0-9.]+)x the median rank", d.reason).group(1))
    assert 2.4 < ratio < 3.6, d.reason


def test_decisions_name_devices_as_the_cluster_does() -> None:
    raw = _cluster(["fast", "mid", "slow", "spare"])
    cb, trainer = StragglerMitigation(verbose=False, log=False), _FakeTrainer([8, 8, 8, 8], raw)
    _feed(cb, trainer, slow=3.0)
    (d,) = cb.decisions
    assert d.ranks == [2] and d.devices == ["slow"]
    assert d.reason.startswith("slow (rank2) per-sample compute 10.00 -> 30.00 ms (+200%), 1.00x -> 3.00x the "
                               "median rank for 4 consecutive steps")
    # the callback's state round-trips: decisions with their device names, both detector kinds
    saved = cb.state_dict()
    restored = StragglerMitigation(verbose=False, log=False)
    restored.load_state_dict(saved)
    restored.setup(_FakeTrainer([10, 10, 2, 10], raw), None, "fit")  # type: ignore[arg-type]
    assert restored.decisions[0].devices == ["slow"]
    assert [lv.state_dict() for lv in restored.levels] == saved["levels"]
    assert [det.state_dict() for det in restored.detectors] == saved["detectors"]


def test_steps_prefetched_with_the_old_shares_feed_no_detector() -> None:
    cb, trainer = StragglerMitigation(verbose=False, log=False), _FakeTrainer([8, 8, 8, 8])
    _feed(cb, trainer, slow=3.0)
    (d,) = cb.decisions
    assert d.effective_step == d.step + 1  # the fake's next safe step is one past this window
    history = [list(det.history) for det in cb.detectors]
    import lightning.pytorch as pl

    stale = _window([[0.01], [0.01], [0.03], [0.01]], [8] * 4, first_step=d.step)  # old shares, old speeds
    cb.on_window(trainer, pl.LightningModule(), stale, batch_idx=5)  # type: ignore[arg-type]
    assert [list(det.history) for det in cb.detectors] == history


def test_of_two_ranks_the_one_whose_seconds_moved_is_named() -> None:
    rng = random.Random(5)
    per_sample = [_noisy(60, 0.01, 0.05, rng), _noisy(30, 0.02, 0.05, rng) + _noisy(30, 0.06, 0.05, rng)]
    cb, trainer = StragglerMitigation(verbose=False, log=False), _FakeTrainer([8, 8], _cluster(["fast", "slow"]))
    decided = _stream(cb, trainer, per_sample)
    assert decided and decided[0] - 30 <= 10
    d = cb.decisions[0]
    assert d.ranks == [1] and d.devices == ["slow"] and d.shares_after[1] < d.shares_after[0]
    assert d.reason.startswith("slow (rank1) per-sample compute 20.")
