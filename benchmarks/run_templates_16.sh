#!/bin/bash
# Run from a folder holding this tree, .baseline-430b3ba/packprep, .baseline-c373f0a/packprep and .fixtures/<tokenizer>: benchmarks/RESULTS.md says how it is prepared.
# The 16-core template benchmark: this tree against main at 430b3ba (every family), then against c373f0a
# (the tree before the token-exact definition: Llama-3 fixture and Qwen3). Writes JSON and tables to $1.
set -u
out=${1:?output folder}
N=${N:-12000} LONG=${LONG:-400} NPROC=${NPROC:-16}  # conversations, long ones, processes
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
start=$(date +%s)
nproc > "$out/host.txt"; python3 -c "import sys, jinja2, tokenizers; print(sys.version, jinja2.__version__, tokenizers.__version__)" >> "$out/host.txt" 2>&1
python3 benchmarks/bench_templates.py --num-proc "$NPROC" --n "$N" --long "$LONG" --long-families qwen3 --reps 3 --families qwen3 deepseek-r1-distill-qwen phi-3.5-mini mistral-v3 llama-3.1 llama-3.2 \
  --baseline .baseline-430b3ba --fixtures .fixtures --json "$out/templates16_vs_430b3ba.json" \
  > "$out/templates16_vs_430b3ba.md" 2>&1
echo "430b3ba done after $(( $(date +%s) - start )) s" >> "$out/host.txt"
python3 benchmarks/bench_templates.py --num-proc "$NPROC" --n "$N" --long 0 --families qwen3 --reps 2 \
  --baseline .baseline-c373f0a --fixtures .fixtures --json "$out/templates16_vs_c373f0a.json" \
  > "$out/templates16_vs_c373f0a.md" 2>&1
echo "c373f0a done after $(( $(date +%s) - start )) s" >> "$out/host.txt"
