#!/usr/bin/env bash
# One lent-GPU session's checks in one call (device time is scarce: a machine start costs minutes).
# Run from the repository root on the GPU machine (python3 there is the image's: jax 0.11.x, CUDA 13):
#   bash benchmarks/gpu_session.sh            # env tests kernels tune engine; logs and JSON under $OUT (or ./out)
#   STAGES="tests kernels" bash benchmarks/gpu_session.sh
# Stages, each under its own time limit so one slow stage cannot eat the others' time:
#   env      the card, jax/flax versions; installs carried flax/orbax wheels (.whl/) only if the image's
#            flax cannot import jaxmamba
#   step     python -m jaxmamba.bench step at the 8B's widths in 4 layers: the 2,048-token mixed step (4 prompts
#            of 512; one bucket compiled) and a 128-row decode step under jax.profiler, each as a table of kernels (time, share of
#            the step, achieved FLOP/s and bytes/s): where a step's time goes, the first thing to look at
#   tests    the `gpu` tests (compiled Pallas kernels against their references), not the slow sweeps
#   roofline python -m jaxmamba.bench decode --roofline at the 8B's widths in 4 layers (M*M-, vocab 32768,
#            benchmarks/configs/nemotron_h_8b_widths_4layers.json, random weights) at batch 32 and 128: step
#            alone and engine ms per step as shares of the memory roofline, the host profile beside them;
#            then python -m jaxmamba.bench sampling (the sampling tail alone, greedy vs full)
#   dispatch the roofline stage's engine again with async_dispatch="thread" (the dispatch thread a CPU device
#            uses; "auto" enqueues on the engine thread on a GPU): which of the two the GPU host runs faster
#   startup  python -m jaxmamba.bench startup at the 8B's widths in 4 layers at vLLM's serving defaults
#            (256, 8192): a cold start into an empty cache directory, then a warm one from it
#   cmdbuf   the roofline stage again with XLA's command buffers (CUDA graphs) over every kernel kind
#   kernels  python -m jaxmamba.bench kernels --full (serving shapes against the XLA copy roofline)
#   tune     the decode kernels (state and conv updates) over a grid of launch parameters at the serving
#            shapes (bench kernels --tune): which launch-table entries to change
#   engine   benchmarks/gpu_engine_check.py: engine start (bucket compiles) and greedy tokens with the
#            Pallas and the reference kernel backends (prints thread stacks if it stalls)
#   serve    the mixed serve workload through the engine with the Pallas and the reference kernel
#            backends on the GPU; greedy tokens compared between the two
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
# kernels, tune: measured on an H100 and an H200 already (BENCHMARKS.md); serve: its default start outlasted 75 s;
# engine (tokens of the Pallas and reference backends): matched on the H100 and H200 already.
# startup (measured on the H200 already) left the defaults for step, to keep the session's ~11 minutes.
STAGES=${STAGES:-"env step tests roofline"}
export PYTHONUNBUFFERED=1 JAXMAMBA_TEST_GPU=1
# Several pytest workers share one card: no worker may take 75% of it up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PY:-python3}
stage() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
t0=$(date +%s)
mark() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }

if stage env; then
  mark env
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm,driver_version --format=csv
  if ! $PY -c "import jaxmamba.engine, flax; assert flax.__version__.startswith('0.12')" 2>/dev/null; then
    echo "image flax cannot run jaxmamba: installing the carried wheels"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  $PY -c "import sys, jax, flax; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
fi

if stage step; then
  mark step
  timeout ${STEP_S:-150} $PY -m jaxmamba.bench step --config benchmarks/configs/nemotron_h_8b_widths_4layers.json \
    --batch 4 --prompt-len 512 --json "$OUT/step_mixed.json" 2>&1 | tee "$OUT/step_mixed.log" \
    | grep -v "^I0000\|^WARNING: All log"
  timeout ${STEP_DECODE_S:-180} $PY -m jaxmamba.bench step --config benchmarks/configs/nemotron_h_8b_widths_4layers.json \
    --decode --batch 128 --prompt-len 16 --json "$OUT/step_decode.json" 2>&1 | tee "$OUT/step_decode.log" \
    | grep -v "^I0000\|^WARNING: All log"
fi

if stage tests; then
  mark tests
  timeout ${TESTS_S:-200} $PY -m pytest tests/pallas_kernels -m "gpu and not slow" -n ${TEST_WORKERS:-4} -q \
    -p no:cacheprovider --durations=10 --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi

