#!/usr/bin/env bash
# The GPU benchmarks and tests, one named suite per call. Run from anywhere in the repository on the GPU machine:
#   bash benchmarks/gpu.sh SUITE [extra args]     (bash benchmarks/gpu.sh --help lists the suites)
# Each suite's commands are the ones that produced the numbers in benchmarks/results/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/pdserve-bench}
SINGLE_GPU_SUITES=(tests decode prefill mla moe spec serving)

usage() {
  cat <<'EOF'
usage: bash benchmarks/gpu.sh SUITE [extra args]

Suites (H100 wall times; extra args go to the suite's program, after its own flags):
  tests      every single-GPU test: pytest tests/test_gpu_*.py (~2.5-4 min warm, 8 min on a fresh H200 machine; its
             limit is 585 s of a device call's 600; extra args are pytest's, e.g. -k flashinfer)
  decode     V3-slice decode step, CUDA graphs vs eager, vs transformers; fused kernels; flashinfer under graphs (~5 min)
  prefill    V3-slice prefill tok/s at 1k / 4k / 16k tokens, triton and flashinfer attention (~3 min)
  mla        MLA decode attention, triton vs flashinfer, against copy bandwidth and matmul rate (~1 min)
  mla-tune   sweep of the Triton MLA decode tiles; prints the defaults to paste into kernels/triton_mla_decode.py (~2.5 min)
  moe        dense block-FP8 GEMMs and the MoE grouped GEMMs (fused table, contiguous, Gluon) vs cuBLAS FP8 (~3 min)
  moe-tune   the fused-MoE prefill tile search, writes the table for kernels/configs/moe/, then moe with it (~5 min)
  spec       NextN speculative decoding on models/tiny-trained, and its draft / verify cost on the V3 slice (~2 min)
  serving    the service vs the engine: `pdserve up` (prefill + decode on one GPU) driven by `pdserve bench` at
             concurrency 1 8 32 128, demo model and V3 slice, the engine alone on the same prompts; cold kernel
             caches first; the stack traced, so that the c=1 TTFT comes split into its parts with this host's bare
             gRPC hop beside it (--explain-ttft) (~5 min on an H200; extra args go to bench_serving.py, e.g.
             --models demo --concurrency 1 32)
  knobs      what each serving mechanism buys through `pdserve up` on the V3 slice, on and off alternating, twice:
             decode pacing on one GPU (--decode-gpu-share auto vs 1) at concurrency 1 32 128, and layer-wise KV
             streaming over tcp (--no-kv-layerwise) with 8k-token prompts at 1 and 8; benchmarks/knobs_report.py
             gives each one's client-visible gain and whether it reaches 5% (~8 min on a fresh machine)
  prefill-workers  the demo model through `pdserve up` with one and with two prefill workers beside the decode worker
             on the one GPU, alternating (1, 2, 1, 2): bench_serving.py at concurrency 32 and 128 and prompts only,
             the engine alone after each stack (~3 min)
  pd         two GPUs: the V3 slice (2048 in / 64 out) through `pdserve up` with prefill on GPU 0 and decode on GPU 1
             over cuda_ipc (auto), nccl, tcp and nixl at concurrency 1 32 128, two colocated replicas (a prefill and a
             decode worker on each GPU) at 32 and 128, 16k-token prompts at 1, the engine alone on one GPU; one table
             with each target met or missed (benchmarks/pd_report.py) (~18 min: more than one device call; PD_LAYOUTS
             picks the layouts, e.g. PD_LAYOUTS="auto nccl nixl" then "tcp colocated long")
  kv         two GPUs: the two-GPU tests (the engine on the last GPU, prefill on GPU 0 and decode on GPU 1 over each
             transport, the NCCL and NIXL transports' own) and bench_kv_transfer.py GPU 0 -> GPU 1 for cuda_ipc, nccl
             and nixl against a peer copy (on one GPU it says so and exits 0) (~10 min)
  tp         two GPUs: workers that span GPUs (issue 45), bench_tp.py: TP1 vs TP2 vs TP2 + DP attention vs EP2 on the
             V3 slice (decode step at batch 1 / 32 / 128, prefill tok/s at 4k and 16k, KV capacity in tokens at the
             same memory fraction) and a 16-layer + NextN V3 configuration (more than one H200 holds) through
             `pdserve generate --tp 2`; one table with each target met or missed (< 9 min: what does not fit its time
             budget is reported not run; extra args go to bench_tp.py, e.g. --configs tp1 tp2 --skip-big). Its tests,
             in a call of their own: python3 -m pytest tests/test_gpu_tp.py
  v3-8gpu    eight GPUs: DeepSeek-V3's full geometry (issue 47), bench_v3_8gpu.py: one colocated worker (61 layers +
             NextN, FP8 dummy weights) at TP8 and TP8 + DP attention + EP8: decode tok/s at batch 1 with and without
             NextN, at 32 and 128, prefill tok/s at 4k and 16k, the batch-1 step against the per-GPU read floor (copy
             bandwidth measured in the run); PD with a TP4 prefill worker on GPUs 0-3 and a TP4 decode worker on 4-7
             through `pdserve up` + `pdserve bench` (2048 in / 64 out, concurrency 1 32 128, as many layers as fit);
             one table with each target met or missed (more than one device call: extra args go to bench_v3_8gpu.py,
             e.g. --parts tp tp-nextn, then --parts dp-ep dp-ep-nextn, then --parts pd; --report DIR... merges
             them). On fewer GPUs it says so and exits 0; --gpus 2 --layers 8: the same launch on two GPUs (TP2);
             --dry-run: the CPU (demo model, TP2 over Gloo)
  overlap    overlap scheduling on and off through the product: bench_serving.py on the demo model at concurrency 1
             and 32, once as shipped and once with --disable-overlap-schedule on both sides (~3 min)
  ttft       where a prompt's time goes: the prefill step in one process (engine, + hooks, the worker's own) with
             torch.profiler tables, then through `pdserve up` (demo model) at concurrency 1 and 32 with the stack's
             own stage metrics (router TTFT, prefill worker TTFT, KV transfer) (~2 min)
  trace      where a request's time goes between the processes: bench_serving.py at concurrency 1 on each model and at
             32 on the V3 slice with PDSERVE_TRACE set, then benchmarks/trace_report.py (median ms from the router's
             receipt to each point, and the slowest request's; at c=32 the prefill worker's time per step), and
             bench_prefill_stages.py on the V3 slice's 2048-token prompt (the same step in one process) (~5 min;
             extra args go to bench_serving.py, e.g. --speculative-num-steps 3 for the NextN hand-over's points)
  profile    py-spy on the decode worker and the router while pdserve bench drives pdserve up (demo model) at
             concurrency 32 and 1: where the stack's host time goes (~2 min; needs py-spy in .whl/; extra args go
             to pdserve up, e.g. --speculative-algorithm NEXTN; PROFILE_NATIVE=1: native stacks, which pause the
             process per sample, and each thread's time waiting for the GIL, pyspy_summary.py --gil)
  kv-ipc     one GPU: the cuda_ipc KV-transfer tests, bench_kv_transfer.py --backend cuda_ipc (V3-slice and 61-layer
             KV, 2k and 16k tokens, against a device copy; tcp beside it), then TTFT at concurrency 1 through
             `pdserve up --device cuda` on the V3 slice, cuda_ipc vs tcp, layer-wise on and off, 1k/4k/16k
             prompts, and the engine's prefill time of the same lengths (~9 min)
  host       what the machine adds to host-bound numbers: benchmarks/host_speed.py (each CPU's pure-Python speed, 3
             rounds) and benchmarks/grpc_hop.py (one gRPC message between two processes after 2-110 ms idle, unary
             and on an open stream; extra args go to it) (~1 min)
  all        tests, decode, prefill, mla, moe, spec and serving in turn (longer than one device call's 10 minutes)

Files land in $OUT/SUITE/ (default $OUT=/tmp/pdserve-bench): SUITE.log with everything printed (the GPU and
driver first), and the suite's JSON files. Commit them under benchmarks/results/<gpu>/.

Through the device tool (after `bash ../shared/tools/gpu-wheels.sh` here, which fills .whl/):
  run(command="bash benchmarks/gpu.sh moe", carry=[".whl"])                        # one H200
  run(command="bash benchmarks/gpu.sh kv", carry=[".whl"], kind="nvidia-h200-x2")  # two GPUs
EOF
}

setup_env() {  # the carried wheels (FlashInfer, DeepGEMM, redis, grpc health) and a FlashInfer JIT cache in the run
  export PYTHONUNBUFFERED=1
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer}
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || echo "note: the wheels in .whl/ did not install (above)"
  else
    echo "note: no .whl/*.whl (bash ../shared/tools/gpu-wheels.sh, then carry .whl): FlashInfer and DeepGEMM cases skip"
  fi
  if [ -f .whl/nixl-slim.tar.xz ]; then  # NIXL (nixl_cu13) with its UCX backend only, as gpu-wheels.sh slims it
    mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl/nixl-slim.tar.xz && export PYTHONPATH=/tmp/site:$PYTHONPATH
  fi
}

