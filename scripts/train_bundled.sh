#!/usr/bin/env bash
# The recipe of the bundled model, from nothing: tokenizer, data, config, `refusion train`.
#
#   scripts/train_bundled.sh [MODE]    MODE defaults to refusion-ft-mix-longer-lowlr, the shipped ReFusion model
#   scripts/train_bundled.sh ar        AR pre-training: 4000 steps of next-token training
#   scripts/train_bundled.sh refusion  ar's step-2250 checkpoint, then 8000 steps of the
#                                      paper's ReFusion objective (10250 in all, as the baseline)
#   scripts/train_bundled.sh ar-long   the AR baseline of Table 1: ar's final model, then 6250
#                                      more AR steps (warm restart at lr 1e-3; 10250 in all)
#   scripts/train_bundled.sh refusion-short  ar's step-2250 checkpoint + 1750 ReFusion steps:
#                                      the same 4000-step budget as `ar`
#   scripts/train_bundled.sh scratch   ReFusion from random weights, 4000 steps (a reference)
#   scripts/train_bundled.sh refusion-ft-long  the same over 8000 ReFusion steps: the budget of
#                                      the shipped route's first stage, from the finished AR model
#   scripts/train_bundled.sh ship      copy the two shipped models into the package:
#                                      runs/bundled-refusion-ft-mix-longer-lowlr -> refusion/bundled/refusion-tiny,
#                                      runs/bundled-ar-long -> refusion/bundled/ar-tiny (their
#                                      decode_config.json files stay; they are written by hand)
#   scripts/train_bundled.sh refusion-ft  the paper's setting: the finished AR baseline
#                                      (ar-long) + 4000 ReFusion steps, every 250th step's
#                                      checkpoint kept for the learning curve
#   scripts/train_bundled.sh refusion-ft-boundary  refusion-ft with --boundary-labels (AR labels
#                                      across slot boundaries too, beyond the paper)
#   scripts/train_bundled.sh refusion-ft-mix  refusion-ft-boundary with --ar-mix 0.25 (a quarter
#                                      of the examples plain next-token ones, beyond the paper)
#   scripts/train_bundled.sh refusion-ft-mix-long  the same over 8000 ReFusion steps (the model
#                                      shipped before)
#   scripts/train_bundled.sh refusion-ft-mix-longer-lowlr  refusion-ft-mix-long continued for 4000
#                                      more steps of the same objective at lr 3e-4: the shipped model
#   scripts/train_bundled.sh refusion-ft-mix-longer  the same continued for 6000 steps with a
#                                      warm restart at lr 1e-3 (a reference)
#
# As in the paper, the shipped ReFusion model is made from a finished autoregressive model:
# the AR baseline (`ar` then `ar-long`, 10250 steps of 16 examples) plus 8000 ReFusion
# steps with two objective options beyond the paper (`refusion-ft-mix-long`), then 4000 more
# at a lower rate (`refusion-ft-mix-longer-lowlr`). From nothing:
#   ar, ar-long, refusion-ft-mix-long, refusion-ft-mix-longer-lowlr, ship
# The other ReFusion modes are references: `refusion` the paper's objective at the AR
# baseline's own budget, `refusion-ft` and `refusion-ft-boundary` the paper's objective and
# boundary labels alone from the same start, `refusion-ft-mix` the shipped recipe over 4000
# steps (the model shipped first). Everything is seeded; a run resumes from its latest
# checkpoint when its output directory already holds one. The bundled copy's
# model.safetensors is float32, <= 16 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-refusion-ft-mix-longer-lowlr}"
work=runs/bundled-data
py=.venv/bin/python
mkdir -p "$work"
[ -f "$work/tokenizer/tokenizer.json" ] || $py -m refusion.tasks tokenizer "$work/tokenizer" --vocab-size 1024
[ -f "$work/train.jsonl" ] || $py -m refusion.tasks data train 200000 "$work/train.jsonl" --seed 0
vocab=$($py -c "from transformers import AutoTokenizer as T; print(len(T.from_pretrained('$work/tokenizer')))")
cat > "$work/config.json" <<JSON
{
  "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
  "vocab_size": $vocab, "hidden_size": 256, "intermediate_size": 768,
  "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64,
  "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
  "tie_word_embeddings": true, "hidden_act": "silu", "torch_dtype": "float32"
}
JSON
train() {
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" .venv/bin/refusion train --data "$work/train.jsonl" --max-length 320 \
    --batch-size 16 --min-lr-ratio 0.05 --weight-decay 0.1 --eval-every 500 --save-every 250 --log-every 25 \
    --seed 0 --resume "$@"
}
case "$what" in
  ar)  # keep the step-2250 checkpoint: ReFusion starts from it
    train --init-config "$work/config.json" --tokenizer "$work/tokenizer" --out runs/bundled-ar --objective ar \
      --max-steps 4000 --lr 3e-3 --warmup-steps 100 --keep-checkpoints 0 ;;
  refusion-short)
    base=runs/bundled-ar/checkpoints/step-00002250
    [ -f "$base/model.safetensors" ] || { echo "run '$0 ar' first (needs $base)" >&2; exit 2; }
    train --model "$base" --out runs/bundled-refusion --objective refusion \
      --max-steps 1750 --lr 1.5e-3 --warmup-steps 50 --keep-checkpoints 2 ;;
  refusion)
    base=runs/bundled-ar/checkpoints/step-00002250
    [ -f "$base/model.safetensors" ] || { echo "run '$0 ar' first (needs $base)" >&2; exit 2; }
    train --model "$base" --out runs/bundled-refusion-long --objective refusion \
      --max-steps 8000 --lr 1.5e-3 --warmup-steps 50 --keep-checkpoints 2 ;;
  ar-long)
    [ -f runs/bundled-ar/model.safetensors ] || { echo "run '$0 ar' first" >&2; exit 2; }
    train --model runs/bundled-ar --out runs/bundled-ar-long --objective ar --seed 1 \
      --max-steps 6250 --lr 1e-3 --warmup-steps 100 --keep-checkpoints 2 ;;
  refusion-ft)
    [ -f runs/bundled-ar-long/model.safetensors ] || { echo "run '$0 ar-long' first" >&2; exit 2; }
    train --model runs/bundled-ar-long --out runs/bundled-refusion-ft --objective refusion \
      --max-steps 4000 --lr 1e-3 --warmup-steps 50 --keep-checkpoints 0 ;;
  refusion-ft-boundary)
    [ -f runs/bundled-ar-long/model.safetensors ] || { echo "run '$0 ar-long' first" >&2; exit 2; }
    train --model runs/bundled-ar-long --out runs/bundled-refusion-ft-boundary --objective refusion \
      --max-steps 4000 --lr 1e-3 --warmup-steps 50 --keep-checkpoints 0 --boundary-labels ;;
  refusion-ft-mix)
    [ -f runs/bundled-ar-long/model.safetensors ] || { echo "run '$0 ar-long' first" >&2; exit 2; }
    train --model runs/bundled-ar-long --out runs/bundled-refusion-ft-mix --objective refusion \
      --max-steps 4000 --lr 1e-3 --warmup-steps 50 --keep-checkpoints 0 --boundary-labels --ar-mix 0.25 ;;
  refusion-ft-mix-long)
    [ -f runs/bundled-ar-long/model.safetensors ] || { echo "run '$0 ar-long' first" >&2; exit 2; }
    train --model runs/bundled-ar-long --out runs/bundled-refusion-ft-mix-long --objective refusion \
      --max-steps 8000 --lr 1e-3 --warmup-steps 50 --keep-checkpoints 0 --boundary-labels --ar-mix 0.25 ;;
  refusion-ft-mix-longer)
    [ -f runs/bundled-refusion-ft-mix-long/model.safetensors ] || { echo "run '$0 refusion-ft-mix-long' first" >&2; exit 2; }
    train --model runs/bundled-refusion-ft-mix-long --out runs/bundled-refusion-ft-mix-longer --objective refusion \
      --seed 2 --max-steps 6000 --lr 1e-3 --warmup-steps 50 --keep-checkpoints 0 --boundary-labels --ar-mix 0.25 ;;
  refusion-ft-mix-longer-lowlr)
    [ -f runs/bundled-refusion-ft-mix-long/model.safetensors ] || { echo "run '$0 refusion-ft-mix-long' first" >&2; exit 2; }
    train --model runs/bundled-refusion-ft-mix-long --out runs/bundled-refusion-ft-mix-longer-lowlr --objective refusion \
      --seed 3 --max-steps 4000 --lr 3e-4 --warmup-steps 50 --keep-checkpoints 0 --boundary-labels --ar-mix 0.25 ;;
  refusion-ft-long)
    [ -f runs/bundled-ar-long/model.safetensors ] || { echo "run '$0 ar-long' first" >&2; exit 2; }
    train --model runs/bundled-ar-long --out runs/bundled-refusion-ft-long --objective refusion \
      --max-steps 8000 --lr 1e-3 --warmup-steps 50 --keep-checkpoints 0 ;;
  scratch)
    train --init-config "$work/config.json" --tokenizer "$work/tokenizer" --out runs/bundled-refusion-scratch \
      --objective refusion --max-steps 4000 --lr 3e-3 --warmup-steps 100 --keep-checkpoints 2 ;;
  ship)
    for pair in bundled-refusion-ft-mix-longer-lowlr:refusion-tiny bundled-ar-long:ar-tiny; do
      run="runs/${pair%%:*}" dest="refusion/bundled/${pair##*:}"
      [ -f "$run/model.safetensors" ] || { echo "$run has no final model: train it first" >&2; exit 2; }
      mkdir -p "$dest"
      cp "$run"/{config.json,model.safetensors,tokenizer.json,tokenizer_config.json,chat_template.jinja} "$dest"/
    done ;;
  *) echo "usage: $0 ar|refusion|ar-long|refusion-short|refusion-ft|refusion-ft-long|refusion-ft-boundary|refusion-ft-mix|refusion-ft-mix-long|refusion-ft-mix-longer|refusion-ft-mix-longer-lowlr|scratch|ship" >&2; exit 2 ;;
esac
