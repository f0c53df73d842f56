#!/usr/bin/env bash
# The wheel is the product (DESIGN.md): build the sdist and the wheel, check their metadata, install the
# wheel into a fresh venv outside the checkout, and from a folder with no checkout import het_strategy,
# plan a shipped cluster, train 2 steps and run an example.  About a minute and a half on 2 cores.
#   bash scripts/setup.sh --test && bash scripts/check_wheel.sh     # build and twine come with the test extra
# The fresh venv gets torch first, at HET_TORCH_SPEC (default torch==2.13.0, the CPU build), and the same
# spec is a constraint on the wheel's install, so no other torch (a multi-GB CUDA build) can come in.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
py="$repo/.venv/bin/python"
torch_spec="${HET_TORCH_SPEC:-torch==2.13.0}"
work="$(mktemp -d "${TMPDIR:-/tmp}/het_check_wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
trap 'echo "check_wheel: FAILED (line $LINENO: $BASH_COMMAND); the wheel or sdist is broken, see above" >&2' ERR
fail() { echo "check_wheel: FAILED: $*" >&2; exit 1; }
say() { echo "check_wheel [${SECONDS}s]: $*"; }
[ -x "$py" ] || fail "$py not found; run bash scripts/setup.sh --test first"

# 1. The sdist, and the wheel built from it (python -m build's default: a file the sdist lacks fails here).
#    Built from a copy of the files git sees (tracked and new, not ignored), so nothing ignored gets in and the
#    build's *.egg-info (whose version would shadow the installed metadata) is not left in the checkout.
#    Isolated, as pip builds for a user: the build runs on pyproject's build-system, not on .venv.
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
    | tar --null -T - -cf - | tar -xf - -C "$work/src"
"$py" -m build --outdir "$work/dist" "$work/src" >"$work/build.log" 2>&1 \
    || { tail -40 "$work/build.log"; fail "python -m build"; }
sdist=("$work"/dist/*.tar.gz) wheel=("$work"/dist/*.whl)
[ ${#sdist[@]} = 1 ] && [ ${#wheel[@]} = 1 ] || fail "expected one sdist and one wheel in $work/dist"
say "built $(basename "${sdist[0]}") and $(basename "${wheel[0]}")"
"$py" -m twine check --strict "${sdist[0]}" "${wheel[0]}"

# 2. A fresh venv outside the repository: torch first (pinned), then the wheel with the Lightning extras.
"$py" -m venv "$work/venv"
v="$work/venv/bin/python"
"$v" -m pip install -q "$torch_spec"
echo "$torch_spec" >"$work/constraints.txt"
"$v" -m pip install -q -c "$work/constraints.txt" "${wheel[0]}[pl]"
if "$v" -m pip list 2>/dev/null | grep -iE '^nvidia-'; then fail "CUDA packages came into the fresh venv"; fi
say "installed into $work/venv"

# 3. From a folder with no checkout, and nothing of the repository on sys.path.
run="$work/run"
mkdir "$run" && cd "$run"
unset PYTHONPATH
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore WANDB_MODE=disabled
bin="$work/venv/bin"
"$v" - <<'EOF' || fail "import het_strategy failed in the fresh venv, or loaded it from elsewhere"
import importlib.metadata, sys, sysconfig
import het_strategy
site = sysconfig.get_paths()["purelib"]
print(f"het_strategy {importlib.metadata.version('het_strategy')} (__version__ {het_strategy.__version__}) from "
      f"{het_strategy.__file__}")
sys.exit(0 if het_strategy.__file__.startswith(site) else f"het_strategy came from outside {site}")
EOF
"$bin/het-plan" --help >/dev/null
"$bin/het-plan" cluster=amp_v100_t4 model=gpt2_amp settings.global_batch_size=32 settings.dtype=fp16 \
    output.dir="$run/plan" >"$run/plan.log" 2>&1 || { tail -30 "$run/plan.log"; fail "het-plan of amp_v100_t4"; }
[ -s "$run/plan/plan.json" ] || fail "het-plan wrote no plan.json"
say "het-plan: $(grep -m1 -iE 'step' "$run/plan.log" || echo 'plan written')"
"$bin/het-train" experiment=smoke train.max_steps=2 train.val_every_n_steps=2 output.dir="$run/train" \
    >"$run/train.log" 2>&1 || { tail -40 "$run/train.log"; fail "het-train experiment=smoke, 2 steps"; }
[ -s "$run/train/summary.json" ] || { tail -20 "$run/train.log"; fail "het-train wrote no summary.json"; }
say "het-train: 2 steps, $run/train/summary.json written"
# an example as a user copies it: the script and the examples' helpers (_digits.py, ...) only
cp "$repo"/examples/_*.py "$repo/examples/plain_ddp_compression.py" "$run/"
"$v" plain_ddp_compression.py --steps 30 >"$run/example.log" 2>&1 || { tail -30 "$run/example.log"; fail "examples/plain_ddp_compression.py"; }
grep -q "held-out accuracy" "$run/example.log" || { cat "$run/example.log"; fail "the example printed no accuracy"; }
say "example: $(grep -m1 "held-out accuracy" "$run/example.log")"
say "the wheel installs, imports, plans and trains outside the checkout"
