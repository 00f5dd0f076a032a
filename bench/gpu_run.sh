#!/usr/bin/env bash
# One device command for a session lent 15 minutes of one H100 (bench/results/2026-11-26_real_size_h100_0.5b_r512/gpu_session.md is the 30-minute plan this cuts
# down). Stages run in the order given, each started only while the time left allows it; every JSON and log lands in
# $OUT as soon as it is written, so a command stopped at its limit keeps what ran.
#   run: bash bench/gpu_run.sh <SHA> <DIRTY> <budget s> <stage>...      carry: [".whl", ".toks"]   timeout_s: budget + 30
# Stages:
#   tests        tests/test_decode_cuda.py (graphs == plain loop, rows leaving, drawn p == scored p, the GPU default, compile)
#                and tests/test_head_cuda.py (the head's written-out backward, float32 entropy, soft-capped logits under CUDA autocast)
#   decode       bench/decode_speed.py at 0.5B, bf16 weights: graphs, no graphs, 🤗 static, compiled (inductor)
#   grpo_rloo    0.5B, 512 tokens, GRPO and RLOO vs TRL 1.16 (ran 2026-11-26: 10.8x, 14.2x)
#   selective    0.5B, 512 tokens, GRPO vs TRL 1.16, ours with selective checkpointing (TRL without: it has none);
#                expected peak ~13,550 MiB vs TRL's 17,883 (0.76x), at a few % of our update's time
#   ppo          0.5B, 512 tokens, PPO shared and separate critic vs TRL 1.12's PPO (not reached 2026-11-26)
#   decode_short the same without 🤗 (its compilation, ~45 s; measured 2026-11-26), 2 reps, at most 200 s
#   decode_sync  decode_short with `sync_every=8` and `fuse=True` sides (graphs, compiled) and one call of each side under torch.profiler
#                (kernel time a token against the wall: how long the GPU idles between steps); ~150 s with the compilation
#   decode_autotune decode_short with `fuse=True` sides and a compiled one under inductor's max-autotune (its matrix multiplies
#                as Triton templates timed against cuBLAS at these shapes, once for all layers since the step compiles a layer
#                at a time); the warm-up lines give each compiled side's compilation time; ~200 s
#   tests_compiled  the compiled step's two tests and the GPU default's (not yet run on a GPU)
#   ppo_shared   PPO with the shared critic alone vs TRL 1.12's PPO
#   profile      GRPO, ours alone, selective then no checkpointing, one more step's generation and update under torch.profiler
#                (why our GRPO update took 2.0-2.7 s in three runs and 0.2-0.4 s in others; ~40 s each)
#   ppo_separate our separate critic vs TRL 1.12's PPO (its one critic is separate)
#   rloo_selective  RLOO vs TRL 1.16, ours with selective checkpointing (the memory must-show for RLOO)
#   maxbatch_lora   1.5B, GRPO, LoRA r 16 on both sides, the largest batch, ours vs TRL
#   maxbatch_trl    TRL's side of maxbatch alone from 32 (2026-11-27 reached only its 16, 97 s a probe)
#   (on an H200 the maxbatch stages cap a probe at 79,000 MiB: what an H100 80GB holds)
#   compiled     GRPO, ours alone, `--lever compiled_decoder` (the step through inductor inside the graph)
#   early_stops  0.5B, 512 tokens, GRPO and RLOO vs TRL 1.16 with completions that stop early (`--eos_bias 7.3`: EOS
#                p ~ 1/100 a token at V = 151,936, the longest of 8 ~270 tokens), as a trained policy's do; since 2026-11-28 a
#                rollout ends at its longest response on our side (TRL's pads to the longest too)
#   cb           GRPO, ours alone, `--lever continuous_batching`: 🤗's continuous batching engine samples (TRL 1.16's
#                `use_transformers_continuous_batching`, new 2026-11-28, never run on a GPU; under autocast it samples from bf16
#                copies of the weights): its generation ms/token beside `decode`'s graphs is the number
#   padding_free bench/padding_free.py at 0.5B, 16 rows, 512-token completions of mixed lengths: one update micro-batch's
#                forward + backward and one reference pass, padded against `padding_free` (new 2026-11-28, never run on a GPU;
#                ~60 s); then GRPO ours alone with `--eos_bias 7.3 --lever padding_free` beside early_stops' ours
#   shared_prefix bench/padding_free.py at 0.5B, 16 rows = 2 prompts x 8 of ~256 tokens, 512-token completions: padded against
#                `shared_prefix` (new 2026-11-28, never run on a GPU; ~60 s); then GRPO ours alone with `--prompt_words 100`,
#                without and with `--lever shared_prefix`
#   micro_batches GRPO at 0.5B, 32 completions in micro-batches of 8, `--eos_bias 7.3` (lengths that differ): ours vs TRL,
#                then ours alone with `--lever drawn_micro_batches` (rows dealt as drawn, the library's way before
#                2026-11-28's `like_rows`; new, never run on a GPU)
#   maxbatch     1.5B, GRPO, the largest batch for full fine-tuning, ours vs TRL (doubling only)
#   maxbatch8    the same with `--optim adamw_8bit` on both sides (bitsandbytes: carry its wheel in .whl/bnb, 43 MB;
#                the image has none): 2 bytes of optimizer moments a parameter instead of 8 (embeddings excepted), ~7.9 GB less at 1.5B
# 2026-11-26 ran: grpo_rloo and the first two (the script then had no stages). 2026-11-27 (an H200) ran selective,
# decode_short, ppo_shared, tests_compiled, maxbatch (bench/results/HISTORY.md §5). Next, in one ~9-minute call:
#   tests decode_sync ppo_separate rloo_selective     then, in a second call if time is left:   decode_autotune maxbatch_lora maxbatch_trl profile
#   (tests first: since 2026-11-27 graphs record through `_record`, not `torch.cuda.graph`, and `compile` compiles a layer
#   at a time with automatic dynamic shapes; none of it has run on a GPU)
set -u
SHA=${1:-unknown}; DIRTY=${2:-unknown}; BUDGET=${3:-570}; shift 3; START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/trl112 .whl/ppo/*.whl || exit 1
# datasets 5.2 asks pyarrow >= 24 (the image had 25.0.1 on 2026-11-26); else datasets 4.8.5 (pyarrow >= 21)
python3 -c "import pyarrow as p, sys; sys.exit(int(p.__version__.split('.')[0]) < 24)" ||
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/ds4/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 LIBRARY_COMMIT=$SHA LIBRARY_DIRTY=$DIRTY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch,transformers,accelerate,peft,datasets,pyarrow,trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__, 'trl', trl.__version__)" || exit 1
B="python3 bench/real_size.py --device cuda --dtype bf16 --tok_dir .toks/qwen151936 --trl_ppo_path /tmp/trl112 --model-shape 0.5b --response_length 512 --batch 8 --warmup 1 --steps 1"
# on a GPU larger than an H100 (an H200: 143,771 MiB), a probe whose peak passes 79,000 MiB counts as not fitting an H100 80GB
CAP=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); [ "${CAP:-0}" -gt 100000 ] && CAP="--mem_limit_mib 79000" || CAP=""
deadline() { local d=$(( $(left) - $1 )); [ "$d" -gt 0 ] && echo $d || echo 1; }   # start no child later than $1 s before the end
# the GPU's clocks, power and throttle reasons every 200 ms for the whole command (the GRPO update ran 2.0-2.7 s in the
# first trainer process of a fresh machine and 0.2-0.4 s later: a low clock or a power cap would show here)
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 200 > $OUT/nvidia_smi.csv 2>&1 & SMI=$!; trap 'kill $SMI 2>/dev/null' EXIT

for stage in "$@"; do
  echo "== [$((SECONDS - START)) s, $(left) s left] $stage"
  case $stage in
    tests) timeout $(( $(left) < 240 ? $(left) : 240 )) python3 -m pytest tests/test_decode_cuda.py tests/test_head_cuda.py -q -p no:cacheprovider 2>&1 | tail -30 | tee $OUT/test_decode_cuda.txt ;;
    decode) timeout $(( $(left) < 300 ? $(left) : 300 )) python3 bench/decode_speed.py --device cuda --shapes 0.5b --batch 8 --tokens 128 --reps 3 --compiled 2>&1 | tee $OUT/decode_speed_0.5b.txt ;;
    decode_short) timeout $(( $(left) < 200 ? $(left) : 200 )) python3 bench/decode_speed.py --device cuda --shapes 0.5b --batch 8 --tokens 128 --reps 2 --compiled --no_hf 2>&1 | tee $OUT/decode_speed_0.5b.txt ;;
    decode_sync) timeout $(( $(left) < 240 ? $(left) : 240 )) python3 bench/decode_speed.py --device cuda --shapes 0.5b --batch 8 --tokens 128 --reps 2 --compiled --no_hf --sync_every 8 --fused --draws --profile $OUT/decode_profile 2>&1 | tee $OUT/decode_speed_0.5b_sync.txt ;;
    decode_autotune) timeout $(( $(left) < 300 ? $(left) : 300 )) python3 bench/decode_speed.py --device cuda --shapes 0.5b --batch 8 --tokens 128 --reps 2 --compiled --no_hf --fused --autotune 2>&1 | tee $OUT/decode_speed_0.5b_autotune.txt ;;
    tests_compiled) timeout $(( $(left) < 150 ? $(left) : 150 )) python3 -m pytest tests/test_decode_cuda.py -q -p no:cacheprovider -k "compiled or default" 2>&1 | tail -30 | tee $OUT/test_decode_cuda_compiled.txt ;;
    grpo_rloo) $B --algos grpo rloo --deadline_s $(deadline 150) --json $OUT/real_size_gpu_0.5b_r512.json ;;
    selective) $B --algos grpo --checkpointing selective --deadline_s $(deadline 150) --json $OUT/real_size_gpu_0.5b_r512_selective.json ;;
    ppo) $B --algos ppo_shared ppo_separate --epochs 4 --deadline_s $(deadline 130) --json $OUT/real_size_gpu_0.5b_r512_ppo.json ;;
    ppo_separate) $B --algos ppo_separate --epochs 4 --deadline_s $(deadline 100) --json $OUT/real_size_gpu_0.5b_r512_ppo_separate.json ;;
    rloo_selective) $B --algos rloo --checkpointing selective --deadline_s $(deadline 150) --json $OUT/real_size_gpu_0.5b_r512_rloo_selective.json ;;
    ppo_shared) $B --algos ppo_shared --epochs 4 --deadline_s $(deadline 100) --json $OUT/real_size_gpu_0.5b_r512_ppo.json ;;
    profile) $B --algos grpo --sides ours --checkpointing selective --profile $OUT/profile_selective --deadline_s $(deadline 60) --json $OUT/real_size_gpu_0.5b_r512_profile_selective.json
      $B --algos grpo --sides ours --profile $OUT/profile_none --deadline_s $(deadline 60) --json $OUT/real_size_gpu_0.5b_r512_profile_none.json ;;
    early_stops) $B --algos grpo rloo --eos_bias 7.3 --deadline_s $(deadline 150) --json $OUT/real_size_gpu_0.5b_r512_eos7.3.json ;;
    padding_free) timeout $(( $(left) < 150 ? $(left) : 150 )) python3 bench/padding_free.py --device cuda --model-shape 0.5b --response 512 --batch 16 --reps 5 --json $OUT/padding_free_gpu_0.5b.json 2>&1 | tee $OUT/padding_free_gpu_0.5b.txt
      $B --algos grpo --sides ours --eos_bias 7.3 --lever padding_free --deadline_s $(deadline 100) --json $OUT/real_size_gpu_0.5b_r512_eos7.3_padding_free.json ;;
    shared_prefix) timeout $(( $(left) < 150 ? $(left) : 150 )) python3 bench/padding_free.py --device cuda --model-shape 0.5b --generations 8 --prompt 256 --response 512 --lengths full --batch 16 --layouts padded shared_prefix --reps 5 --json $OUT/shared_prefix_gpu_0.5b.json 2>&1 | tee $OUT/shared_prefix_gpu_0.5b.txt
      $B --algos grpo --sides ours --prompt_words 100 --deadline_s $(deadline 100) --json $OUT/real_size_gpu_0.5b_r512_p100.json
      $B --algos grpo --sides ours --prompt_words 100 --lever shared_prefix --deadline_s $(deadline 100) --json $OUT/real_size_gpu_0.5b_r512_p100_shared_prefix.json ;;
    micro_batches) $B --algos grpo --batch 32 --micro_batch 8 --eos_bias 7.3 --deadline_s $(deadline 150) --json $OUT/real_size_gpu_0.5b_r512_mb8_eos7.3.json
      $B --algos grpo --sides ours --batch 32 --micro_batch 8 --eos_bias 7.3 --lever drawn_micro_batches --deadline_s $(deadline 100) --json $OUT/real_size_gpu_0.5b_r512_mb8_eos7.3_drawn.json ;;
    cb) $B --algos grpo --sides ours --lever continuous_batching --deadline_s $(deadline 150) --json $OUT/real_size_gpu_0.5b_r512_cb.json ;;
    compiled) $B --algos grpo --sides ours --lever compiled_decoder --deadline_s $(deadline 150) --json $OUT/real_size_gpu_0.5b_r512_compiled.json ;;
    maxbatch) python3 bench/real_size.py --device cuda --dtype bf16 --tok_dir .toks/qwen151936 --model-shape 1.5b --max_batch --algos grpo --response_length 512 --batch 16 --bisect 0 $CAP --deadline_s $(deadline 90) --json $OUT/real_size_gpu_1.5b_maxbatch_full.json ;;
    maxbatch_lora) python3 bench/real_size.py --device cuda --dtype bf16 --tok_dir .toks/qwen151936 --model-shape 1.5b --max_batch --lora --algos grpo --response_length 512 --batch 32 --bisect 0 $CAP --deadline_s $(deadline 90) --json $OUT/real_size_gpu_1.5b_maxbatch_lora.json ;;
    maxbatch_trl) python3 bench/real_size.py --device cuda --dtype bf16 --tok_dir .toks/qwen151936 --model-shape 1.5b --max_batch --sides trl --algos grpo --response_length 512 --batch 32 --bisect 0 $CAP --deadline_s $(deadline 100) --json $OUT/real_size_gpu_1.5b_maxbatch_full_trl.json ;;
    maxbatch8) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/bnb/*.whl &&
      python3 bench/real_size.py --device cuda --dtype bf16 --tok_dir .toks/qwen151936 --model-shape 1.5b --max_batch --algos grpo --response_length 512 --batch 16 --bisect 0 --optim adamw_8bit --deadline_s $(deadline 90) --json $OUT/real_size_gpu_1.5b_maxbatch_full_8bit.json ;;
    *) echo "unknown stage $stage" ;;
  esac
done
echo "== [$((SECONDS - START)) s] done"