num_gpus() { nvidia-smi -L 2>/dev/null | grep -c '^GPU'; }

header() {  # what the numbers were measured on
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
    'triton', triton.__version__)" 2>&1 | tail -1
  echo "git ${BENCH_GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}; $(date -u +%FT%TZ)"  # BENCH_GIT_REV: a copied tree's .git may be stale
}

FAILED=0
step() {  # step SECONDS COMMAND...: run it under a time limit, print its wall time, remember a failure
  local limit=$1 start=$SECONDS rc
  shift
  echo "+ $*"
  timeout "$limit" "$@"
  rc=$?
  if [ "$rc" -eq 124 ]; then echo "= TIMED OUT after ${limit} s"; else echo "= exit $rc, $((SECONDS - start)) s"; fi
  [ "$rc" -eq 0 ] || FAILED=1
}

suite_tests() {
  shift  # the suite's folder: pytest writes nothing there
  step 585 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_gpu_*.py "$@"
}

suite_host() {  # what the host adds to host-bound numbers: each CPU's speed, and one gRPC hop after idle gaps
  local d=$1
  shift
  step 120 python3 benchmarks/host_speed.py --rounds 3 --json "$d/host_speed.json"
  step 200 python3 benchmarks/grpc_hop.py --gaps 0.002 0.01 0.04 0.11 --calls 60 --json "$d/grpc_hop.json" "$@"
}

