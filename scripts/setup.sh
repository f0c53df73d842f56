#!/usr/bin/env bash
# Creates .venv and installs het_strategy with everything it needs.
#   bash scripts/setup.sh          # runtime (plan + train) with every optional extra the main job uses
#   bash scripts/setup.sh --test   # plus the test tools and the docs tools (mkdocs build --strict in .ci/run)
#   bash scripts/setup.sh --bench  # plus what the benchmarks need (scikit-learn's digits)
# torch is installed first at the pinned CPU-capable release so that the
# bounded range in pyproject.toml is already satisfied and nothing pulls a
# multi-GB CUDA build.  On a GPU machine, install your CUDA torch first
# and set HET_TORCH_SPEC="" to keep it.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="pl,plot,wandb,deepspeed,hf"
[ "${1:-}" = "--test" ] && extras="pl,plot,wandb,deepspeed,hf,test,docs"
[ "${1:-}" = "--bench" ] && extras="pl,plot,wandb,deepspeed,hf,test,docs,bench"
python3 -m venv .venv
torch_spec="${HET_TORCH_SPEC-torch==2.13.0}"
[ -n "$torch_spec" ] && .venv/bin/python -m pip install -q "$torch_spec"
.venv/bin/python -m pip install -q -e ".[${extras}]"
