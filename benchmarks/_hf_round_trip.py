"""A Hugging Face model in and out of ``hetero_deepspeed``: started from a ``save_pretrained`` directory, trained,
saved back, reloaded by ``from_pretrained``.

A section of ``benchmarks/hf_models.py`` (``run()`` returns its RESULT keys); it also runs alone:
``python benchmarks/_hf_round_trip.py``.

``tests/_hf_checkpoint_worker.py`` on 2 gloo ranks: a tiny Llama (4 layers, hidden 32, GQA 4:2) written with
``save_pretrained`` is the LightningModule's model, built on the meta device (``hf.checkpoints.empty_causal_lm``);
``HeteroDeepSpeedStrategy(pretrained=dir)`` loads on each rank only the units its stage holds, and
``Trainer.fit`` trains ``STEPS`` AdamW steps in fp32, on two plans: a 2-stage pipeline (units [0, 3) and [3, 6))
and one tp-2 stage, each of whose ranks reads only its shards of the tensors the tp plan cuts (``get_slice``)
and the others whole; ``tp_whole``: the same tp-2 plan from the model loaded whole (``from_pretrained``, no
``pretrained=``), for comparison: the runtime splits it, each rank keeping the whole tensors its shards were cut
from.  The run's validation loss (``PlanRunner.eval_step`` on a held-out batch) is then compared
with that of the directory ``save_hf_checkpoint`` writes (gathered per layer to rank 0, tp shards joined),
reloaded by ``AutoModelForCausalLM.from_pretrained`` and run by transformers itself.  ``reload_diff``: the largest
|reloaded - run| of the pipeline over its ranks (the issue's bound: 1e-6); ``reload_diff_tp``: the same for the
tp-2 stage, whose sharded forward may round differently from one process's (its parameters reload bit for bit).
The pipeline's own per-layer checkpoint, converted without a run (``ds_runtime.layer_export``), is checked to be
the same model.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

STEPS = 4
CASES = ("pipe", "tp", "tp_whole")
_ENV = {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}


def _trained(out: Path) -> list[dict]:
    """The ranks' results of the worker's cases, run from a fresh source directory under ``out``."""
    import _hf_checkpoint_worker as worker

    from het_strategy.emulation.local_ranks import run_script_ranks

    worker.write_source(str(out / "source"))
    cmd = [sys.executable, str(ROOT / "tests" / "_hf_checkpoint_worker.py"), str(out / "source"), str(out),
           str(STEPS), ",".join(CASES)]
    codes = run_script_ranks(cmd, 2, out, 600, _ENV)
    if codes != [0, 0]:
        tails = "\n----\n".join((out / f"log{r}.txt").read_text()[-2500:] for r in range(2))
        raise RuntimeError(f"ranks exited {codes}:\n{tails}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _converted_equal(out: Path) -> bool:
    """The pipeline's per-layer checkpoint converted without a run equals the directory the run wrote."""
    import torch
    from transformers import AutoModelForCausalLM

    from het_strategy.ds_runtime.layer_export import layer_checkpoint_to_hf

    layer_checkpoint_to_hf(out / "pipe" / "ckpt", out / "source", out / "converted")
    saved = AutoModelForCausalLM.from_pretrained(out / "pipe" / "hf").state_dict()
    converted = AutoModelForCausalLM.from_pretrained(out / "converted").state_dict()
    return saved.keys() == converted.keys() and all(torch.equal(saved[k], converted[k]) for k in saved)


def _source_val(out: Path) -> float:
    """The validation loss of the directory the run started from (transformers' own forward)."""
    import _hf_checkpoint_worker as worker
    import torch
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return float(AutoModelForCausalLM.from_pretrained(out / "source")(**worker.val_batch()).loss)


def _loaded(r: dict) -> str:
    """One rank's load: its tensors (of them tp shards) and the KiB read (the whole-load row: the KiB it holds, its
    shards and the whole tensors they were cut from)."""
    shards = f", {r['shards']} shards" if r["shards"] else ""
    kib = (r["module_bytes"] + r["source_bytes"] if r["read"] is None else r["read"]) / 1024
    return f"{r['tensors']}{shards} ({kib:.0f})"


def run() -> dict[str, str]:
    """Print this section's table; return its RESULT keys."""
    print("Round trip through save_pretrained (benchmarks/_hf_round_trip.py)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        start = time.perf_counter()
        ranks = _trained(out)
        seconds = time.perf_counter() - start
        files = sorted(p.name for p in (out / "pipe" / "hf").iterdir())
        same, before = _converted_equal(out), _source_val(out)
    print(f"tiny Llama (4 layers, hidden 32, GQA 4:2), fp32, {STEPS} AdamW steps per plan, 2 gloo ranks "
          f"({seconds:.1f} s for the {len(CASES)} plans); validation loss of the source directory {before:.7f}:")
    total = sum(sum(r["pipe"]["held"].values()) for r in ranks)  # the stages hold the model once
    print(f"  {'plan':<22} {'tensors (KiB) loaded per rank, of 39 (' + f'{total / 1024:.0f}' + ')':<42} "
          f"{'train loss':<17} {'run val':>10} {'reloaded val':>13} {'|diff|':>8} {'params':>8}")
    diffs = {}
    for case, label in zip(CASES, ("2 stages [0,3) [3,6)", "1 stage at tp 2", "tp 2, from the whole")):
        r0 = ranks[0][case]
        held = " + ".join(_loaded(ranks[r][case]) for r in range(2))
        diffs[case] = max(abs(r[case]["reload_val"] - r[case]["run_val"]) for r in ranks)
        params = max(max(r[case]["param_diffs"].values()) for r in ranks)
        print(f"  {label:<22} {held:<42} {r0['losses'][0]:.4f} -> {r0['losses'][-1]:.4f} {r0['run_val']:>10.7f} "
              f"{r0['reload_val']:>13.7f} {diffs[case]:>8.1e} {params:>8.1e}")
    print("  (loaded: this rank's tensors, N of them tp shards, and the KiB it read from the directory; the whole-load "
          "row:\n  the KiB it holds, every tensor whole beside its shards)")
    print("  (params: the largest difference of a trained parameter, or tp shard, from the reloaded model's; the tp "
          "stage's\n  loss may differ by fp32 rounding: its sharded matmuls and all-reduce sum in another order "
          "than one process)")
    shards = [f for f in files if f.startswith("model-")]
    print(f"  written: {', '.join(f for f in files if f not in shards)} and {len(shards)} safetensors files (one per "
          f"unit: {shards[0]}, ...)")
    print(f"  pipeline's per-layer checkpoint converted without a run: {'equal' if same else 'DIFFERENT'} to the "
          "written directory")
    if not same:
        raise RuntimeError("the converted per-layer checkpoint differs from the directory the run wrote")
    return {"reload_diff": f"{diffs['pipe']:.1e}", "reload_diff_tp": f"{diffs['tp']:.1e}"}


if __name__ == "__main__":
    result = run()
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))
