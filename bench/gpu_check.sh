#!/usr/bin/env bash
# One-command GPU check: correctness and speed of ndtrain's kernels and training
# on one H100 / H200 class GPU, in under 8 minutes, after only scripts/setup.sh on a fresh machine.
#
#   bench/gpu_check.sh OUTDIR          # on the GPU machine
#   bench/gpu_check.sh OUTDIR --cpu    # every stage tiny on CPU: proves the script runs end to end
#
# Stages (each under its own `timeout`, limits summing to 8 min on a GPU; a failed or timed-out stage
# is recorded (rc 124) and the rest run):
#   1 gpu_ops      pytest -m gpu tests/ops: every Triton kernel against its PyTorch twin, big bf16 shapes
#   2 kernel_speed bench/kernel_speed.py: FlashAttention vs SDPA, RMSNorm / SwiGLU vs eager, fused
#                  linear+CE vs eager: forward+backward time and peak memory
#   3 matmul/roof  bench/matmul_sweep.py (256..16384) and bench/roofline.py (Triton kernels)
#   4 mfu_1b       `ndtrain train` of a ~1.2B Llama (dim 2048, 16 layers, 32 heads / 8 kv, ffn 8192,
#                  vocab 128256 tied, T 2048, 16 sequences a step, bf16) three ways: kernels=eager,
#                  training.compile=true, kernels=triton; MFU / HFU / tokens/s of steps 7..12
#   5 zero_fsdp2   bench/zero_vs_fsdp2.py: ndtrain ZeRO-3 vs FSDP2 step time. It runs gloo ranks on
#                  the CPU (2 ranks; one GPU cannot host two NCCL ranks): a framework-overhead number
# OUTDIR gets at most 8 files: summary.json (every stage: rc, seconds, and the MFU table),
# gpu_check.log, pytest_gpu_ops.xml (JUnit: each test's outcome), kernel_speed.json, matmul_sweep.json, roofline.json,
# mfu_1b.json, zero_vs_fsdp2.json. Run directories, caches and plots go to a scratch folder
# ($NDTRAIN_GPU_CHECK_WORK, default a mktemp folder). Exit status: 0 when every stage passed.
set -uo pipefail
{  # parsed whole before it runs: editing this file during a run cannot change the run
cd "$(dirname "$0")/.."
OUT=${1:?usage: bench/gpu_check.sh OUTDIR [--cpu]}
MODE=${2:-gpu}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=${NDTRAIN_GPU_CHECK_WORK:-$(mktemp -d -t ndtrain_gpu_check.XXXXXX)}
mkdir -p "$WORK"
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONUNBUFFERED=1 NDTRAIN_CACHE="$WORK/cache"
LOG="$OUT/gpu_check.log"
STAGES="$WORK/stages.tsv"
: >"$LOG"
: >"$STAGES"

say() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

stage() {  # stage NAME TIMEOUT_S CMD...: run, log, record rc and seconds
  local name=$1 limit=$(($2 * LIMIT_MULT)); shift 2
  say "stage $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$STAGES"
  say "stage $name: rc=$rc in $((SECONDS - t0))s"
}

if [ "$MODE" = "--cpu" ]; then
  say "CPU mode: every stage tiny (a smoke test of this script; numbers meaningless)"
  export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # no thread oversubscription
  MODEL=(--config debug --data.source=stdlib --data.tokenizer=bytes --data.max_corpus_bytes=200000
         --model.vocab_size=512 --training.steps=3 --training.global_batch_size=4 --training.micro_batch_size=2
         --logging.log_every=1)
  KS=(--size tiny --repeats 1); MM=(--sizes 256 --dtypes float32); RL=(--scale tiny --repeats 1)
  ZF=(--nproc 2 --config debug --steps 1 --warmup 1)
  LIMIT_MULT=4  # a shared 2-core CPU: interpreted Triton, inductor's C++ compile
else
  command -v nvidia-smi >/dev/null && nvidia-smi >>"$LOG" 2>&1
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { say "no CUDA device visible to torch ($PY); use --cpu for the CPU smoke test"; exit 2; }
  MODEL=(--config default --data.source=stdlib --data.tokenizer=bytes --data.max_corpus_bytes=4000000
         --model.vocab_size=128256 --model.dim=2048 --model.n_layers=16 --model.n_heads=32
         --model.n_kv_heads=8 --model.ffn_hidden=8192 --model.max_seq_len=2048 --model.rope_theta=500000
         --data.seq_len=2048 --training.dtype=bfloat16 --training.global_batch_size=16
         --training.micro_batch_size=4 --training.steps=12 --training.warmup_steps=2 --logging.log_every=6)
  KS=(--repeats 5); MM=(); RL=(); ZF=(--nproc 2 --config default --steps 4 --warmup 1)
  LIMIT_MULT=1
fi
COMMON=(--training.eval_every=0 --training.eval_batches=1 --training.sample_tokens=1 --checkpoint.every=0
        --logging.plot=false --logging.progress=plain "--data.cache_dir=$WORK/data")

stage gpu_ops 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/ops -o addopts="" \
  --junitxml="$OUT/pytest_gpu_ops.xml"
stage kernel_speed 50 "$PY" bench/kernel_speed.py "${KS[@]}" --out "$OUT/kernel_speed.json"
stage matmul_sweep 25 "$PY" bench/matmul_sweep.py "${MM[@]}" --out "$OUT/matmul_sweep.json" \
  --png "$WORK/hfu_sweep.png"
stage roofline 35 "$PY" bench/roofline.py "${RL[@]}" --out "$OUT/roofline.json" --png "$WORK/roofline.png"

# the compile key is added by another change; without it that run is skipped, not failed
if "$PY" -m ndtrain.cli.commands config keys --section training 2>/dev/null | grep -q "^training.compile"; then
  VARIANTS="eager compile triton"
else
  VARIANTS="eager triton"; say "training.compile is not a config key here: the compile run is skipped"
fi
for v in $VARIANTS; do
  case $v in
    eager) extra=(--training.kernels=eager); limit=60 ;;
    compile) extra=(--training.kernels=eager --training.compile=true); limit=110 ;;
    triton) extra=(--training.kernels=triton); limit=70 ;;
  esac
  stage "mfu_$v" "$limit" "$PY" -m ndtrain.cli.commands train "${MODEL[@]}" "${COMMON[@]}" "${extra[@]}" \
    --run-dir "$WORK/runs/$v"