if stage roofline; then
  mark roofline
  timeout ${ROOFLINE_S:-180} $PY -m jaxmamba.bench decode --roofline --config benchmarks/configs/nemotron_h_8b_widths_4layers.json \
    --batch ${ROOFLINE_BATCH:-32,128} --json "$OUT/roofline.json" 2>&1 | tee "$OUT/roofline.log" | grep -v "^I0000\|^WARNING: All log"
  if [ "${SAMPLING_S:-60}" != 0 ]; then
    timeout ${SAMPLING_S:-60} $PY -m jaxmamba.bench sampling --rows 32,128 --vocab 32768 --json "$OUT/sampling.json" 2>&1 \
      | tee "$OUT/sampling.log" | grep -v "^I0000\|^WARNING: All log"
  fi
fi

if stage dispatch; then
  mark dispatch
  timeout ${DISPATCH_S:-150} $PY -m jaxmamba.bench decode --roofline --config benchmarks/configs/nemotron_h_8b_widths_4layers.json \
    --batch ${ROOFLINE_BATCH:-32,128} --async-dispatch thread --json "$OUT/roofline_thread.json" 2>&1 \
    | tee "$OUT/roofline_thread.log" | grep -v "^I0000\|^WARNING: All log"
fi

if stage cmdbuf; then
  # The same roofline with XLA's command buffers (CUDA graphs) over every kernel kind, conditionals and loops
  # too, from one kernel up: whether the step's ~110 launches cost device time between them.
  mark cmdbuf
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_graph_min_graph_size=1 --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE" \
    timeout ${CMDBUF_S:-150} $PY -m jaxmamba.bench decode --roofline --config benchmarks/configs/nemotron_h_8b_widths_4layers.json \
    --batch ${ROOFLINE_BATCH:-32,128} --json "$OUT/roofline_cmdbuf.json" 2>&1 | tee "$OUT/roofline_cmdbuf.log" \
    | grep -v "^I0000\|^WARNING: All log"
fi

if stage startup; then
  mark startup
  timeout ${STARTUP_S:-240} $PY -m jaxmamba.bench startup --config benchmarks/configs/nemotron_h_8b_widths_4layers.json \
    --max-num-seqs ${STARTUP_SEQS:-256} --max-num-batched-tokens ${STARTUP_TOKENS:-8192} --json "$OUT/startup.json" 2>&1 \
    | tee "$OUT/startup.log" | grep -v "^I0000\|^WARNING: All log"
fi

if stage kernels; then
  mark kernels
  timeout ${KERNELS_S:-150} $PY -m jaxmamba.bench kernels --full ${KERNELS_ARGS:-} --json "$OUT/kernels_gpu.json" 2>&1 \
    | tee "$OUT/kernels.log" | grep -v "^I0000\|^WARNING: All log"
fi

if stage tune; then
  mark tune
  timeout ${TUNE_S:-300} $PY -m jaxmamba.bench kernels --full --tune --only selective_state_update,causal_conv1d_update \
    --json "$OUT/kernels_tune.json" 2>&1 | tee "$OUT/tune.log" | grep -v "^I0000\|^WARNING: All log" | grep "best\|^selective\|^causal"
fi

if stage engine; then
  mark engine
  PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} timeout ${ENGINE_S:-200} $PY benchmarks/gpu_engine_check.py ${ENGINE_ARGS:-} 2>&1 | tee "$OUT/engine.log" \
    | grep -v "^I0000\|^WARNING: All log\|compiling step buckets"
fi

if stage serve; then
  for backend in pallas reference; do
    mark "serve $backend"
    timeout ${SERVE_S:-90} $PY -m jaxmamba.bench serve --no-reference --kernel-backend $backend \
      ${SERVE_ARGS:-} --json "$OUT/serve_$backend.json" 2>&1 | tee "$OUT/serve_$backend.log" \
      | grep -v "^I0000\|^WARNING: All log"
  done
  $PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
try:
    p, r = (json.loads((out / f"serve_{b}.json").read_text())["jaxmamba"] for b in ("pallas", "reference"))
except FileNotFoundError as e:
    sys.exit(f"serve comparison skipped: {e}")
same = sum(a == b for a, b in zip(p["tokens"], r["tokens"]))
print(f"pallas vs reference backend on the GPU: {same}/{len(p['tokens'])} requests token-identical; "
      f"output tok/s {p['output_tok_per_s']:.0f} vs {r['output_tok_per_s']:.0f} "
      f"({p['output_tok_per_s'] / r['output_tok_per_s']:.2f}x); compiles while serving "
      f"{p['compiles_while_serving']}/{r['compiles_while_serving']}")
EOF
fi
mark done
