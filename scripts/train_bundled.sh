#!/usr/bin/env bash
# The recipe of the bundled model, from nothing: tokenizer, data, config, `refusion train`.
#
#   scripts/train_bundled.sh [OBJECTIVE] [OUT] [STEPS]
#     OBJECTIVE  refusion (default: the bundled model) or ar (the AR baseline: same
#                data, architecture, size and budget)
#     OUT        output directory (default: runs/bundled-OBJECTIVE)
#     STEPS      optimizer steps (default: 4000)
#
# Everything is seeded; rerunning it reproduces the model on the same machine. It resumes
# from its latest checkpoint when OUT already holds one. The bundled copy is OUT itself,
# copied to refusion/bundled/refusion-tiny/ (model.safetensors in float32 <= 16 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
objective="${1:-refusion}"
out="${2:-runs/bundled-$objective}"
steps="${3:-4000}"
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
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" .venv/bin/refusion train \
  --init-config "$work/config.json" --tokenizer "$work/tokenizer" --data "$work/train.jsonl" \
  --out "$out" --objective "$objective" --max-length 320 \
  --batch-size 16 --max-steps "$steps" --lr 3e-3 --min-lr-ratio 0.05 --warmup-steps 100 \
  --weight-decay 0.1 --eval-every 500 --save-every 250 --keep-checkpoints 2 --log-every 25 \
  --seed 0 --resume
