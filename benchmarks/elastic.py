"""Devices that die and join under torchrun, for ``hetero`` and ``hetero_deepspeed``, and a pipeline checkpoint
re-sharded into another plan.

Parts 1 and 2 run one job each under torchrun's elastic agent (the workers: ``_elastic_workers.py``).  Four agents
(one process each, c10d rendezvous on localhost, ``--nnodes=3:4``), each naming its device in
``HET_STRATEGY_DEVICE``, train the char GPT (4 blocks, hidden 128, sequence 32, SGD with momentum) on 400
distinct sequences of the standard library's source (25 global batches of 16 per epoch) with a checkpoint every
10 steps, resuming from the newest one at every (re)start.  When step 35 begins the driver kills device rank3's
agent and worker (SIGKILL): the survivors detect it (heartbeat bound 5 s), torchrun restarts them as three, the
strategy re-plans for the devices present and goes on from the step-30 checkpoint.  When the three reach step 60
the driver starts a new agent for rank3: it joins the running group, torchrun's agents restart the group as four
(each agent stops its worker with SIGTERM: ``PreemptionCheckpoint`` saves ``step_N.ckpt`` at the next step
boundary and exits 143, so that every agent restarts), and the plan for four devices goes on from that checkpoint
to step 100.  The agents run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (``strategy/elastic.check_agent_store``
says why).  Rank 0 of every worker group broadcasts a token; the workers log it with each step's sample ids, and
the *trajectory* is each step as the last group that trained it.

- Part 1, ``hetero`` on ``local_cpu4_mixed`` (emulated speeds 1, 1, 0.5, 0.25), float64, asynchronous
  checkpoints (Lightning's ``AsyncCheckpointIO``).
- Part 2, ``hetero_deepspeed`` on four 20 MB CPU devices that cannot hold the model alone: two 2-stage pipelines
  on four devices, one 3-stage pipeline on three (the strategy plans at every restart), fp32, DeepSpeed's
  checkpoint directories (synchronous), each restart loading the newest one layer by layer into its plan.

Measured for each: samples of each epoch the trajectory misses or repeats (``lost_samples``,
``duplicated_samples``), steps trained twice (``steps_redone``: work lost at the kill and at the join),
``detect_s`` (kill to the survivors' exit, from the agents' logs), ``recover_s`` (kill to the first step of the
group of three), ``rejoin_s`` (rank3's new agent started to the first step of the group of four), and the final
parameters against one process training the trajectory's global batches in float64: ``final_max_diff``, the
largest absolute difference (``hetero``: its module is built in float64, as Lightning restores a checkpoint into
the module before ``precision="64-true"`` converts it), and for the fp32 pipeline ``ds_final_rel_diff``, the
largest difference relative to its tensor's largest value, beside what one fp32 process gets by that measure
(``ds_fp32_floor``: the part fp32 rounding explains).  ``async_stall_ratio`` is the stall of an asynchronous
checkpoint over a synchronous one (``checkpoint_stall.py``'s measurement, the mean of 12 saves).

Part 3, ``hetero_deepspeed`` re-sharding alone.  2 pipelines x 2 stages on 4 ranks train 5 steps and checkpoint;
the checkpoint loads into another shape, a whole-model replica beside a 2-stage pipeline split elsewhere (3
ranks), which trains 5 more; ``reshard_max_diff`` is the largest parameter difference to the original plan trained
10 steps without stopping (fp32, DeepSpeed's CPU grid).

Emulated compute checks the schedule and the bookkeeping, not a GPU's speed; the kills are real SIGKILLs and the
rendezvous, restarts and gloo collectives are real.
Last line: ``RESULT lost_samples=... duplicated_samples=... steps_redone=... detect_s=... recover_s=...
rejoin_s=... worlds=4-3-4 final_max_diff=... async_stall_ratio=... ds_lost_samples=... ds_duplicated_samples=...
ds_steps_redone=... ds_detect_s=... ds_recover_s=... ds_rejoin_s=... ds_worlds=4-3-4 ds_final_rel_diff=...
ds_fp32_floor=... reshard_max_diff=...``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _elastic_workers import BATCH, EVERY, MODEL, SAMPLES, optimizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).with_name("_elastic_workers.py")
DEVICES = ("rank0", "rank1", "rank2", "rank3")


# -- parts 1 and 2: the driver---------------------------------------------------------------------------------------
def _agent(out: Path, kind: str, device: str, port: int, max_steps: int) -> subprocess.Popen:
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "HET_STRATEGY_DEVICE": device,
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=3:4", "--nproc-per-node=1", "--max-restarts=5",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=elastic-{kind}",
           "--rdzv-conf=join_timeout=120,last_call_timeout=5,close_timeout=10,keep_alive_interval=1,"
           "keep_alive_max_attempt=3", "--monitor-interval=0.5", str(WORKERS), kind, str(out), str(max_steps)]
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


def _run(out: Path, kind: str, max_steps: int, kill_step: int, rejoin_step: int) -> tuple[float, float]:
    """Start one agent per device; kill rank3's agent and worker when step ``kill_step`` begins, start a new agent
    for it when step ``rejoin_step`` begins, and wait for the job.  Returns the kill's and the new agent's times."""
    from het_strategy.emulation.local_ranks import free_port

    port = free_port()
    agents = {}
    for device in DEVICES:  # the first agent hosts the rendezvous store
        agents[device] = _agent(out, kind, device, port, max_steps)
        time.sleep(0.5)
    try:
        _wait_for_step(out, kill_step, 600)
        _kill_with_children(agents.pop("rank3").pid)
        killed_at = time.time()
        _wait_for_step(out, rejoin_step, 600)
        agents["rank3"] = _agent(out, kind, "rank3", port, max_steps)
        joined_at = time.time()
        for device, proc in agents.items():
            if proc.wait(timeout=900) != 0:
                raise SystemExit(f"agent {device} exited {proc.returncode} (logs in {out})")
    finally:
        for proc in agents.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return killed_at, joined_at


def elastic_part(out: Path, kind: str, max_steps: int, kill_step: int, rejoin_step: int) -> dict[str, Any]:
    """Run ``kind``'s job with the kill and the join; what the steps' log says about it."""
    killed_at, joined_at = _run(out, kind, max_steps, kill_step, rejoin_step)
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
    redone = len({(r["group"], r["step"]) for r in rows if order[r["group"]] < trajectory[r["step"]]["run"]})
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
    final_max_diff, fp32_floor = _reference_diff(out, kind, trajectory, max_steps)
    return {"lost_samples": lost, "duplicated_samples": duplicated, "steps_redone": redone,
            "detect_s": (failed_at - killed_at) if failed_at else float("nan"), "recover_s": recover_s,
            "rejoin_s": rejoin_s,
            "final_max_diff": final_max_diff, "fp32_floor": fp32_floor, "worlds": worlds}


def _one_process(trajectory: dict[int, dict[str, Any]], max_steps: int, dtype: Any) -> Any:
    """The char GPT trained by one process in ``dtype`` on the trajectory's global batches, in order."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    from _elastic_workers import corpus_dataset
    from het_strategy.demo.char_gpt import CharGPT

    torch.set_num_threads(2)
    pl.seed_everything(0, verbose=False)
    model = CharGPT(**MODEL).to(dtype)
    opt = optimizer(model.parameters())
    data = corpus_dataset()
    for step in range(max_steps):
        ids = trajectory[step]["ids"]
        x = torch.stack([data[i][0] for i in ids])
        y = torch.stack([data[i][1] for i in ids])
        opt.zero_grad()
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        opt.step()
    return model


