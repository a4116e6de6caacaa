# shellcheck shell=bash disable=SC2034  # sourced: CONSTRAINTS and VENV are the caller's
# Sourced by setup_env.sh and run_tests.sh: which torch to test on, from MSF_TORCH.
#   MSF_TORCH unset or "current" -> .venv with scripts/constraints.txt (the pinned current torch, CPU build)
#   MSF_TORCH=2.7                -> .venv-torch27 with scripts/constraints-torch27.txt (torch 2.7.1 +
#                                   transformers 4.57.x: what MindSpeed-MM and torch_npu pin on Ascend)
# MSF_VENV overrides the venv folder either way.
MSF_TORCH=${MSF_TORCH:-current}
if [ "$MSF_TORCH" = current ]; then
  CONSTRAINTS=scripts/constraints.txt
  VENV=${MSF_VENV:-.venv}
else
  tag=${MSF_TORCH//./}
  CONSTRAINTS=scripts/constraints-torch$tag.txt
  VENV=${MSF_VENV:-.venv-torch$tag}
  if [ ! -f "$CONSTRAINTS" ]; then
    echo "MSF_TORCH=$MSF_TORCH: no $CONSTRAINTS (use MSF_TORCH=2.7, or leave it unset for the current torch)" >&2
    exit 2
  fi
fi
