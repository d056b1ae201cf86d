#!/usr/bin/env bash
# Run the stack tests (pytest marker `stacks`): each stack's real PyPI package, in its own venv,
# on CPU, with a tiny random Llama. Usage, from the repo root:
#     tests/stacks/run.sh [torchtune|llamafactory|axolotl|megatron ...]    (default: every tests/stacks/test_*.py)
# Venvs go to ${STACK_VENVS:-.stack-venvs}/NAME: the local CPU torch first, then packprep's own
# dependencies, then the stack last, so that its pins (transformers, datasets, trl...) win.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
VENVS=${STACK_VENVS:-$REPO/.stack-venvs}
STACKS=${*:-$(cd "$REPO/tests/stacks" && ls test_*.py | sed "s/^test_//; s/\.py$//")}

install() {  # install NAME PIP-ARGS...
    local venv=$VENVS/$1; shift
    [ -x "$venv/bin/python" ] && return
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.13.0
    "$venv/bin/pip" install -q "$REPO" pytest omegaconf
    "$venv/bin/pip" install -q "$@"
}

for stack in $STACKS; do
    case $stack in
        torchtune)    install torchtune torchtune==0.6.1 torchao==0.15.0 ;;  # torchao 0.16+ moved nf4tensor
        # its torchvision/torchaudio need a matching torch; the newest matching pair on PyPI is 2.11 (a CUDA
        # build, which runs on CPU). Left unpinned, pip picks torch 2.15 with torchaudio 2.11: import fails.
        llamafactory) install llamafactory llamafactory==0.9.5 torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0 ;;
        axolotl)      install axolotl axolotl==0.19.0 ;;
        # its hard deps (transformer-engine, mamba-ssm) build only with CUDA; its data path needs none of them
        megatron)     install megatron --no-deps megatron-bridge==0.3.1
                      "$VENVS/megatron/bin/pip" install -q "megatron-core>=0.15.0a0,<0.17" "transformers<5" \
                          datasets accelerate "hydra-core>1.3,<=1.3.2" pyyaml tqdm rich six regex ;;
        *) echo "unknown stack $stack" >&2; exit 2 ;;
    esac
    (cd "$REPO" && AXOLOTL_DO_NOT_TRACK=1 PYTHONPATH=$REPO "$VENVS/$stack/bin/python" -m pytest -q \
        -p no:cacheprovider -m stacks "tests/stacks/test_$stack.py" -s)
done
