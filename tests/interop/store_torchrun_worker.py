"""A torchrun worker for part (c) of store_interop.py: rank 0 is this Python process with the store torch's
own env:// rendezvous builds under torchrun (the agent's TCPStore wrapped in PrefixStore("/worker/attempt_N"),
torch/distributed/rendezvous.py); every other rank execs `store_peer torchrun`, which joins the same store
with ddp.h's client. They exchange keys both ways.

usage (under torchrun): store_torchrun_worker.py PATH/TO/store_peer
"""
import datetime
import os
import sys

rank = int(os.environ["RANK"])
if rank != 0:
    os.execv(sys.argv[1], [sys.argv[1], "torchrun"])

import torch  # noqa: E402 (only rank 0 needs torch)
import torch.distributed as dist  # noqa: E402

assert os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True", "expected torchrun's agent store"
world = int(os.environ["WORLD_SIZE"])
# torch 2.x as Debian builds it (no libuv) refuses even a client unless told use_libuv=False
extra = {"use_libuv": False} if int(torch.__version__.split(".")[0]) >= 2 else {}
tcp = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
                    datetime.timedelta(seconds=60), **extra)
store = dist.PrefixStore("/worker/attempt_%s" % os.environ["TORCHELASTIC_RESTART_COUNT"], tcp)
store.set("probe/0", b"rank 0\x00python")
for r in range(1, world):
    got = store.get("probe/%d" % r)
    assert got == b"rank %d\x00ddp.h" % r, "probe/%d holds %r" % (r, got)
n = store.add("probe_count", 1)
store.set("done/0", "1")
store.wait(["done/%d" % r for r in range(world)])
assert store.add("probe_count", 0) == world, "probe_count %d" % store.add("probe_count", 0)
print("rank 0 (python): exchanged keys with %d ddp.h worker(s) through torchrun's agent store" % (world - 1))
