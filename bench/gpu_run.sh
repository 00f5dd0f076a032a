#!/usr/bin/env bash
# One device command for a session lent 15 minutes of one H100 (bench/gpu_session.md is the 30-minute plan this cuts
# down): the CUDA-graph checks, the decoding bench at 0.5B, then issue 33's bench (0.5B, bf16, 512-token completions):
# GRPO and RLOO vs TRL 1.16, then PPO (shared and separate critic) vs TRL 1.12, each stage started only while the time
# left allows it. Every JSON lands in $OUT as soon as a child ends, so a command stopped at its limit keeps what ran.
#   run: bash bench/gpu_run.sh <SHA> <DIRTY> [budget seconds, default 570]      carry: [".whl", ".toks"]
set -u
SHA=${1:-unknown}; DIRTY=${2:-unknown}; BUDGET=${3:-570}; START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/trl112 .whl/ppo/*.whl || exit 1
# datasets 5.2 asks pyarrow >= 24; the image's pyarrow is not recorded: fall back to datasets 4.8.5 (pyarrow >= 21)
python3 -c "import pyarrow as p, sys; sys.exit(int(p.__version__.split('.')[0]) < 24)" ||
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/ds4/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 LIBRARY_COMMIT=$SHA LIBRARY_DIRTY=$DIRTY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch,transformers,accelerate,peft,datasets,pyarrow,trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__, 'trl', trl.__version__)" || exit 1

echo "== [$((SECONDS - START)) s] tests/test_decode_cuda.py"
timeout 150 python3 -m pytest tests/test_decode_cuda.py -q -p no:cacheprovider 2>&1 | tail -25 | tee $OUT/test_decode_cuda.txt
GRAPHS_OK=${PIPESTATUS[0]}

echo "== [$((SECONDS - START)) s] bench/decode_speed.py 0.5b"
timeout 150 python3 bench/decode_speed.py --device cuda --shapes 0.5b --batch 8 --tokens 128 --reps 2 2>&1 | tee $OUT/decode_speed_0.5b.txt

# our side samples through `decode` (each step a CUDA-graph replay) when its checks passed, else through 🤗 generate
LEVER=""; [ "$GRAPHS_OK" = 0 ] && LEVER="--lever own_decoder"
B="python3 bench/real_size.py --device cuda --dtype bf16 --tok_dir .toks/qwen151936 --trl_ppo_path /tmp/trl112 --model-shape 0.5b --response_length 512 --batch 8 --warmup 1 --steps 1"
echo "== [$((SECONDS - START)) s] GRPO, RLOO ($LEVER)"
$B --algos grpo rloo $LEVER --deadline_s $(( $(left) > 231 ? $(left) - 230 : 1 )) --json $OUT/real_size_gpu_0.5b_r512.json
echo "== [$((SECONDS - START)) s] PPO ($LEVER), $(left) s left"
[ "$(left)" -gt 120 ] && $B --algos ppo_shared ppo_separate --epochs 4 $LEVER --deadline_s $(( $(left) - 100 )) --json $OUT/real_size_gpu_0.5b_r512_ppo.json
echo "== [$((SECONDS - START)) s] done"
