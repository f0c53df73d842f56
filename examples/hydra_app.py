"""A Hydra app of your own: the Trainer's strategy and logger built with ``hydra.utils.instantiate``.

``examples/hydra_app_conf/config.yaml`` describes the cluster inline and gives
the strategy as ``_target_: het_strategy.HeteroStrategy`` (the cluster and the
global batch interpolated into it), the logger as Lightning's ``CSVLogger`` and
the Trainer itself as ``_target_`` nodes.  Two CPU processes play a fast device
and one at half its speed; a small MLP learns the 10-class image set of
examples/_digits.py, and the plan gives the fast rank twice the slow one's share.
Lightning's launcher re-runs this script for rank 1 with the same Hydra
overrides (and the same ``hydra.run.dir``).

Run (from the repository root)::

    .venv/bin/python examples/hydra_app.py
    .venv/bin/python examples/hydra_app.py trainer.max_steps=20 batch_size=24 hydra.run.dir=/tmp/hydra_app
    .venv/bin/python examples/hydra_app.py cluster=local_cpu2     # a shipped cluster by name
    .venv/bin/python examples/hydra_app.py logger=null --cfg job   # print the composed config and stop
"""

from __future__ import annotations

import hydra
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _digits import digits  # examples/_digits.py
import het_strategy  # noqa: F401  (registers "hetero"; _target_: het_strategy.HeteroStrategy resolves without it too)


class DigitsMLP(pl.LightningModule):
    def __init__(self, hidden: int, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@hydra.main(config_path="hydra_app_conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(cfg.seed, verbose=False)
    strategy = instantiate(cfg.strategy)  # HeteroStrategy(cluster=<the inline node>, global_batch_size=48)
    logger = instantiate(cfg.logger) if cfg.logger is not None else False
    trainer = instantiate(cfg.trainer, strategy=strategy, logger=logger)
    images, labels = digits()
    train, val = TensorDataset(images[:1500], labels[:1500]), TensorDataset(images[1500:], labels[1500:])
    # the loader's batch size is a placeholder: the strategy re-batches each rank to its planned share
    per_rank = cfg.batch_size // trainer.world_size
    model = DigitsMLP(hidden=cfg.model.hidden, lr=cfg.model.lr)
    trainer.fit(model, DataLoader(train, batch_size=per_rank, shuffle=True), DataLoader(val, batch_size=per_rank))
    result = trainer.validate(model, DataLoader(val, batch_size=per_rank), verbose=False)
    if trainer.global_rank == 0:
        where = f"; metrics in {logger.log_dir}" if logger else ""
        print(f"hydra app: {type(strategy).__name__} from _target_ on `{strategy.cluster.name}`; shares per rank "
              f"{strategy.run.current_shares()}; final validation accuracy {result[0]['val_acc']:.3f}{where}")


if __name__ == "__main__":
    main()
