#!/bin/bash
# Issue 37: the best K-FAC-family configurations at library defaults beside the best tuned baselines (Muon and SOAP
# included) on the four small workloads, 3 seeds, plus the default mode's damping sweep on each workload's base.
# The baselines' sweeps are the recorded ones of tta_2026-11-27_baselines (every optimizer swept there); the
# winners are re-run here, interleaved seed by seed with the K-FAC rows. Run from the repository root.
set -euo pipefail
R=benchmarks/results/tta_2026-11-28_issue37_six
B=benchmarks/results/tta_2026-11-27_baselines
COMMON='"eigen_adamw": {"update": "eigen_adam", "optimizer": "adamw", "lr_from": "adamw"}, "eigen_muon": {"update": "eigen_adam", "optimizer": "muon", "lr_from": "muon"}, "kfac_muon": {"optimizer": "muon", "lr_from": "muon"}, "d0.0001": {"damping": 0.0001}, "d0.001": {"damping": 0.001}, "d0.01": {"damping": 0.01}, "d0.1": {"damping": 0.1}'
GRAFT='"graft_d0.0001": {"grafting": "sgd", "damping": 0.0001}, "graft_d0.001": {"grafting": "sgd", "damping": 0.001}, "graft_d0.01": {"grafting": "sgd", "damping": 0.01}, "graft_d0.03": {"grafting": "sgd"}, "graft_d0.1": {"grafting": "sgd", "damping": 0.1}'
for w in digits autoencoder depthwise resnet; do
  C="{$COMMON}"
  if [ "$w" = depthwise ]; then C="{$COMMON, $GRAFT}"; fi
  python benchmarks/time_to_accuracy.py --workloads $w --seeds 0,1,2 --clock cpu --optimizers sgd,adamw,muon,soap,shampoo \
      --baselines-from $B/$w/results.json --kfac-rows none --candidates "$C" --out $R/$w
done