def _reference_diff(out: Path, kind: str, trajectory: dict[int, dict[str, Any]], max_steps: int
                    ) -> tuple[float, float | None]:
    """The final parameters against one process in float64: the largest absolute difference (``hetero``), or
    the largest difference relative to its tensor's largest value (the fp32 ``hetero_deepspeed``), with what
    one fp32 process gets by the same measure (the floor fp32 rounding sets)."""
    import torch

    reference = _one_process(trajectory, max_steps, torch.float64)
    if kind == "hetero":
        final = json.loads((out / "final.json").read_text())
        return max(max(abs(a - b) for a, b in zip(final[n], p.detach().flatten().tolist()))
                   for n, p in reference.named_parameters()), None

    def by_layer(model: Any) -> dict[str, Any]:  # "<layer>.<name in the layer>", as the pipeline's ranks name them
        return {f"{i}.{n}": p.detach().double().flatten() for i, layer in enumerate(model.pipeline_layers())
                for n, p in layer.named_parameters()}

    def relative(values: dict[str, Any], want: dict[str, Any]) -> float:
        return max(((values[n] - p).abs().max() / p.abs().max()).item() for n, p in want.items())

    final: dict[str, Any] = {}
    for part in out.glob("final*.json"):  # each rank's stage
        final.update({n: torch.tensor(v, dtype=torch.float64) for n, v in json.loads(part.read_text()).items()})
    want = by_layer(reference)
    if set(final) != set(want):
        raise SystemExit(f"the ranks' parameters {sorted(final)[:4]}... are not the model's {sorted(want)[:4]}")
    return relative(final, want), relative(by_layer(_one_process(trajectory, max_steps, torch.float32)), want)


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


