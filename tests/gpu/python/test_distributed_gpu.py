#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The distributed cases of client/python/tests/test_distributed.py on 2
CUDA GPUs with NCCL (spawned ranks, one GPU each, the CUDA backend of
libaoq): DDP (bit-identical replicas, equal to DDP + torch AdamW), the shared
state (replica group), no_sync,
DCP save at 2 ranks and load at 1, two daemons, FSDP2 and its DCP round
trip.  The rank-killed case runs in the CPU suite only: NCCL's watchdog
aborts the surviving process when a peer dies, so there is no survivor to
check.  With one GPU both ranks share it over gloo (--one-gpu: DDP, the
shared state and its resume after a rank died, no_sync, two daemons; FSDP2
and DCP need NCCL and 2 GPUs).
Usage: test_distributed_gpu.py [--cases a,b]; exit 77 without a GPU.
tests/gpu/python/run.sh runs it."""
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "..", "client", "python", "tests"))
import test_distributed  # noqa: E402

if __name__ == "__main__":
    argv, skip = [], False
    for a in sys.argv[1:]:          # run.sh passes --device cuda:N to every test: the ranks take GPUs 0 and 1
        if skip or a.startswith("--device"):
            skip = a == "--device"
            continue
        argv.append(a)
    import torch
    one = torch.cuda.is_available() and torch.cuda.device_count() == 1
    if one and "--one-gpu" not in argv:
        # One GPU: both ranks on it with gloo (NCCL needs a GPU per rank);
        # FSDP2 and DCP need NCCL's collectives, so they wait for 2 GPUs.
        argv.append("--one-gpu")
    if not any(a.startswith("--cases") for a in argv):
        argv += ["--cases", "ddp,shared,shared_resume,nosync,nodes" if one
                  else "ddp,shared,nosync,dcp,nodes,fsdp,fsdp_dcp"]
    sys.argv = [sys.argv[0], "--device", "cuda"] + argv
    sys.exit(test_distributed.main())