suite_decode() {  # $1: the suite's folder
  local d=$1
  shift
  # Issue 4's table: eager vs CUDA graphs vs the read floor, all-Triton kernels, and transformers at batch 1.
  step 300 python3 benchmarks/bench_one_batch.py --out "$d/one_batch.json" --layers 4 --batch 1 8 32 128 \
    --ctx 1024 4096 --prefill --attention-backend triton --moe-backend triton --gemm-backend triton "$@"
  # The default kernels: fused RMSNorm / RoPE, scaled_mm dense GEMMs (its ctx 4096 rows are the triton column
  # of the flashinfer-under-graphs comparison).
  step 200 python3 benchmarks/bench_one_batch.py --out "$d/one_batch_fused.json" --layers 4 --batch 1 8 32 128 \
    --ctx 1024 4096 --prefill --skip-transformers --gemm-backend scaled_mm "$@"
  step 150 python3 benchmarks/bench_one_batch.py --out "$d/one_batch_flashinfer.json" --layers 4 --batch 1 8 32 \
    --ctx 4096 --prefill --skip-transformers --attention-backend flashinfer --gemm-backend scaled_mm "$@"
}

suite_prefill() {
  local d=$1 be
  shift
  for be in triton flashinfer; do
    step 150 python3 benchmarks/bench_one_batch.py --out "$d/prefill_$be.json" --layers 4 --batch 1 --ctx 1024 \
      --no-graph --skip-transformers --attention-backend "$be" --moe-backend triton --gemm-backend scaled_mm "$@"
  done
}

suite_mla() {
  local d=$1
  shift
  step 120 python3 benchmarks/bench_mla_decode.py --out "$d/mla_decode.json" "$@"
}

suite_mla_tune() {
  local d=$1
  shift
  step 150 python3 benchmarks/bench_mla_decode.py --sweep --time-budget-s 100 --out "$d/mla_sweep.json" "$@"
}

