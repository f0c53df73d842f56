"""What a hetero run shows in its loggers: the plan in the config, plan table and picture, bytes on the wire per
step, every straggler and compression decision as a table row, the summary file — read back from an offline wandb
run directory and a CSV logger's files; and the telemetry the strategy adds by itself (``telemetry=True``)."""

from __future__ import annotations

import csv
import dataclasses
import glob
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from het_strategy import HeteroStrategy  # noqa: E402
from het_strategy.compression.wire_count import WireBytes, counted_comm_hook  # noqa: E402
from het_strategy.core.cluster import load_cluster  # noqa: E402
from het_strategy.planning.strategy_plans import data_parallel_plan, estimate_workload  # noqa: E402
from het_strategy.report.run_record import PLAN_COLUMNS, decision_rows, plan_config, plan_rows  # noqa: E402

_FORK = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (Lightning's fork launcher)")
_IN = 32
_PARAMS = _IN * 64 + 64 + 64 + 1  # the probe net's parameters: one fp32 bucket


# -- pure parts: no process group ----------------------------------------------------------------------------------

def test_plan_config_and_rows_name_devices_shares_and_the_predicted_speedup() -> None:
    cluster = load_cluster("local_cpu2")  # emulated speeds 1 and 0.5
    workload = estimate_workload("probe", 100_000, 1, "fp32")
    plan = data_parallel_plan(cluster, workload, 24, "fp32")
    config = plan_config(plan, cluster, workload, emulated=True)
    shares = config["plan"]["shares"]
    assert sum(shares) == 24 and shares[0] > shares[1]  # the faster device gets more
    assert [d["name"] for d in config["devices"]] == ["rank0", "rank1"]
    assert [d["emulated_speed"] for d in config["devices"]] == [1.0, 0.5]
    predicted = config["predicted"]
    assert predicted["step_time_s"] > 0 and predicted["speedup_vs_equal"] > 1.05  # uneven beats even on 1 : 0.5
    assert predicted["equal_split_step_s"] == pytest.approx(predicted["step_time_s"] * predicted["speedup_vs_equal"])
    assert config["emulated"] is True and json.dumps(config)  # plain data, as loggers need it
    rows = plan_rows(plan, cluster, workload)
    assert [r[PLAN_COLUMNS.index("share")] for r in rows] == shares
    assert all(r[PLAN_COLUMNS.index("layers")] == f"[0,{workload.num_layers})" for r in rows)
    slowest = max(r[PLAN_COLUMNS.index("predicted_s")] for r in rows)
    assert slowest <= predicted["step_time_s"]


def test_decision_rows_take_dataclasses_with_extra_fields_and_mappings() -> None:
    from het_strategy.callbacks.straggler import Decision

    @dataclasses.dataclass
    class WithCause(Decision):  # a field a later version may add
        cause: str = ""

    first = ("step", "action", "reason")
    columns, rows = decision_rows([Decision(4, 6, "rebalance", [1], [8, 8], [11, 5], "rank1 slower", ["mid"]),
                                   WithCause(9, 9, "stop", [1], [11, 5], [11, 5], "far slower", ["mid"], "load")],
                                  first)
    assert columns[:3] == list(first) and columns[-1] == "cause" and "devices" in columns
    assert rows[0][:3] == [4, "rebalance", "rank1 slower"] and rows[0][-1] is None
    assert rows[0][columns.index("devices")] == '["mid"]'
    assert rows[1][columns.index("shares_after")] == "[11,5]" and rows[1][-1] == "load"
    columns, rows = decision_rows([{"step": 3, "layer": "w", "method": "q4"}])
    assert columns == ["step", "layer", "method"] and rows == [[3, "w", "q4"]]


class WandbLogger:
    """Stands in for Lightning's (recognised by its name): records what it is given."""

    def __init__(self, folder: Path) -> None:
        from types import SimpleNamespace

        self.calls: list[tuple[str, Any]] = []
        self.experiment = SimpleNamespace(dir=str(folder), save=lambda *a, **k: self.calls.append(("save", (a, k))))

    def log_table(self, **kwargs: Any) -> None:
        self.calls.append(("table", kwargs))

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.calls.append(("metrics", metrics))


def test_wandb_view_feeds_only_wandb_loggers_and_skips_the_picture_without_matplotlib(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from het_strategy.report.wandb_view import log_picture, log_table, save_file

    cluster = load_cluster("local_cpu2")
    plan = data_parallel_plan(cluster, estimate_workload("probe", 100_000, 1, "fp32"), 24, "fp32")
    wb, csv_like = WandbLogger(tmp_path), object()
    assert log_table([csv_like, wb], "t", ["a"], [[1]], step=3) and wb.calls == [("table", {
        "key": "t", "columns": ["a"], "data": [[1]], "step": 3})]
    assert not log_table([csv_like], "t", ["a"], [[1]]) and log_picture([csv_like], "p", plan, cluster) is None
    (tmp_path / "summary.json").write_text("{}")
    assert save_file([wb], tmp_path / "summary.json")
    assert wb.calls[-1][1][1] == {"base_path": str(tmp_path), "policy": "now"}
    path = log_picture([wb], "p", plan, cluster)
    assert path == tmp_path / "plan.png" and path.read_bytes()[:4] == b"\x89PNG"
    assert wb.calls[-1][0] == "metrics" and type(wb.calls[-1][1]["p"]).__name__ == "Image"
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if not installed
    het_logger = logging.getLogger("het_strategy")
    level = het_logger.level
    het_logger.setLevel(logging.DEBUG)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    het_logger.addHandler(handler)
    try:
        before = len(wb.calls)
        assert log_picture([wb], "p", plan, cluster) is None and len(wb.calls) == before
    finally:
        het_logger.removeHandler(handler)
        het_logger.setLevel(level)
    assert seen == ["matplotlib is not installed: the plan picture is not logged"]


class _Group:
    def __init__(self, world: int) -> None:
        self.world = world

    def size(self) -> int:
        return self.world


class _Bucket:
    def __init__(self, numel: int, dtype: torch.dtype = torch.float32) -> None:
        self._buffer = torch.zeros(numel, dtype=dtype)

    def buffer(self) -> torch.Tensor:
        return self._buffer


def test_counted_hook_counts_raw_ring_bytes_and_what_the_hook_says_it_sent() -> None:
    class State:
        process_group = _Group(4)
        bytes_sent = 0

    def compressing(state, bucket):  # type: ignore[no-untyped-def]
        state.bytes_sent += 777
        return "future"

    wire = WireBytes()
    hook = counted_comm_hook(compressing, wire)
    assert hook(State(), _Bucket(1000)) == "future"
    assert hook(State(), _Bucket(10, torch.float16)) == "future"
    # a ring allreduce sends 2 (W-1)/W of the bucket per rank: 2 x 3/4 x 4000 B, then 2 x 3/4 x 20 B
    assert wire.reading() == (6000 + 30, 2 * 777)

    class Opaque:  # a user's hook whose state does not count bytes: wire bytes unknown from then on
        process_group = _Group(2)

    counted_comm_hook(lambda s, b: None, wire)(Opaque(), _Bucket(100))
    assert wire.reading() == (6030 + 400, None)


class _Runtime:
    """Stands in for the hetero strategy (``HeteroRuntime``) in ``attach_callbacks``."""

    cluster = plan = current_local_samples = None
    records: list = []
    global_rank = 0

    def __init__(self, compressing: bool) -> None:
        self.compression_state = object() if compressing else None

    def current_shares(self) -> list[int]:
        return [1, 1]

    def next_safe_step(self) -> int:
        return 0

    def apply_plan(self, plan: Any, first_step: int) -> None:
        pass


class _Trainer:
    def __init__(self, callbacks: list[Any], loggers: list[Any], compressing: bool = True) -> None:
        from types import SimpleNamespace

        self.callbacks, self.loggers = list(callbacks), loggers
        self.strategy = SimpleNamespace(run=_Runtime(compressing))
        self.state = SimpleNamespace(fn="fit")
        self.lightning_module, self.world_size = None, 2


def test_the_strategy_adds_each_telemetry_callback_once_and_sets_it_up() -> None:
    from het_strategy.callbacks.compression import CompressionMonitor
    from het_strategy.callbacks.run_report import RunReport
    from het_strategy.callbacks.straggler import StragglerMitigation
    from het_strategy.callbacks.telemetry import StepTelemetry
    from het_strategy.callbacks.attach import attach_callbacks

    def added(trainer: _Trainer, telemetry: bool = True, rebalance: Any = None) -> list[type]:
        return [type(c) for c in attach_callbacks(trainer.strategy.run, trainer, 0, rebalance, telemetry, None)]

    trainer = _Trainer([], ["a logger"])
    assert added(trainer) == [RunReport, StepTelemetry, CompressionMonitor]
    assert trainer.callbacks[1].runtime is trainer.strategy.run  # its setup ran (Lightning's had already)
    assert added(trainer) == []  # a second setup (validate after fit) adds nothing
    present = [StragglerMitigation(verbose=False), CompressionMonitor()]  # what het-train brings
    assert added(_Trainer(present, ["a logger"])) == [RunReport]
    assert added(_Trainer([], ["a logger"], compressing=False)) == [RunReport, StepTelemetry]
    assert added(_Trainer([], ["a logger"]), telemetry=False) == []
    assert added(_Trainer([], [])) == []  # no logger: nothing to log to
    rebalance = StragglerMitigation(verbose=False)
    assert added(_Trainer([], []), telemetry=False, rebalance=rebalance) == [StragglerMitigation]
    resumed = _Trainer([], ["a logger"], compressing=False)
    attach_callbacks(resumed.strategy.run, resumed, 0, None, True,
                     {StepTelemetry().state_key: {"steps_seen": 7, "rows": [[0.0] * 6]}})
    telemetry = resumed.callbacks[1]
    assert telemetry.steps_seen == 7 and len(telemetry._rows[0]) == 9  # old rows padded for the new fields


# -- real runs: 2 gloo ranks ---------------------------------------------------------------------------------------

class _Probe(pl.LightningModule):
    """A regression net with one compressible layer (64 x 32 weights)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(_IN, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return (self.net(x).squeeze(-1) - y).pow(2).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _FinishWandb(pl.Callback):
    """Finish the wandb run on rank 0 at the end of fit: forked ranks exit without running wandb's atexit hook,
    which is what writes the rest of an offline run in a normal script."""

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            import wandb

            wandb.finish()


def _loader(n: int = 256) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, _IN, generator=g), torch.randn(n, generator=g)), batch_size=8)


def _trainer(root: Path, strategy: HeteroStrategy, loggers: list[Any], callbacks: list[Any], steps: int
             ) -> pl.Trainer:
    torch.set_num_threads(1)
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=loggers, callbacks=callbacks,
                      max_steps=steps, default_root_dir=str(root), enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                      log_every_n_steps=1)


def _csv_rows(root: Path) -> tuple[list[str], list[dict[str, str]]]:
    paths = glob.glob(str(root / "csv" / "**" / "metrics.csv"), recursive=True)
    if not paths:  # nothing was logged at all
        return [], []
    (path,) = paths
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _column(rows: list[dict[str, str]], name: str) -> list[float]:
    return [float(r[name]) for r in rows if r.get(name)]


def _wandb_records(run_dir: Path) -> list[Any]:
    """The records of an offline run's ``.wandb`` file (LevelDB-log blocks of protobuf ``Record`` s)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data, out, pos, buf = path.read_bytes(), [], 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
        elif kind == 0 and length == 0:
            break
    return out


def _latest_table(files: Path, key: str) -> dict[str, Any]:
    paths = sorted(files.glob(f"media/table/{key}_*.table.json"), key=lambda p: int(p.name.split("_")[-2]))
    assert paths, f"no table {key} in {sorted(str(p) for p in files.rglob('*.json'))}"
    return json.loads(paths[-1].read_text())


@pytest.mark.multiprocess
@pytest.mark.usefixtures("fresh_master_port")
@_FORK
def test_an_offline_wandb_run_shows_the_plan_bytes_and_every_decision(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    from het_strategy.callbacks.straggler import StragglerMitigation
    from het_strategy.callbacks.throughput import ThroughputMonitor

    os.environ.setdefault("WANDB_SILENT", "true")
    # rank1 plays a device half as fast, three times slower again from step 6: the straggler callback rebalances
    cluster = {"name": "two_emulated", "inter_node_bandwidth_gbs": 1,
               "slowdowns": [{"device": "slow", "factor": 3.0, "start_step": 6}],
               "nodes": [{"name": "local", "intra_bandwidth_gbs": 1, "devices": [
                   {"name": "fast", "type": "CPU", "tflops": {"fp32": 5e-6}, "efficiency": 1.0, "emulated_speed": 1.0},
                   {"name": "slow", "type": "CPU", "tflops": {"fp32": 5e-6}, "efficiency": 1.0,
                    "emulated_speed": 0.5}]}]}
    # a declared 1 Mbit/s link: the adaptive controller compresses the 64 x 32 layer from its first solve
    compression = {"method": "adaptive", "warmup_steps": 2, "resolve_every": 4, "link_mbit": 1.0, "verbose": False}
    strategy = HeteroStrategy(cluster=cluster, compression=compression, start_method="fork", verbose=False,
                              timeout=__import__("datetime").timedelta(seconds=120))
    straggler = StragglerMitigation(every_n_steps=2, warmup=2, consecutive=2, window=8, threshold=0.5, verbose=False)
    summary = tmp_path / "summary.json"
    loggers = [WandbLogger(project="het", save_dir=str(tmp_path), mode="offline"),
               CSVLogger(save_dir=str(tmp_path), name="csv")]
    callbacks = [straggler, ThroughputMonitor(warmup_steps=1, summary_path=summary, verbose=False), _FinishWandb()]
    _trainer(tmp_path, strategy, loggers, callbacks, steps=14).fit(_Probe(), _loader())

    (run_dir,) = [Path(p) for p in glob.glob(str(tmp_path / "wandb" / "offline-run-*"))]
    files = run_dir / "files"
    plan = _latest_table(files, "hetero/plan")
    assert plan["columns"] == list(PLAN_COLUMNS)
    (fast, slow) = plan["data"]
    share = PLAN_COLUMNS.index("share")
    assert fast[:3] == [0, "fast", "CPU"] and slow[:3] == [1, "slow", "CPU"]
    assert fast[share] + slow[share] == 16 and fast[share] > slow[share]
    (picture,) = files.glob("media/images/hetero/plan_picture_*.png")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # at the end: the measured split beside the predicted one, in wandb and beside the CSV logger's files
    (steps,) = files.glob("media/images/hetero/step_times_*.png")
    assert steps.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "csv" / "version_0" / "step_times.png").is_file()

    decisions = _latest_table(files, "straggler/decisions")
    row = dict(zip(decisions["columns"], decisions["data"][0]))
    assert row["action"] == "rebalance" and json.loads(row["ranks"]) == [1] and "rank1" in row["reason"]
    assert json.loads(row["shares_before"]) == [fast[share], slow[share]]
    after = json.loads(row["shares_after"])
    assert sum(after) == 16 and after[1] < slow[share]  # the slowed rank gets less
    chosen = _latest_table(files, "compression/decisions")
    rows = [dict(zip(chosen["columns"], r)) for r in chosen["data"]]
    (layer,) = {r["layer"] for r in rows}
    assert layer.endswith("net.0.weight") and rows[0]["method"].startswith("q")  # the only eligible layer
    assert "link 1 Mbit/s" in rows[0]["reason"] and "uncompressed" in rows[0]["reason"]

    saved = files / "summary.json"  # wandb.save: linked into the run's files, uploaded by `wandb sync`
    assert json.loads(saved.read_text()) == json.loads(summary.read_text())
    assert json.loads(summary.read_text())["samples_per_s"] > 0

    records = _wandb_records(run_dir)
    config = {u.key: json.loads(u.value_json) for r in records if r.WhichOneof("record_type") == "config"
              for u in r.config.update}
    assert config["hetero"]["plan"]["shares"] == [fast[share], slow[share]]
    assert config["hetero"]["predicted"]["speedup_vs_equal"] > 1.0
    assert config["hetero"]["compression"]["method"] == "adaptive"
    logged = {u.nested_key[0] if u.nested_key else u.key for r in records
              if r.WhichOneof("record_type") == "history" for u in r.history.item}
    assert {"telemetry/rank1/wire_bytes", "telemetry/rank0/compute_s", "straggler/decisions",
            "compression/wire_ratio", "throughput/samples_per_s"} <= logged

    header, csv_rows = _csv_rows(tmp_path)
    for r in range(2):
        assert {f"telemetry/rank{r}/{f}" for f in ("compute_s", "comm_s", "data_s", "share", "raw_bytes",
                                                   "wire_bytes")} <= set(header)
    raw, wire = _column(csv_rows, "telemetry/rank0/raw_bytes"), _column(csv_rows, "telemetry/rank0/wire_bytes")
    assert len(raw) == 14 and set(raw) == {4 * _PARAMS}  # 2 ranks: a ring allreduce sends 2 x 1/2 of the bucket
    assert wire[:2] == raw[:2] and min(wire[3:]) < 0.5 * raw[0]  # warm-up plain, then q-bits for 2048 weights
    assert "straggler/decisions" in header and "plan/speedup_vs_equal" in header
    hparams = (next((tmp_path / "csv").rglob("hparams.yaml"))).read_text()
    assert "hetero:" in hparams and "shares:" in hparams and "speedup_vs_equal" in hparams


@pytest.mark.multiprocess
@pytest.mark.usefixtures("fresh_master_port")
@_FORK
@pytest.mark.parametrize("telemetry", [True, False])
def test_the_strategy_alone_brings_telemetry_unless_told_not_to(tmp_path: Path, telemetry: bool) -> None:
    from lightning.pytorch.loggers import CSVLogger

    strategy = HeteroStrategy(cluster="local_cpu2", start_method="fork", verbose=False, telemetry=telemetry,
                              timeout=__import__("datetime").timedelta(seconds=120))
    _trainer(tmp_path, strategy, [CSVLogger(save_dir=str(tmp_path), name="csv")], [], steps=4).fit(_Probe(),
                                                                                                 _loader(64))
    header, rows = _csv_rows(tmp_path)
    hparams = "\n".join(p.read_text() for p in (tmp_path / "csv").rglob("hparams.yaml"))
    telemetry_columns = {c for c in header if c.startswith(("telemetry/", "plan/"))}
    if not telemetry:
        assert not telemetry_columns and "hetero" not in hparams
        return
    assert {"telemetry/rank0/compute_s", "telemetry/rank1/data_s", "telemetry/rank1/wire_bytes",
            "plan/step_time_s"} <= telemetry_columns
    raw, wire = _column(rows, "telemetry/rank1/raw_bytes"), _column(rows, "telemetry/rank1/wire_bytes")
    assert raw == wire == [4.0 * _PARAMS] * 4  # uncompressed allreduce: every byte counted goes on the wire
    assert all(not math.isnan(v) and v > 0 for v in _column(rows, "telemetry/rank0/compute_s"))
    assert "hetero:" in hparams and "local_cpu2" in hparams
