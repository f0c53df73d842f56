"""One rank of the tensor-parallel runtime tests:
``python _tp_worker.py CASE OUT_DIR [CLIP [DTYPE [INF_RANK [ZERO]]]]``.

Trains ``STEPS`` steps of a small CharGPT (float64, or bf16 / fp16 with DTYPE; INF_RANK: that rank's gradient
gets an inf in step 2, ``-`` for none; ZERO: the plan's ZeRO stage, 0 by default) through ``PlanRunner`` on the whole
global batch, and writes ``OUT_DIR/rank{r}.json``: the losses, a final eval loss and this rank's parameters,
each compared with the matching part (``tensor_parallel.layers.shard_of``) of the single-process reference
that ``reference`` trains on the same batch (``CharGPT.forward``, torch's ``clip_grad_norm_``).
"""

from __future__ import annotations

import json
import os
import sys

STEPS = 3
BATCH = 7
SHAPE = dict(num_layers=2, hidden_size=16, num_heads=4, seq_len=8, vocab_size=64)
LR = 0.05


def plan(case: str, dtype: str = "fp32", zero_stage: int = 0):
    """The cases (layers: embedding, block0, block1, head):

    - ``tp2``: one replica, one stage at tp 2 (world 2), micro-batches 3 + 3 + 1;
    - ``mixed``: replica 0 one device at tp 1 (4 samples as 3 + 1), replica 1 one stage at tp 2
      (3 samples as 2 + 1): mixed tp across the replicas of a stage (world 3);
    - ``send``: one replica of a tp-2 stage [0, 2) sending to a tp-1 stage [2, 4) (world 3);
    - ``asym``: tp 1 everywhere, replica 0 one device (4 samples), replica 1 two stages (3 samples) (world 3).
    """
    from het_strategy.core.plan import Pipeline, Plan, Stage

    if case == "tp2":
        pipes = [Pipeline((Stage(("a", "b"), (0, 4)),), micro_batch_size=3, samples=BATCH)]
    elif case == "mixed":
        pipes = [Pipeline((Stage(("a",), (0, 4)),), micro_batch_size=3, samples=4),
                 Pipeline((Stage(("b", "c"), (0, 4)),), micro_batch_size=2, samples=3)]
    elif case == "asym":
        pipes = [Pipeline((Stage(("a",), (0, 4)),), micro_batch_size=3, samples=4),
                 Pipeline((Stage(("b",), (0, 2)), Stage(("c",), (2, 4))), micro_batch_size=2, samples=3)]
    elif case == "send":
        pipes = [Pipeline((Stage(("a", "b"), (0, 2)), Stage(("c",), (2, 4))), micro_batch_size=3, samples=BATCH)]
    else:
        raise SystemExit(f"unknown case {case}")
    devices = tuple(sorted({d for p in pipes for d in p.devices}))
    dtypes = PER_DEVICE_DTYPES.get(case, {}) if dtype == "per_device" else {}
    return Plan(cluster="local", cluster_devices=devices, model={"name": "char_gpt", "num_layers": 4},
                global_batch_size=BATCH, dtype=dtype, device_dtypes=dtypes, mode="manual", zero_stage=zero_stage,
                pipelines=tuple(pipes))


PER_DEVICE_DTYPES = {"mixed": {"a": "fp16", "b": "bf16", "c": "bf16"}, "send": {"a": "bf16", "b": "bf16", "c": "fp16"}}
"""A ``per_device`` run's dtypes: each tp group in one dtype, the replicas (``mixed``) or the two stages (``send``:
a bf16 tp-2 stage sending to an fp16 tp-1 one) in different ones."""


def model():
    import torch

    from het_strategy.demo.char_gpt import CharGPT

    torch.manual_seed(0)
    return CharGPT(**SHAPE).double()


def batch():
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, SHAPE["vocab_size"], (BATCH, SHAPE["seq_len"]), generator=g)
    y = torch.randint(0, SHAPE["vocab_size"], (BATCH, SHAPE["seq_len"]), generator=g)
    return x, y