suite_moe() {
  local d=$1
  shift
  step 150 python3 benchmarks/bench_moe_gemm.py --skip-moe --out "$d/moe_dense.json" "$@"
  # The committed fused table (with each GEMM's weight-read floor) and the Gluon contiguous tiles.
  step 300 python3 benchmarks/bench_moe_gemm.py --skip-dense --moe-tokens 4096 8192 16384 --gluon \
    --out "$d/moe_gluon.json" "$@"
  step 200 python3 benchmarks/bench_moe_gemm.py --skip-dense --contiguous --moe-tokens 4096 8192 16384 \
    --out "$d/moe_contiguous.json" "$@"
}

suite_moe_tune() {
  local d=$1
  shift
  step 235 python3 benchmarks/tune_moe.py --space prefill --tokens 4096 8192 16384 --time-budget-s 180 \
    --out "$d/moe_table.json" --fill-defaults --results "$d/moe_sweep.json" "$@"
  if [ -s "$d/moe_table.json" ]; then
    step 120 python3 benchmarks/bench_moe_gemm.py --skip-dense --moe-tokens 4096 8192 16384 \
      --moe-config "$d/moe_table.json" --out "$d/moe_gemm_tuned.json"
  else
    echo "no moe_table.json: the search tuned nothing"
    FAILED=1
  fi
}

suite_spec() {
  local d=$1
  shift
  step 200 python3 benchmarks/bench_spec.py --model models/tiny-trained --out "$d/spec.json" --v3-layers 0 \
    --divergence-prompts 16 --repeats 3 --host-phases "$@"
  # Draft and verification cost on the V3 slice (4 layers + NextN, FP8 dummy weights), with the host profile.
  step 200 python3 benchmarks/bench_spec.py --model models/tiny-trained --out "$d/spec_v3_slice.json" --profile "$@"
}

suite_serving() {  # serving.json, serving.md, and per model its up.log, bench_c<C>.json, engine.json
  local d=$1
  shift
  step 560 python3 benchmarks/bench_serving.py --out "$d" --cold --explain-ttft "$@"
}

suite_knobs() {  # pacing_<off|auto>_r<k>/ and layerwise_<on|off>_r<k>/ (serving.json, serving.md each), knobs.md
  # Each serving mechanism on and off through `pdserve up` on the V3 slice, alternating in one call, twice
  # (benchmarks/knobs_report.py): one stays only where clients see 5% or more.
  # - pacing (decode_service/pacing.py): on one GPU, the decode worker's steps held back while prompts are prefilled
  #   for it (--decode-gpu-share auto) against back to back (1); concurrency 1, 32 and 128.
  # - layer-wise KV streaming: each layer's KV sent as the prefill forward leaves it, against the whole prompt's KV
  #   after the forward (--no-kv-layerwise); over tcp, the transport between hosts; 8k-token prompts at 1 and 8.
  local d=$1 r mode
  shift
  for r in 1 2; do
    for mode in off auto; do
      step 200 python3 benchmarks/bench_serving.py --out "$d/pacing_${mode}_r$r" --models v3 --prompts-only-concurrency 0 \
        --concurrency 1 32 128 --skip-engine --up-arg=--decode-gpu-share="$([ "$mode" = off ] && echo 1 || echo auto)" "$@"
    done
  done
  for r in 1 2; do
    for mode in on off; do
      step 200 python3 benchmarks/bench_serving.py --out "$d/layerwise_${mode}_r$r" --models v3 --prompts-only-concurrency 0 \
        --concurrency 1 8 --num-prompts 16 --v3-input-len 8192 --skip-engine --up-arg=--kv-transport=tcp \
        --up-arg=--max-model-len=8400 $([ "$mode" = off ] && echo --up-arg=--no-kv-layerwise) "$@"
    done
  done
  python3 benchmarks/knobs_report.py "$d" | tee "$d/knobs.md"
}

suite_overlap() {  # shipped/ and in_order/: serving.json and serving.md of each
  local d=$1
  shift
  step 280 python3 benchmarks/bench_serving.py --out "$d/shipped" --models demo --concurrency 1 32 "$@"
  step 280 python3 benchmarks/bench_serving.py --out "$d/in_order" --models demo --concurrency 1 32 \
    --engine-arg=--disable-overlap-schedule "$@"
}

