"""``PreemptionCheckpoint``: SIGTERM mid-run leaves a loadable checkpoint of the next step boundary and exit code 0,
and the run resumes from it to the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

from het_strategy.core.errors import ConfigError  # noqa: E402

_RUN = textwrap.dedent('''
    import os, signal, sys
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import het_strategy
    from het_strategy.callbacks.preemption import PreemptionCheckpoint

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)
        def training_step(self, batch, batch_idx):
            if sys.argv[2] == "notice" and self.global_rank == 0 and self.global_step == 5:
                os.kill(os.getpid(), signal.SIGTERM)  # the platform's preemption notice
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cluster = {"name": "two", "nodes": [{"name": "local", "devices": [
        {"name": f"cpu{i}", "type": "CPU"} for i in range(2)]}]}
    data = TensorDataset(torch.randn(120, 8), torch.randn(120, 1))
    trainer = pl.Trainer(strategy=het_strategy.HeteroStrategy(cluster=cluster, verbose=False, telemetry=False),
                         accelerator="cpu", devices=2, max_steps=12, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[PreemptionCheckpoint(sys.argv[1], grace_s=30)])
    model = Net()
    trainer.fit(model, DataLoader(data, batch_size=6), ckpt_path=sys.argv[3] if len(sys.argv) > 3 else None)
    if trainer.global_rank == 0:
        torch.save({"global_step": trainer.global_step, "weight": model.layer.weight.detach()},
                   os.path.join(sys.argv[1], "final.pt"))
''')


_RUN_PIPELINE = textwrap.dedent('''
    import os, signal, sys
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader
    import _ds_elastic_worker as two
    import _ds_engine_worker as base
    import _ds_strategy_worker as worker
    from het_strategy.callbacks.preemption import PreemptionCheckpoint
    from het_strategy import HeteroDeepSpeedStrategy

    class Net(worker.pipe_model_class()):
        batches = 0
        def on_train_batch_start(self, batch, batch_idx):
            self.batches += 1
            if sys.argv[2] == "notice" and self.global_rank == 0 and self.trainer.global_step == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # the platform's preemption notice, to rank 0 alone
        def on_train_end(self):
            params = {n: p.detach().clone() for n, p in self.trainer.strategy.run.runner.named_parameters().items()}
            torch.save({"global_step": self.trainer.global_step, "batches": self.batches, "params": params},
                       os.path.join(sys.argv[1], f"final{self.global_rank}.pt"))

    torch.set_num_threads(1)
    strategy = HeteroDeepSpeedStrategy(cluster=two.CLUSTER, workload=two.workload(), global_batch_size=base.BATCH)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=5, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[PreemptionCheckpoint(sys.argv[1], grace_s=30)])
    trainer.fit(Net(), DataLoader(worker.dataset(), batch_size=base.BATCH),
                ckpt_path=sys.argv[3] if len(sys.argv) > 3 else None)
''')


def _run(tmp_path: Path, *args: str, script_text: str = _RUN) -> tuple[int, str]:
    from het_strategy.emulation.local_ranks import free_port

    script = tmp_path / "run.py"
    script.write_text(script_text)
    tests = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests), env.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ckpt"), *args], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, out


@pytest.mark.multiprocess
def test_sigterm_checkpoints_the_next_step_and_exits_cleanly_and_the_run_resumes(tmp_path: Path) -> None:
    code, out = _run(tmp_path, "notice")
    saved = tmp_path / "ckpt" / "preempted.ckpt"
    assert code == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert saved.is_file() and not saved.with_name("preempted.ckpt.tmp").exists()
    state = torch.load(saved, map_location="cpu", weights_only=True)  # data only
    assert state["global_step"] == 6  # the notice came during step 5; the checkpoint is after its update
    lines = [line for line in out.splitlines() if "SIGTERM: checkpoint of step 6" in line]
    assert len(lines) == 1 and "resume with fit(ckpt_path=" in lines[0], out[-3000:]
    assert not (tmp_path / "ckpt" / "final.pt").exists()  # it stopped there

    code, out = _run(tmp_path, "resume", str(saved))
    assert code == 0, out[-3000:]
    resumed = torch.load(tmp_path / "ckpt" / "final.pt", weights_only=True)
    code, out = _run(tmp_path, "straight")  # the same run without a notice
    assert code == 0, out[-3000:]
    straight = torch.load(tmp_path / "ckpt" / "final.pt", weights_only=True)
    assert resumed["global_step"] == straight["global_step"] == 12
    assert torch.allclose(resumed["weight"], straight["weight"], rtol=1e-6, atol=1e-7)  # the same samples, in order


@pytest.mark.multiprocess
def test_sigterm_to_one_pipeline_rank_leaves_a_complete_checkpoint_directory_that_resumes(tmp_path: Path) -> None:
    """hetero_deepspeed (a 2-stage pipeline on 2 ranks): a notice to rank 0 during step 1 makes every rank write its
    share of ``preempted.ckpt/`` after that step; the directory is renamed whole, with its ``complete`` file, and
    resuming it mid-epoch ends with the parameters of the run that was not stopped."""
    pytest.importorskip("deepspeed")
    from het_strategy.strategy.elastic import COMPLETE_MARKER

    code, out = _run(tmp_path, "notice", script_text=_RUN_PIPELINE)
    saved = tmp_path / "ckpt" / "preempted.ckpt"
    assert code == 0, out[-3000:]
    assert (saved / COMPLETE_MARKER).is_file() and not saved.with_name("preempted.ckpt.tmp").exists()
    assert "SIGTERM: checkpoint of step 2" in out and not (tmp_path / "ckpt" / "final0.pt").exists()
    finals = {}
    for run, extra in (("resumed", [str(saved)]), ("straight", [])):
        code, out = _run(tmp_path, "resume" if extra else "straight", *extra, script_text=_RUN_PIPELINE)
        assert code == 0, out[-3000:]
        finals[run] = [torch.load(tmp_path / "ckpt" / f"final{r}.pt", weights_only=True) for r in range(2)]
    for resumed, straight in zip(finals["resumed"], finals["straight"]):
        assert resumed["global_step"] == straight["global_step"] == 5
        assert (resumed["batches"], straight["batches"]) == (3, 5)  # the resumed run trained steps 2-4 only
        for name, value in straight["params"].items():
            assert torch.allclose(resumed["params"][name], value, rtol=1e-6, atol=1e-7), name


def test_bad_arguments_name_the_field(tmp_path: Path) -> None:
    from het_strategy.callbacks.preemption import PreemptionCheckpoint

    with pytest.raises(ConfigError, match="`grace_s` is 0"):
        PreemptionCheckpoint(tmp_path, grace_s=0)
    with pytest.raises(ConfigError, match="`filename`"):
        PreemptionCheckpoint(tmp_path, filename="a/b.ckpt")
    with pytest.raises(ConfigError, match="`exit_code` is 256; it must be a process exit code"):
        PreemptionCheckpoint(tmp_path, exit_code=256)
    with pytest.raises(ConfigError, match="`filename` is 'epoch_{epoch}.ckpt'; it must be a file name whose only"):
        PreemptionCheckpoint(tmp_path, filename="epoch_{epoch}.ckpt")
    # the step in the name: what an elastic restart's latest_checkpoint takes
    assert PreemptionCheckpoint(tmp_path, filename="step_{step}.ckpt").path(7) == tmp_path / "step_7.ckpt"
