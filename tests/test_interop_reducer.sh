#!/usr/bin/env bash
# The reducer against torch 1.13's DistributedDataParallel (gloo, 2 ranks): the same MLP from the same
# initial weights on the same data, 20 SGD steps, final weights within 1e-5 (plain DDP; no_sync accumulation
# with gradient_as_bucket_view and small buckets) and 1e-3 (fp16_compress_hook vs comm_dtype DDP_F16: one f16
# unit, see reducer_torch.py), uneven inputs on 3 ranks (`with ddp.join():` against ddp_reducer_join, one rank
# without data, no_sync steps; and throw_on_early_termination against join_fail_early) within 1e-5, ZeRO
# (ZeroRedundancyOptimizer with AdamW against zero_stage = 1 + AdamW on the shards: weights, and
# consolidate_state_dict's exp_avg / exp_avg_sq against ddp_reducer_consolidate_state's, within 1e-4;
# measured 1.3e-5 / 1.8e-5), ZeRO-1 with uneven inputs (ZeroRedundancyOptimizer(AdamW) + `with Join([ddp,
# opt]):` against zero_stage = 1 and the ddp_reducer_join_step loop; torch's join hook patched to give the
# joined rank the averaged gradient, see reducer_torch.py) within 1e-4 (measured 9.9e-6), ZeRO with find_unused_parameters=True (two heads, one unused on a rank or on
# both; set_to_none=True, so AdamW skips a .grad of None) against zero_stage = 1 and 2 with find_unused_parameters
# and ddp_reducer_param_used within 1e-4, and the bucket layouts against torch's own dist._compute_bucket_assignment_by_size.
# Skips (exit 77) only when /usr/bin/python3 cannot import torch.
set -eu
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
tl_need_python "torch.distributed, numpy" "python3-torch python3-numpy"
tl_cc "$BUILD/interop/reducer_peer" tests/interop/reducer_peer.c
tl_tmpdir test_interop_reducer
"$PY" tests/interop/reducer_torch.py "$BUILD/interop/reducer_peer" "$T"