suite_prefill_workers() {  # p<N>_<round>/ (serving.json, serving.md each): one and two prefill workers on the one GPU
  # The demo model's prefill is host-bound (~13 ms of host work for ~1 ms of GPU work per 512-token prompt): a second
  # prefill worker, another process, computes on another CPU. One and two alternate (1, 2, 1, 2; fresh stacks), the
  # engine alone after each; each run's prompts-only line and targets follow it.
  local d=$1 round n
  shift
  for round in 1 2; do
    for n in 1 2; do
      step 200 python3 benchmarks/bench_serving.py --out "$d/p${n}_$round" --models demo --concurrency 32 128 \
        --num-prompts 128 --cuda-graph-max-bs 128 --up-arg=--prefill=$n "$@"
    done
  done
}

suite_trace() {  # trace_<model>_c<C>.json (+ each run's serving.json): where a request's time goes between processes
  # bench_serving.py with PDSERVE_TRACE set: every process of its `pdserve up` timestamps each request's points
  # (pdserve/common/trace.py); benchmarks/trace_report.py lines them up, and at c=32 times the prefill worker's steps
  # (against the in-process step of the same prompt: bench_prefill_stages.py, engine and worker).
  local d=$1 run model c
  shift
  for run in demo:1 v3:1 v3:32; do
    model=${run%:*} c=${run#*:}
    PDSERVE_TRACE="$d/trace_${model}_c$c" step 280 python3 benchmarks/bench_serving.py --out "$d/${model}_c$c" \
      --models "$model" --concurrency "$c" --num-prompts $((c > 1 ? 2 * c : 32)) --skip-engine \
      --prompts-only-concurrency 0 --cuda-graph-max-bs 128 "$@"
    echo "where a request's time goes, $model, concurrency $c:"
    python3 benchmarks/trace_report.py "$d/trace_${model}_c$c" --json "$d/trace_${model}_c$c.json"
  done
  step 200 python3 benchmarks/bench_prefill_stages.py --out "$d" --lengths 2048 --iters 15
}

suite_ttft() {  # prefill_stages.json, up.log, bench_c<C>.json, prefill_c<C>.raw; stage means and profiles in ttft.log
  local d=$1 port up pre c spy=
  shift
  command -v py-spy >/dev/null || export PATH=/tmp/site/bin:$PATH
  step 150 python3 benchmarks/bench_prefill_stages.py --out "$d" --model models/tiny-trained --lengths 512 1536 --profile
  port=$((52100 + RANDOM % 1000))
  python3 -m pdserve up --device cuda --port "$port" --no-http --metrics-port 0 "$@" >"$d/up.log" 2>&1 &
  up=$!
  for _ in $(seq 300); do grep -q "pdserve is up" "$d/up.log" && break; sleep 1; done
  pre=$(pgrep -P "$up" -f "pdserve prefill")
  for c in 1 32; do
    python3 benchmarks/stage_times.py "$d/up.log" --save /tmp/stages.json
    # Prompts only (2 new tokens): the prefill worker's rate. With py-spy (in .whl/), it samples the prefill
    # worker for 3 s of each run (at least 120 prompts: ~4 s at c=1).
    spy=
    if command -v py-spy >/dev/null; then
      (sleep 0.5; py-spy record -p "$pre" -d 3 -r 250 -f raw --threads --nonblocking -o "$d/prefill_c$c.raw" \
        >/dev/null 2>&1) &
      spy=$!
    fi
    step 120 python3 -m pdserve bench --target "127.0.0.1:$port" --num-prompts $((c * 8 > 120 ? c * 8 : 120)) \
      --input-len 512 --output-len 2 --max-concurrency "$c" --no-progress --json "$d/bench_c$c.json"
    echo "stages of TTFT, demo model, 512-token prompts, concurrency $c:"
    python3 benchmarks/stage_times.py "$d/up.log" --since /tmp/stages.json
    [ -n "$spy" ] && wait "$spy"
    [ -f "$d/prefill_c$c.raw" ] && python3 benchmarks/pyspy_summary.py "$d/prefill_c$c.raw" --top 40
  done
  kill -INT "$up"; wait "$up"
}

suite_kv() {  # two GPUs: kv.log, kv_nccl.json, kv_cuda_ipc.json, kv_nixl.json
  local d=$1
  shift
  step 420 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_gpu_two_gpus.py tests/test_gpu_kv_nccl.py \
    tests/test_gpu_kv_nixl.py
  # A 61-layer room of DeepSeek-V3 latent KV, GPU 0 -> GPU 1, 4k and 16k tokens, contiguous and shuffled pages, the
  # whole room in one send_layers and layer by layer, against a peer copy of the same bytes in the same run.
  step 200 python3 benchmarks/bench_kv_transfer.py --backend cuda_ipc --out "$d/kv_cuda_ipc.json" --iters 6 "$@"
  step 240 python3 benchmarks/bench_kv_transfer.py --backend nccl --out "$d/kv_nccl.json" --iters 6 "$@"
  step 200 python3 benchmarks/bench_kv_transfer.py --backend nixl --out "$d/kv_nixl.json" --iters 6 "$@"
}

suite_tp() {  # two GPUs: tp.log, tp.json, tp.md (and the generated V3 configs)
  local d=$1
  shift
  step 540 python3 benchmarks/bench_tp.py --out "$d" --time-budget-s 520 --profile "$@"
}

suite_v3_8gpu() {  # eight GPUs: v3-8gpu.log, v3_8gpu.json, v3_8gpu.md, part_<name>.json, pd/ (bench_serving.py's)
  local d=$1
  shift
  step 550 python3 benchmarks/bench_v3_8gpu.py --out "$d" --time-budget-s 530 "$@"
}

suite_pd() {  # two GPUs: pd.log, pd.md, pd_auto/ pd_nccl/ pd_tcp/ colocated/ long/ (each bench_serving.py's files)
  # The disaggregated stack on two GPUs against the engine alone and two colocated replicas, V3 slice, 2048 in / 64
  # out; benchmarks/pd_report.py makes the table from whichever layouts ran. PD_LAYOUTS picks them (default: all;
  # they take longer than one device call: run them in two, then pd_report.py over the merged folders). Extra args
  # go to every bench_serving.py run.
  local d=$1 v3=(--models v3 --cuda-graph-max-bs 128 --prompts-only-concurrency 0) apart=(--up-arg=--gpus=0,1) l
  shift
  for l in ${PD_LAYOUTS:-auto nccl tcp nixl colocated long}; do
    case $l in
      auto) step 330 python3 benchmarks/bench_serving.py --out "$d/pd_auto" "${v3[@]}" --concurrency 1 8 32 128 \
              --cold "${apart[@]}" "$@" ;;
      nccl | tcp | nixl) step 150 python3 benchmarks/bench_serving.py --out "$d/pd_$l" "${v3[@]}" --concurrency 1 32 128 \
              --skip-engine "${apart[@]}" --up-arg=--kv-transport=$l "$@" ;;
      colocated) step 150 python3 benchmarks/bench_serving.py --out "$d/colocated" "${v3[@]}" --concurrency 32 128 \
              --skip-engine --up-arg=--prefill=2 --up-arg=--decode=2 --up-arg=--prefill-gpus=0,1 \
              --up-arg=--decode-gpus=0,1 "$@" ;;
      long) step 200 python3 benchmarks/bench_serving.py --out "$d/long" "${v3[@]}" --concurrency 1 --num-prompts 4 \
              --v3-input-len 16384 --engine-arg=--max-model-len=16448 "${apart[@]}" "$@" ;;
      *) echo "PD_LAYOUTS: unknown layout $l (auto nccl tcp nixl colocated long)"; FAILED=1 ;;
    esac
  done
  python3 benchmarks/pd_report.py "$d" | tee "$d/pd.md"
}