def reference(clip: float):
    """Losses, final eval loss and parameters (by pipeline-layer name) of one process on the whole batch."""
    import torch

    from het_strategy.demo.char_gpt import CharGPT

    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    x, y = batch()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = CharGPT.pipeline_loss(m(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        final = float(CharGPT.pipeline_loss(m(x), y))
    named = {}
    for i, layer in enumerate(m.pipeline_layers()):
        for n, q in layer.named_parameters():
            named[f"{i}.{n}"] = q.detach().clone()
    return losses, final, named


def _state_numel(optimizer) -> int:
    """Elements of the optimizer's per-element state (AdamW's two moments)."""
    import torch

    return sum(v.numel() for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from het_strategy.demo.char_gpt import CharGPT
    from het_strategy.ds_runtime.engine import PlanRunner
    from het_strategy.tensor_parallel.layers import shard_of
    from het_strategy.tensor_parallel.tp_plan import tensor_parallel_plan_of

    case, out = sys.argv[1], sys.argv[2]
    clip = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    dtype = sys.argv[4] if len(sys.argv) > 4 else "fp32"
    inf_rank = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5] != "-" else None
    zero = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    if dtype in ("fp16", "per_device"):
        # DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16 kernels (most CPUs); the path under
        # test (loss scaling, overflow skips, the reduction) is the same on torch's CPU fp16 kernels
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True
    m = model() if dtype == "fp32" else model().float()
    layers = m.pipeline_layers()
    specs = {i: tensor_parallel_plan_of(layer).shard_specs() if tensor_parallel_plan_of(layer) else {}
             for i, layer in enumerate(layers)}
    runner = PlanRunner(plan(case, dtype, zero), layers, CharGPT.pipeline_loss,
                        lambda params: torch.optim.AdamW(params, lr=LR), gradient_clipping=clip, timeout_s=120)
    x, y = batch()
    poison = {"on": False}
    if runner.rank == inf_rank:  # an inf in this rank's gradient on step 2 only
        param = next(q for q in runner.module.parameters() if q.requires_grad)
        param.register_hook(lambda g: g * float("inf") if poison["on"] else g)
    losses = []
    for k in range(STEPS):
        poison["on"] = k == 1
        losses.append(runner.train_step(x, y))
    poison["on"] = False
    eval_loss = runner.eval_step(x, y)
    ref_losses, ref_final, ref_params = reference(clip)
    group = runner.layout.group_of(runner.rank)
    tp, tp_rank = len(group), group.index(runner.rank)
    worst = 0.0
    names = []
    for name, value in runner.named_parameters().items():
        layer, _, local = name.partition(".")
        spec = specs[int(layer)].get(local)
        want = ref_params[name]
        if spec is not None and tp > 1:
            want = shard_of(want, spec, tp, tp_rank)
        worst = max(worst, float((value.double() - want).abs().max()))
        names.append(name)
    # checkpoint round trip: a runner built from other weights loads this one's shards and optimizer state
    runner.save_checkpoint(os.path.join(out, "ckpt"), "t", {"step": STEPS})
    torch.manual_seed(7)
    other = CharGPT(**SHAPE).double() if dtype == "fp32" else CharGPT(**SHAPE)
    again = PlanRunner(plan(case, dtype, zero), other.pipeline_layers(), CharGPT.pipeline_loss,
                       lambda params: torch.optim.AdamW(params, lr=LR), gradient_clipping=clip, timeout_s=120)
    _, client = again.load_checkpoint(os.path.join(out, "ckpt"), "t")
    saved = runner.named_parameters()
    reloaded = max(float((q - saved[n]).abs().max()) for n, q in again.named_parameters().items())
    runner.train_step(x, y)
    again.train_step(x, y)  # the same update only if the optimizer state (AdamW's moments) came back too
    stepped = runner.named_parameters()
    after = max(float((q - stepped[n]).abs().max()) for n, q in again.named_parameters().items())
    result = {"rank": runner.rank, "losses": losses, "eval_loss": eval_loss, "ref_losses": ref_losses,
              "reload_max_diff": reloaded, "client_step": client["step"], "step_after_reload_max_diff": after,
              "ref_eval_loss": ref_final, "param_max_diff": worst, "names": names, "tp": tp,
              "micro_batch_sizes": list(runner.batch.micro_batch_sizes),
              "state_numel": _state_numel(runner.engine.optimizer),
              "param_numel": sum(q.numel() for q in runner.module.parameters()),
              "norm": runner.reducer.last_norm if runner.reducer is not None else None}
    with open(os.path.join(out, f"rank{runner.rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
