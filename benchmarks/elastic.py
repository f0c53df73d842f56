"""Devices that die and join under torchrun, and a pipeline checkpoint re-sharded into another plan.

Part 1, ``hetero`` under torchrun's elastic agent.  Four agents (one process each, c10d rendezvous on
localhost, ``--nnodes=3:4``), each naming its device of ``local_cpu4_mixed`` (emulated speeds 1, 1, 0.5, 0.25)
in ``HET_STRATEGY_DEVICE``, train the char GPT (4 blocks, hidden 128, sequence 32, float64, SGD with momentum) on 400
sequences of the standard library's source (25 global batches of 16 per epoch) with asynchronous checkpoints
every 10 steps, resuming from the newest one at every (re)start.  When step 35 begins the driver kills device
rank3's agent and worker (SIGKILL): the survivors detect it (heartbeat bound 5 s), torchrun restarts them as
three, the strategy re-plans for the devices present and goes on from the step-30 checkpoint.  When the three
reach step 60 the driver starts a new agent for rank3: it joins the running group, torchrun's agents restart the
group as four (each agent stops its worker with SIGTERM: ``PreemptionCheckpoint`` saves ``step_N.ckpt`` at the
next step boundary and exits 143, so that every agent restarts), and the plan for four devices goes on from that checkpoint to step 100.  The agents run with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (``strategy/elastic.check_agent_store`` says why).  Rank 0 of every
worker group broadcasts a token; every worker logs it with each step's sample ids, and the *trajectory* is each
step as the last group that trained it.  Measured: samples of each epoch the trajectory misses or repeats
(``lost_samples``, ``duplicated_samples``), steps trained twice (``steps_redone``: work lost at the kill and at
the join), ``detect_s`` (kill to the survivors' exit, from the agents' logs), ``recover_s`` (kill to the first
step of the group of three), ``rejoin_s`` (rank3's new agent started to the first step of the group of four), the
final parameters against one process training the trajectory's global batches in float64 (``final_max_diff``, the
largest absolute difference; the module is built in float64: Lightning restores a checkpoint into the module
before ``precision="64-true"`` converts it, so a float32-built module would take the checkpoint through float32 on
every resume, about 7e-8 here), and ``async_stall_ratio`` (the stall of an asynchronous checkpoint over a
synchronous one, ``checkpoint_stall.py``'s measurement).

Part 2, ``hetero_deepspeed``.  The char GPT (4 blocks, hidden 128) as 2 pipelines x 2 stages on 4 ranks trains
5 steps and checkpoints; the checkpoint loads into another shape, a whole-model replica beside a 2-stage
pipeline split elsewhere (3 ranks), which trains 5 more; ``reshard_max_diff`` is the largest parameter
difference to the original plan trained 10 steps without stopping (fp32, DeepSpeed's CPU grid).

Emulated compute checks the schedule and the bookkeeping, not a GPU's speed; the kill is a real SIGKILL and the
rendezvous, restarts and gloo collectives are real.
Last line: ``RESULT lost_samples=... duplicated_samples=... steps_redone=... detect_s=... recover_s=...
rejoin_s=... worlds=4-3-4 final_max_diff=... async_stall_ratio=... reshard_max_diff=...``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL = dict(num_layers=4, hidden_size=128, num_heads=4, seq_len=32)
SAMPLES, BATCH, EVERY = 400, 16, 10
DEVICES = ("rank0", "rank1", "rank2", "rank3")


# -- part 1: the worker one agent runs ------------------------------------------------------------------------------
def _worker(out: str, max_steps: int) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from torch.utils.data import DataLoader, Dataset

    from het_strategy import HeteroStrategy
    from het_strategy.callbacks.preemption import PreemptionCheckpoint
    from het_strategy.core.shipped import config_file
    from het_strategy.demo.char_gpt import CharGPT
    from het_strategy.demo.stdlib_text import CharDataset, stdlib_corpus
    from het_strategy.strategy.elastic import latest_checkpoint

    class Numbered(Dataset):
        def __init__(self) -> None:
            self.data = CharDataset(stdlib_corpus(max_bytes=400_000).train, MODEL["seq_len"])

        def __len__(self) -> int:
            return SAMPLES

        def __getitem__(self, i: int) -> Any:
            x, y = self.data[i]
            return x, y, i

    class Logged(CharGPT):
        group = ""

        def on_train_start(self) -> None:
            self.group = self.trainer.strategy.broadcast(f"{os.getpid()}-{time.time()}")

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y, ids = batch
            loss = super().training_step((x, y), batch_idx)
            counted = self.trainer.strategy.current_local_samples
            row = {"t": time.time(), "group": self.group, "step": self.trainer.global_step,
                   "epoch": self.current_epoch, "world": self.trainer.world_size,
                   "device": os.environ["HET_STRATEGY_DEVICE"], "ids": ids.tolist()[:counted]}
            with open(Path(out) / "steps.jsonl", "a") as fh:
                fh.write(json.dumps(row) + "\n")
            return loss

        def configure_optimizers(self) -> Any:
            return _optimizer(self)

        def on_train_end(self) -> None:
            if self.global_rank == 0:
                params = {n: p.detach().flatten().tolist() for n, p in self.named_parameters()}
                (Path(out) / "final.json").write_text(json.dumps(params))

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = Logged(**MODEL).double()  # Lightning restores a checkpoint before it converts the module to 64-bit
    strategy = HeteroStrategy(cluster=config_file("cluster", "local_cpu4_mixed"), global_batch_size=BATCH,
                              verbose=False, heartbeat_timeout_s=5, timeout=datetime.timedelta(seconds=60))
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                         precision="64-true", max_steps=max_steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, plugins=[AsyncCheckpointIO()],
                         callbacks=[ModelCheckpoint(dirpath=str(Path(out) / "ckpt"), filename="step_{step}",
                                                    auto_insert_metric_name=False, every_n_train_steps=EVERY,
                                                    save_top_k=-1),
                                    PreemptionCheckpoint(Path(out) / "ckpt", "step_{step}.ckpt", exit_code=143)])
    resume = latest_checkpoint(Path(out) / "ckpt")
    trainer.fit(model, DataLoader(Numbered(), batch_size=4, shuffle=True),
                ckpt_path=None if resume is None else str(resume))


def _optimizer(model: Any) -> Any:
    """SGD with momentum: Adam would turn the last bit of a near-zero gradient (one sum order against another)
    into a whole step, and the comparison with one process would measure that, not the bookkeeping."""
    import torch

    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# -- part 1: the driver ------------------------------------------------------------------------------------------
def _agent(out: Path, device: str, port: int, max_steps: int) -> subprocess.Popen:
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "HET_STRATEGY_DEVICE": device,
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=3:4", "--nproc-per-node=1", "--max-restarts=5",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-bench",
           "--rdzv-conf=join_timeout=120,last_call_timeout=5,close_timeout=10,keep_alive_interval=1,"
           "keep_alive_max_attempt=3", "--monitor-interval=0.5", __file__, "--worker", str(out), str(max_steps)]
    log = open(out / f"agent-{device}-{time.time():.0f}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _kill_with_children(pid: int) -> None:
    """SIGKILL an agent and every process below it (its worker and the worker's own children)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, doomed = [pid], []
    while todo:
        p = todo.pop()
        doomed.append(p)
        todo += children.get(p, [])
    for p in doomed:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _rows(out: Path) -> list[dict]:
    path = out / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for_step(out: Path, step: int, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if any(r["step"] >= step for r in _rows(out)):
            return
        time.sleep(0.1)
    raise SystemExit(f"no worker reached step {step} in {timeout_s:.0f} s (logs in {out})")


_FAILED = re.compile(r"^E\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*failed \(exitcode")


def _first_failure_after(out: Path, killed_at: float) -> float | None:
    """The earliest 'failed (exitcode ...)' an agent logged after ``killed_at`` (its workers' exit)."""
    day = datetime.datetime.fromtimestamp(killed_at).date()
    times = []
    for log in out.glob("agent-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = _FAILED.match(line)
            if m:
                t = datetime.datetime.combine(day, datetime.time(int(m.group(1)), int(m.group(2)))).timestamp() \
                    + float(m.group(3))
                if t >= killed_at:
                    times.append(t)
    return min(times) if times else None


def _run(out: Path, max_steps: int, kill_step: int, rejoin_step: int) -> tuple[float, float]:
    """Start one agent per device; kill rank3's agent and worker when step ``kill_step`` begins, start a new agent
    for it when step ``rejoin_step`` begins, and wait for the job.  Returns the kill's and the new agent's times."""
    from het_strategy.emulation.local_ranks import free_port

    port = free_port()
    agents = {}
    for device in DEVICES:  # the first agent hosts the rendezvous store
        agents[device] = _agent(out, device, port, max_steps)
        time.sleep(0.5)
    try:
        _wait_for_step(out, kill_step, 600)
        _kill_with_children(agents.pop("rank3").pid)
        killed_at = time.time()
        _wait_for_step(out, rejoin_step, 600)
        agents["rank3"] = _agent(out, "rank3", port, max_steps)
        joined_at = time.time()
        for device, proc in agents.items():
            if proc.wait(timeout=900) != 0:
                raise SystemExit(f"agent {device} exited {proc.returncode} (logs in {out})")
    finally:
        for proc in agents.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return killed_at, joined_at


def elastic_part(out: Path, max_steps: int, kill_step: int, rejoin_step: int) -> dict[str, Any]:
    killed_at, joined_at = _run(out, max_steps, kill_step, rejoin_step)
    rows = _rows(out)
    order = {g: i for i, g in enumerate(dict.fromkeys(r["group"] for r in rows))}  # groups run one after another
    trajectory: dict[int, dict[str, Any]] = {}
    for r in rows:
        have = trajectory.get(r["step"])
        run = order[r["group"]]
        if have is None or run > have["run"]:
            trajectory[r["step"]] = {"run": run, "epoch": r["epoch"], "world": r["world"], "ids": list(r["ids"]),
                                     "t": r["t"]}
        elif run == have["run"]:
            have["ids"] += r["ids"]
    if sorted(trajectory) != list(range(max_steps)):
        raise SystemExit(f"the trajectory has steps {sorted(trajectory)}, not 0..{max_steps - 1}")
    redone = sum(1 for r in rows if order[r["group"]] < trajectory[r["step"]]["run"] and r["device"] == "rank0")
    lost = duplicated = 0
    per_epoch = SAMPLES // BATCH
    for epoch in sorted({s["epoch"] for s in trajectory.values()}):
        ids = [i for s in trajectory.values() if s["epoch"] == epoch for i in s["ids"]]
        duplicated += len(ids) - len(set(ids))
        complete = sum(1 for s in trajectory.values() if s["epoch"] == epoch) == per_epoch
        lost += (SAMPLES - len(set(ids))) if complete else 0
    first_step_of = {order[r["group"]]: (r["t"], r["world"]) for r in reversed(rows)}
    recover_s = min(t for t, world in first_step_of.values() if t > killed_at and world == 3) - killed_at
    rejoin_s = min(t for t, world in first_step_of.values() if t > joined_at and world == 4) - joined_at
    failed_at = _first_failure_after(out, killed_at)
    spans: list[list[int]] = []  # [first step, last step, world] of each run of one world size
    for step in sorted(trajectory):
        world = trajectory[step]["world"]
        if spans and spans[-1][2] == world:
            spans[-1][1] = step
        else:
            spans.append([step, step, world])
    print("  ranks by step: " + ", ".join(f"steps {a}-{b}: {w}" for a, b, w in spans))
    worlds = [w for *_, w in spans]
    final_max_diff = _reference_diff(out, trajectory, max_steps)
    return {"lost_samples": lost, "duplicated_samples": duplicated, "steps_redone": redone,
            "detect_s": (failed_at - killed_at) if failed_at else float("nan"), "recover_s": recover_s,
            "rejoin_s": rejoin_s,
            "final_max_diff": final_max_diff, "worlds": worlds}


def _reference_diff(out: Path, trajectory: dict[int, dict[str, Any]], max_steps: int) -> float:
    """One process, float64: the trajectory's global batches in order; the largest parameter difference."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    from het_strategy.demo.char_gpt import CharGPT
    from het_strategy.demo.stdlib_text import CharDataset, stdlib_corpus

    torch.set_num_threads(2)
    pl.seed_everything(0, verbose=False)
    model = CharGPT(**MODEL).double()
    opt = _optimizer(model)
    data = CharDataset(stdlib_corpus(max_bytes=400_000).train, MODEL["seq_len"])
    for step in range(max_steps):
        ids = trajectory[step]["ids"]
        x = torch.stack([data[i][0] for i in ids])
        y = torch.stack([data[i][1] for i in ids])
        opt.zero_grad()
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        opt.step()
    final = json.loads((out / "final.json").read_text())
    return max(max(abs(a - b) for a, b in zip(final[n], p.detach().flatten().tolist()))
               for n, p in model.named_parameters())


# -- part 2: hetero_deepspeed re-sharded ---------------------------------------------------------------------------
def _ds_worker(spec_path: str) -> None:
    import torch

    from het_strategy.core.plan import Plan
    from het_strategy.core.workload import TransformerConfig
    from het_strategy.demo.char_gpt import CharGPT
    from het_strategy.demo.stdlib_text import CharDataset, stdlib_corpus
    from het_strategy.ds_runtime.engine import PlanRunner
    from het_strategy.strategy.deepspeed_checkpoint import load_plan_checkpoint, save_plan_checkpoint

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    plan = Plan.from_dict(spec["plan"])
    torch.manual_seed(0)
    model = CharGPT.from_workload_config(TransformerConfig(name="char_gpt", **spec["model"]))
    runner = PlanRunner(plan, model.pipeline_layers(), CharGPT.pipeline_loss,
                        lambda params: torch.optim.AdamW(params, lr=3e-3), timeout_s=300)
    data = CharDataset(stdlib_corpus(max_bytes=400_000).train, spec["model"]["seq_len"])
    batch = plan.global_batch_size
    if spec.get("load"):
        load_plan_checkpoint(runner, plan, spec["load"])
    for step in range(spec["first"], spec["first"] + spec["steps"]):
        xs, ys = zip(*(data[i] for i in range(step * batch, (step + 1) * batch)))
        runner.train_step(torch.stack(xs), torch.stack(ys))
    if spec.get("save"):
        save_plan_checkpoint(runner, plan, {"step": spec["first"] + spec["steps"]}, spec["save"])
    params = {n: p.detach().flatten().tolist() for n, p in runner.named_parameters().items()}
    (Path(spec["out"]) / f"params{runner.rank}.json").write_text(json.dumps(params))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _ds_run(plan: Any, model: dict, first: int, steps: int, tmp: Path, name: str, **io: str) -> dict[str, list]:
    from het_strategy.emulation.local_ranks import run_script_ranks

    out = tmp / name
    out.mkdir()
    spec = {"plan": plan.to_dict(), "model": model, "first": first, "steps": steps, "out": str(out), **io}
    (out / "spec.json").write_text(json.dumps(spec))
    env = {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    world = len(plan.used_devices)
    codes = run_script_ranks([sys.executable, __file__, "--ds-worker", str(out / "spec.json")], world, out, 900, env)
    if codes != [0] * world:
        tails = "\n----\n".join((out / f"log{r}.txt").read_text()[-2500:] for r in range(world))
        raise SystemExit(f"{name}: ranks exited {codes}:\n{tails}")
    merged: dict[str, list] = {}
    for r in range(world):
        merged.update(json.loads((out / f"params{r}.json").read_text()))
    return merged


def reshard_part(tmp: Path) -> float:
    from het_strategy.core.plan import Pipeline, Plan, Stage

    model = {"num_layers": 4, "hidden_size": 128, "num_heads": 4, "seq_len": 64, "vocab_size": 256}
    layers = model["num_layers"] + 2

    def plan(pipes: tuple[Pipeline, ...], devices: tuple[str, ...]) -> Plan:
        return Plan(cluster="local", cluster_devices=devices, model={"name": "char_gpt", "num_layers": layers},
                    global_batch_size=16, pipelines=pipes, dtype="fp32", mode="manual")

    def pipe(devs: tuple[str, ...], bounds: tuple[int, ...], samples: int) -> Pipeline:
        return Pipeline(tuple(Stage((d,), (a, b)) for d, a, b in zip(devs, bounds, bounds[1:])), 4, samples)

    aligned = plan((pipe(("c0", "c2"), (0, 3, layers), 8), pipe(("c1", "c3"), (0, 3, layers), 8)),
                   ("c0", "c1", "c2", "c3"))
    other = plan((pipe(("c0",), (0, layers), 8), pipe(("c1", "c2"), (0, 2, layers), 8)), ("c0", "c1", "c2"))
    ckpt = tmp / "ds_ckpt"
    whole = _ds_run(aligned, model, 0, 10, tmp, "uninterrupted")
    _ds_run(aligned, model, 0, 5, tmp, "first", save=str(ckpt))
    resumed = _ds_run(other, model, 5, 5, tmp, "resharded", load=str(ckpt))
    print(f"  2 x 2 stages at [0, 3, {layers}) on 4 ranks, 5 steps -> a whole replica + 2 stages at [0, 2, {layers})"
          f" on 3 ranks, 5 more; against the 2 x 2 plan's 10 steps")
    return max(max(abs(a - b) for a, b in zip(resumed[n], whole[n])) for n in whole)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--kill-step", type=int, default=35)
    ap.add_argument("--rejoin-step", type=int, default=60, help="rank3's new agent starts when this step begins")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import checkpoint_stall

    with tempfile.TemporaryDirectory(prefix="het_elastic_") as tmp:
        out = Path(tmp) / "hetero"
        out.mkdir()
        print(f"part 1: char GPT {MODEL}, 4 agents on local_cpu4_mixed, {args.steps} steps of {BATCH}, "
              f"async checkpoints every {EVERY}; rank3 killed at step {args.kill_step}, a new agent for it at step "
              f"{args.rejoin_step}")
        res = elastic_part(out, args.steps, args.kill_step, args.rejoin_step)
        print(f"  lost {res['lost_samples']} duplicated {res['duplicated_samples']} samples; {res['steps_redone']} "
              f"steps trained again; detected in {res['detect_s']:.1f} s, first step of the restart "
              f"{res['recover_s']:.1f} s after the kill; the group of four's first step {res['rejoin_s']:.1f} s after "
              f"rank3's new agent started; final parameters vs one process: {res['final_max_diff']:.2e}")
        sync_s, base_s, _ = checkpoint_stall.stall(checkpoint_stall.run("sync", 30, 10), 10)
        async_s, base_a, _ = checkpoint_stall.stall(checkpoint_stall.run("async", 30, 10), 10)
        ratio = (async_s - base_a) / (sync_s - base_s)
        print(f"  checkpoint stall (checkpoint_stall.py, 230 MB): sync {sync_s - base_s:.3f} s, async "
              f"{async_s - base_a:.3f} s ({ratio:.1%})")
        print("part 2: hetero_deepspeed checkpoint re-sharded into another plan")
        reshard = reshard_part(Path(tmp))
        print(f"  largest parameter difference: {reshard:.2e}")
    print(f"RESULT lost_samples={res['lost_samples']} duplicated_samples={res['duplicated_samples']} "
          f"steps_redone={res['steps_redone']} detect_s={res['detect_s']:.1f} recover_s={res['recover_s']:.1f} "
          f"rejoin_s={res['rejoin_s']:.1f} worlds={'-'.join(map(str, res['worlds']))} "
          f"final_max_diff={res['final_max_diff']:.2e} async_stall_ratio={ratio:.3f} reshard_max_diff={reshard:.2e}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--ds-worker":
        _ds_worker(sys.argv[2])
    else:
        main()