suite_profile() {  # profile.log, bench_c<C>.json, decode[_engine]_c<C>.raw, router_c<C>.raw (py-spy, raw stacks)
  # Where the stack's host time goes: pdserve up --device cuda (demo model), pdserve bench at concurrency 32 and 1,
  # py-spy sampling the decode worker and the router (the `up` process) meanwhile; summarized with
  # benchmarks/pyspy_summary.py. Needs py-spy in .whl/ (pip download --no-deps --only-binary=:all:
  # --platform manylinux_2_17_x86_64 -d .whl py-spy), installed with the other wheels.
  local d=$1 port up dec c spy_flags="-r 250 -f raw --threads --nonblocking"
  shift
  # Native stacks show where a thread waits for the GIL; py-spy must pause the process for them (fewer samples).
  [ "${PROFILE_NATIVE:-0}" = 1 ] && spy_flags="-r 100 -f raw --threads --native --idle"
  command -v py-spy >/dev/null || export PATH=/tmp/site/bin:$PATH
  command -v py-spy >/dev/null || { echo "profile needs py-spy (see the comment above suite_profile)"; FAILED=1; return; }
  port=$((51100 + RANDOM % 1000))
  python3 -m pdserve up --device cuda --port "$port" --no-http --no-metrics "$@" >"$d/up.log" 2>&1 &
  up=$!
  for _ in $(seq 300); do grep -q "pdserve is up" "$d/up.log" && break; sleep 1; done
  dec=$(pgrep -P "$up" -f "pdserve decode")
  for c in 32 1; do
    # At least 60 prompts: c=1 must still be running when py-spy starts (3 s in) and for its 8 s.
    python3 -m pdserve bench --target "127.0.0.1:$port" --num-prompts $((c * 10 > 60 ? c * 10 : 60)) --input-len 512 --output-len 128 \
      --max-concurrency "$c" --no-progress --json "$d/bench_c$c.json" >"/tmp/profile_bench_c$c.txt" 2>&1 &
    local b=$!
    sleep 3
    py-spy record -p "$dec" -d 8 $spy_flags -o "$d/decode_c$c.raw" >/dev/null 2>&1 &
    local spy=$!
    py-spy record -p "$up" -d 8 $spy_flags -o "$d/router_c$c.raw" >/dev/null 2>&1
    wait "$spy"  # its file is written when it exits
    wait "$b"
    tail -20 "/tmp/profile_bench_c$c.txt"
    for f in "$d/decode_c$c.raw"; do
      echo "== $f"
      python3 benchmarks/pyspy_summary.py "$f" --top 25
      [ "${PROFILE_NATIVE:-0}" = 1 ] && python3 benchmarks/pyspy_summary.py "$f" --gil --within "step (pdserve/engine.py"
    done
  done
  kill -INT "$up"; wait "$up"
}