def _report(res: dict[str, Any]) -> None:
    print(f"  lost {res['lost_samples']} duplicated {res['duplicated_samples']} samples; {res['steps_redone']} "
          f"steps trained again; detected in {res['detect_s']:.1f} s, first step of the restart "
          f"{res['recover_s']:.1f} s after the kill; the group of four's first step {res['rejoin_s']:.1f} s after "
          f"rank3's new agent started; final parameters vs one process in float64: {res['final_max_diff']:.2e}"
          + ("" if res["fp32_floor"] is None else f" relative (one fp32 process: {res['fp32_floor']:.2e})"))


def _plans(out: Path) -> str:
    """The plan of each worker group of the hetero_deepspeed job, from its rank 0's log."""
    rows = [json.loads(line) for line in (out / "plans.jsonl").read_text().splitlines() if line.strip()]
    return "; ".join(f"from step {r['step']} on {r['world']}: {r['plan']}" for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--kill-step", type=int, default=35)
    ap.add_argument("--rejoin-step", type=int, default=60, help="rank3's new agent starts when this step begins")
    args = ap.parse_args()
    import checkpoint_stall

    with tempfile.TemporaryDirectory(prefix="het_elastic_") as tmp:
        res: dict[str, dict[str, Any]] = {}
        for kind, what in (("hetero", "local_cpu4_mixed, float64, async checkpoints"),
                           ("hetero_deepspeed", "four 20 MB CPU devices, fp32, DeepSpeed checkpoint directories")):
            out = Path(tmp) / kind
            out.mkdir()
            print(f"part {len(res) + 1}: {kind}, char GPT {MODEL}, 4 agents on {what}, {args.steps} steps of "
                  f"{BATCH}, checkpoints every {EVERY}; rank3 killed at step {args.kill_step}, a new agent for it at "
                  f"step {args.rejoin_step}")
            res[kind] = elastic_part(out, kind, args.steps, args.kill_step, args.rejoin_step)
            if kind == "hetero_deepspeed":
                print(f"  plans: {_plans(out)}")
            _report(res[kind])
        sync_s, _, saves = checkpoint_stall.stall(checkpoint_stall.run("sync", 60, 5), 5)
        async_s, _, _ = checkpoint_stall.stall(checkpoint_stall.run("async", 60, 5), 5)
        ratio = async_s / sync_s
        print(f"  checkpoint stall (checkpoint_stall.py, 230 MB, mean of {saves} saves): sync {sync_s:.3f} s, "
              f"async {async_s:.3f} s ({ratio:.1%})")
        print("part 3: hetero_deepspeed checkpoint re-sharded into another plan, against that plan uninterrupted")
        reshard = reshard_part(Path(tmp))
        print(f"  largest parameter difference: {reshard:.2e}")
    h, d = res["hetero"], res["hetero_deepspeed"]
    print(f"RESULT lost_samples={h['lost_samples']} duplicated_samples={h['duplicated_samples']} "
          f"steps_redone={h['steps_redone']} detect_s={h['detect_s']:.1f} recover_s={h['recover_s']:.1f} "
          f"rejoin_s={h['rejoin_s']:.1f} worlds={'-'.join(map(str, h['worlds']))} "
          f"final_max_diff={h['final_max_diff']:.2e} async_stall_ratio={ratio:.3f} "
          f"ds_lost_samples={d['lost_samples']} ds_duplicated_samples={d['duplicated_samples']} "
          f"ds_steps_redone={d['steps_redone']} ds_detect_s={d['detect_s']:.1f} ds_recover_s={d['recover_s']:.1f} "
          f"ds_rejoin_s={d['rejoin_s']:.1f} ds_worlds={'-'.join(map(str, d['worlds']))} "
          f"ds_final_rel_diff={d['final_max_diff']:.2e} ds_fp32_floor={d['fp32_floor']:.2e} "
          f"reshard_max_diff={reshard:.2e}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--ds-worker":
        _ds_worker(sys.argv[2])
    else:
        main()