done
stage zero_fsdp2 45 "$PY" bench/zero_vs_fsdp2.py "${ZF[@]}" --out "$OUT/zero_vs_fsdp2.json"

"$PY" - "$OUT" "$WORK" "$MODE" <<'EOF'
import json, sys
from pathlib import Path
out, work, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
stages = [dict(zip(("stage", "rc", "seconds"), ln.split("\t"))) for ln in (work / "stages.tsv").read_text().splitlines()]
for s in stages:
    s["rc"], s["seconds"] = int(s["rc"]), int(s["seconds"])
mfu = {}
for run in sorted((work / "runs").glob("*")):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (run / "metrics.jsonl").exists() else []
    rows = [r for r in rows if r.get("tokens_per_s")]
    last = rows[-1] if rows else {}
    mfu[run.name] = {k: last.get(k) for k in ("step", "tokens_per_s", "mfu", "hfu", "step_time_s", "peak_mem_bytes")}
    mfu[run.name]["steps_in_window"] = (last["step"] - rows[-2]["step"]) if len(rows) > 1 else last.get("step")
(out / "mfu_1b.json").write_text(json.dumps({"mode": mode, "runs": mfu}, indent=1) + "\n")
summary = {"mode": mode, "stages": stages, "all_passed": all(s["rc"] == 0 for s in stages), "mfu_1b": mfu,
           "total_seconds": sum(s["seconds"] for s in stages)}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
sys.exit(0 if summary["all_passed"] else 1)
EOF
rc=$?
say "done (rc=$rc): $OUT/summary.json; scratch in $WORK"
exit $rc
}