suite_kv_ipc() {  # kv-ipc.log, kv_ipc.json, ttft_<transport>_lw<on|off>_<len>.json, up_*.log, engine_prefill.json
  local d=$1 t len port model
  shift
  step 200 python3 -m pytest -v -p no:cacheprovider -rfEs tests/test_gpu_kv_ipc.py
  step 100 python3 benchmarks/bench_kv_transfer.py --backend cuda_ipc --prefill-device cuda:0 --tokens 2048 16384 \
    --layer-sets 5 61 --compare-tcp --iters 10 --warmup 2 --out "$d/kv_ipc.json" "$@"
  # The engine alone: its prefill time at each length, with the kernels a prefill worker's `auto` picks here.
  step 150 python3 benchmarks/bench_one_batch.py --out "$d/engine_prefill.json" --layers 4 --batch 1 --ctx 1024 \
    --prefill 1024 4096 16384 --no-graph --skip-transformers --attention-backend flashinfer --moe-backend deep_gemm \
    --gemm-backend deep_gemm
  # What the prefill worker's step costs beyond the engine's prefill (MTP layer KV, hooks, gathers), in-process.
  step 150 python3 benchmarks/bench_prefill_stages.py --out "$d" --lengths 1024 4096 16384 --profile
  # TTFT at concurrency 1 through the stack (router + prefill + decode on this GPU), V3 slice with dummy FP8
  # weights; no warm-up at start: one request per prompt length first, then 5 measured.
  model=$(python3 -c "from benchmarks.bench_serving import write_v3_config; print(write_v3_config('/tmp/kv-ipc', 4))")
  # Each transport with layer-wise streaming on, then off (the whole prompt's KV sent after its forward).
  for t in cuda_ipc tcp; do
    for lw in on off; do
      port=$((50100 + RANDOM % 1000))
      python3 -m pdserve up --model "$model" --load-format dummy --device cuda --kv-transport "$t" --skip-warmup \
        --port "$port" --no-http --metrics-port 0 --num-pages 4096 --max-num-batched-tokens 16384 --max-model-len 16400 \
        $([ "$lw" = off ] && echo --no-kv-layerwise) >"$d/up_${t}_lw$lw.log" 2>&1 &
      local up=$!
      for _ in $(seq 120); do grep -q "pdserve is up" "$d/up_${t}_lw$lw.log" && break; sleep 1; done
      for len in 1024 4096 16384; do
        step 60 python3 -m pdserve bench --target "127.0.0.1:$port" --num-prompts 1 --input-len "$len" \
          --output-len 2 --max-concurrency 1 --no-progress >/dev/null
        python3 benchmarks/stage_times.py "$d/up_${t}_lw$lw.log" --save /tmp/stages.json
        step 60 python3 -m pdserve bench --target "127.0.0.1:$port" --num-prompts 5 --input-len "$len" \
          --output-len 2 --max-concurrency 1 --no-progress --seed 7 --json "$d/ttft_${t}_lw${lw}_$len.json"
        echo "stages of TTFT, $t, layer-wise $lw, $len tokens:"
        python3 benchmarks/stage_times.py "$d/up_${t}_lw$lw.log" --since /tmp/stages.json
      done
      kill -INT "$up"; wait "$up"
      grep "over cuda_ipc\|over tcp\|KV pair" "$d/up_${t}_lw$lw.log" | head -4
    done
  done
}

