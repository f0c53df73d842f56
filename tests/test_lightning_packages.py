"""One written-out class per Lightning package, each a thin subclass of that package's base driven by one
package-neutral run: the two class modules say the same, no class is built at run time, the runs import no
Lightning, no private attribute of Lightning's is used, and every strategy of both packages trains 2 steps."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STRATEGY = ROOT / "het_strategy" / "strategy"
CLASS_MODULES = {"lightning.pytorch": STRATEGY / "lightning_classes.py",
                 "pytorch_lightning": STRATEGY / "pytorch_lightning_classes.py"}


def _normalised(path: Path, package: str, suffix: str) -> str:
    """The module's classes and the module's last statement, the package's names and the class suffix removed."""
    tree = ast.parse(path.read_text())
    kept = [node for node in tree.body if isinstance(node, (ast.ClassDef, ast.For))]
    text = "\n".join(ast.unparse(node) for node in kept)
    return re.sub(rf"\b(\w+){suffix}\b", r"\1", text) if suffix else text


def test_both_packages_classes_are_the_same_code_on_their_own_bases() -> None:
    lightning = _normalised(CLASS_MODULES["lightning.pytorch"], "lightning.pytorch", "")
    pl = _normalised(CLASS_MODULES["pytorch_lightning"], "pytorch_lightning", "PL")
    assert lightning == pl, "lightning_classes.py and pytorch_lightning_classes.py have drifted apart"
    for path, package in ((p, n) for n, p in CLASS_MODULES.items()):
        imports = [node for node in ast.parse(path.read_text()).body if isinstance(node, ast.ImportFrom)
                   and node.module and node.module.split(".")[0] in ("lightning", "pytorch_lightning")]
        assert imports and all(node.module.startswith(package) for node in imports), path.name


def test_no_class_is_built_at_run_time_in_the_strategy_folder() -> None:
    built = []
    for path in sorted(STRATEGY.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "type" \
                    and len(node.args) == 3:
                built.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "FunctionType":
                built.append(f"{path.name}:{node.lineno} (a copied function)")
    assert not built, built


def test_the_runs_import_no_lightning_package() -> None:
    """Everything in strategy/ but the two class modules is package-neutral (module or function level)."""
    wrong = []
    for path in sorted(STRATEGY.glob("*.py")):
        if path in CLASS_MODULES.values():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            wrong += [f"{path.name}:{node.lineno} {n}" for n in names
                      if n.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")]
    assert not wrong, wrong


def _lightning_private_names() -> set[str]:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DDPStrategy

    names: set[str] = set()
    for cls in (DDPStrategy, pl.Trainer, pl.LightningModule, pl.LightningDataModule, Precision, pl.Callback):
        names |= {k for k in dir(cls) if k.startswith("_") and not k.startswith("__")}
    names |= {k for k in vars(DDPStrategy()) if k.startswith("_") and not k.startswith("__")}
    names |= {k for k in vars(pl.LightningModule()) if k.startswith("_") and not k.startswith("__")}
    return names


def _our_files() -> list[Path]:
    return sorted([*(ROOT / "het_strategy").rglob("*.py"), *(ROOT / "callbacks").glob("*.py")])


def test_no_private_attribute_of_lightnings_is_used() -> None:
    """An attribute ``._x`` that Lightning's classes have and that our own code never defines, or a private name
    imported from a Lightning module, is Lightning's private API."""
    private = _lightning_private_names()
    ours: set[str] = set()
    trees = {path: ast.parse(path.read_text()) for path in _our_files()}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                ours.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                ours.add(node.id)
    used = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in private - ours:
                used.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
                    "lightning", "pytorch_lightning", "lightning_fabric"):
                parts = (node.module or "").split(".") + [a.name for a in node.names]
                used += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module}" for p in parts if p.startswith("_")]
    assert not used, used


_TWO_STEPS = textwrap.dedent('''
    import json, os, sys
    from datetime import timedelta
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    package = sys.argv[1]
    pl = __import__(package, fromlist=["Trainer"])
    import het_strategy
    suffix = "" if package == "lightning.pytorch" else "PL"
    torch.set_num_threads(1)

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)])
        def forward(self, x):
            return self.layers[1](torch.relu(self.layers[0](x)))
        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)
        def validation_step(self, batch, batch_idx):
            pass
        def pipeline_layers(self):
            return list(self.layers)
        def pipeline_loss(self, out, y):
            return torch.nn.functional.mse_loss(out, y)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
        def on_train_end(self):
            trainer = self.trainer
            if trainer.global_rank == 0:  # in the launched rank: the launching process keeps no step count
                with open("result.json", "w") as fh:
                    json.dump({"steps": trainer.global_step, "strategy": type(trainer.strategy).__name__,
                               "run": type(trainer.strategy.run).__name__,
                               "on_base": isinstance(trainer.strategy, pl.strategies.DDPStrategy)}, fh)

    def cluster(n, nodes):
        return {"name": f"c{n}", "inter_node_bandwidth_gbs": 1.0, "nodes": [
            {"name": f"n{k}", "devices": [{"name": f"d{k}_{i}", "type": "CPU"} for i in range(n // nodes)]}
            for k in range(nodes)]}

    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    common = dict(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  limit_val_batches=0)
    kw = dict(start_method="fork", verbose=False, telemetry=False, timeout=timedelta(seconds=120))
    strategies = {
        "hetero": (getattr(het_strategy, "HeteroStrategy" + suffix)(cluster=cluster(2, 1), **kw), 2, 4),
        "hetero_diloco": (getattr(het_strategy, "HeteroDiLoCoStrategy" + suffix)(
            cluster=cluster(2, 2), inner_steps=1, outer_codec="none", **kw), 2, 4),
        "hetero_deepspeed": (getattr(het_strategy, "HeteroDeepSpeedStrategy" + suffix)(
            cluster=cluster(1, 1), workload="tiny_gpt", global_batch_size=8, planner_mode="dp"), 1, 8),
    }
    only = sys.argv[2]
    strategy, devices, batch = strategies[only]
    if only == "hetero_deepspeed":
        from het_strategy.core.plan import Pipeline, Plan, Stage
        plan = Plan(cluster="c1", cluster_devices=("d0_0",), model={"num_layers": 2}, global_batch_size=8,
                    pipelines=(Pipeline((Stage(("d0_0",), (0, 2)),), 8, 8),), dtype="fp32", mode="manual")
        strategy = getattr(het_strategy, "HeteroDeepSpeedStrategy" + suffix)(cluster=cluster(1, 1), plan=plan)
    trainer = pl.Trainer(strategy=strategy, devices=devices, **common)
    trainer.fit(Net(), DataLoader(data, batch_size=batch, drop_last=True))
''')


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
@pytest.mark.parametrize("strategy, run", [("hetero", "HeteroRun"), ("hetero_diloco", "HeteroRun"),
                                           ("hetero_deepspeed", "DeepSpeedRun")])
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (Lightning's fork launcher)")
def test_each_strategy_of_each_package_trains_two_steps_on_its_one_run(package: str, strategy: str, run: str,
                                                                       tmp_path: Path, fresh_master_port) -> None:
    pytest.importorskip(package)
    if strategy == "hetero_deepspeed":
        pytest.importorskip("deepspeed")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", _TWO_STEPS, package, strategy], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    name = {"hetero": "HeteroStrategy", "hetero_diloco": "HeteroDiLoCoStrategy",
            "hetero_deepspeed": "HeteroDeepSpeedStrategy"}[strategy]
    assert result == {"steps": 2, "strategy": name + ("" if package == "lightning.pytorch" else "PL"),
                      "run": run, "on_base": True}