run_suite() {  # run_suite NAME [extra args]: $OUT/NAME/NAME.log and the suite's files
  local name=$1 d=$OUT/$1
  shift
  mkdir -p "$d"
  echo "== $name -> $d"
  ( header; "suite_${name//-/_}" "$d" "$@"; exit "$FAILED" ) 2>&1 | tee "$d/$name.log"
}

need_gpus() {  # need_gpus N SUITE: exit when this machine has fewer GPUs (0 with a note for the 2-GPU suite)
  local have
  have=$(num_gpus)
  [ "$have" -ge "$1" ] && return 0
  if [ "$1" -ge 2 ]; then
    echo "$2 needs $1 GPUs; this machine has $have. Nothing run. Device tool: kind=\"nvidia-h200-x$1\"."
    exit 0
  fi
  echo "$2 needs an NVIDIA GPU (nvidia-smi lists none here); run it on the GPU machine" >&2
  exit 1
}

suite=${1:-}
[ $# -gt 0 ] && shift
case "$suite" in
  "" | -h | --help | help)
    usage
    exit 0 ;;
  kv-ipc)
    need_gpus 1 kv-ipc
    setup_env
    run_suite kv-ipc "$@" ;;
  v3-8gpu)  # eight GPUs, or --gpus N of them; none for --dry-run
    gpus=8 prev=
    for a in "$@"; do
      [ "$prev" = --gpus ] && gpus=$a
      case $a in --gpus=*) gpus=${a#--gpus=} ;; esac
      prev=$a
    done
    case " $* " in *" --dry-run "*) gpus=0 ;; esac
    [ "$gpus" -gt 0 ] && need_gpus "$gpus" v3-8gpu
    setup_env
    run_suite v3-8gpu "$@" ;;
  kv | pd | tp)
    need_gpus 2 "$suite"
    setup_env
    run_suite "$suite" "$@" ;;
  tests | decode | prefill | mla | mla-tune | moe | moe-tune | spec | serving | knobs | prefill-workers | overlap | ttft | \
  trace | profile | host)
    need_gpus 1 "$suite"
    setup_env
    run_suite "$suite" "$@" ;;
  all)
    [ $# -eq 0 ] || { echo "all takes no extra args (they differ per suite)" >&2; exit 2; }
    need_gpus 1 all
    setup_env
    rc=0
    for s in "${SINGLE_GPU_SUITES[@]}"; do run_suite "$s" || rc=1; done
    exit "$rc" ;;
  *)
    echo "unknown suite: $suite" >&2
    usage >&2
    exit 2 ;;
esac
