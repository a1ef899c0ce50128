"""torch's TCPStore against ddp.h's store, both ways: torch 1.13 (run by tests/test_interop_store.sh) and
torch 2.x (run by tests/test_interop_torch_current.sh in the chroot of tools/torch-current.sh).

(a) torch's client against OUR server: one scenario (set/get with binary values, add, compare_set, num_keys,
    delete_key, wait, a wait timeout, a get that blocks until another process sets the key, concurrent adds,
    a large value, raw CHECK queries, a PrefixStore key read back under its wire name) runs against torch's
    own server and against ddp.h's server; every observation must be the same, and match what is expected.
(b) OUR client against torch's server: store_peer client does its steps, then this side checks the keys it
    left, in torch's layout ("/" + key, and PrefixStore("/worker/attempt_0")).
(c) Under a real torchrun (its agent serves the store): rank 0 is a Python worker using the store torch's
    env:// rendezvous builds, ranks 1 and 2 are ddp.h clients (store_torchrun_worker.py); they exchange keys.
    torch 2.x: Debian's torch 2.x has no libuv and its torchrun fails before any worker starts, so this
    script plays torchrun's agent itself: TCPStore(is_master=True, use_libuv=False) on MASTER_PORT, and the
    workers started with torchrun's environment (TORCHELASTIC_USE_AGENT_STORE=True, RANK, ...).
(d) torch 2.x only, with a second argument (tests/progs/allreduce built from ddp.h): whole ddp.h programs
    (ddp_init + all_reduce) as torchrun's workers against that agent store, one node of 3 ranks and two
    nodes of 2 (GROUP_RANK 0 and 1).

usage: store_interop.py PATH/TO/store_peer [PATH/TO/allreduce]
"""
import datetime
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

HOST = "127.0.0.1"
T = datetime.timedelta(seconds=30)
V2 = int(torch.__version__.split(".")[0]) >= 2  # torch 2.x's protocol: VALIDATE first, query types moved up
VALIDATE = b"\x00" + struct.pack("=I", 0x3C85F7CE) if V2 else b""
Q_CHECK, Q_WAIT, Q_GET = (b"\x05", b"\x06", b"\x03") if V2 else (b"\x04", b"\x05", b"\x02")


def master_store(port):
    """torch's own server: the classic one on torch 2.x (Debian's torch 2.x is built without libuv)."""
    if V2:
        return dist.TCPStore(HOST, port, None, True, T, use_libuv=False)
    return dist.TCPStore(HOST, port, None, True, T)


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def client(port, timeout=T):
    if V2:  # Debian's torch 2.x refuses even a client without use_libuv=False
        return dist.TCPStore(HOST, port, 1, False, timeout, use_libuv=False)
    return dist.TCPStore(HOST, port, 1, False, timeout)


def c_pattern(n):
    return bytes(0 if i % 3 == 0 else (i * 7) % 256 for i in range(n))


def py_pattern(n):
    return bytes(0 if i % 4 == 0 else (i * 13) % 256 for i in range(n))


def raw(port, request, reply_len):
    """Send request bytes, read reply_len bytes back."""
    with socket.create_connection((HOST, port), timeout=10) as s:
        s.sendall(VALIDATE + request)
        got = b""
        while len(got) < reply_len:
            chunk = s.recv(reply_len - len(got))
            if not chunk:
                raise RuntimeError("connection closed after %d of %d reply bytes" % (len(got), reply_len))
            got += chunk
        return got


def string(b):
    return struct.pack("=Q", len(b)) + b


def raw_check(port, keys):
    return raw(port, Q_CHECK + struct.pack("=Q", len(keys)) + b"".join(string(k) for k in keys), 1)[0]


def raw_get(port, key):
    """WAIT then GET, as torch's client does, by hand."""
    req = VALIDATE + Q_WAIT + struct.pack("=Q", 1) + string(key) + Q_GET + string(key)
    with socket.create_connection((HOST, port), timeout=10) as s:
        s.sendall(req)
        data = b""
        while len(data) < 9 or len(data) < 9 + struct.unpack("=Q", data[1:9])[0]:
            chunk = s.recv(65536)
            if not chunk:
                raise RuntimeError("connection closed during a raw get of %r" % key)
            data += chunk
        assert data[0] == 0, "WAIT answered %d" % data[0]
        return data[9:]


def late_setter(port):
    s = client(port)
    time.sleep(0.3)
    s.set("late", b"arrived")


def adder(port, n):
    s = client(port)
    for _ in range(n):
        s.add("cnt", 1)


def scenario(port):
    """What a torch client observes doing a fixed series of steps against the server on port."""
    seen = []
    s = client(port)
    s.set("a", b"\x00\x01\x00zz")
    seen.append(("get a", s.get("a")))
    seen.append(("add n 5", s.add("n", 5)))
    seen.append(("add n -7", s.add("n", -7)))
    seen.append(("get n", s.get("n")))
    s.set("t", "12abc")
    seen.append(("add t 1", s.add("t", 1)))
    seen.append(("cas c '' one", s.compare_set("c", "", "one")))
    seen.append(("cas c x two", s.compare_set("c", "x", "two")))
    seen.append(("cas c one three", s.compare_set("c", "one", "three")))
    seen.append(("cas c2 exp des", s.compare_set("c2", "exp", "des")))
    seen.append(("num_keys", s.num_keys()))
    seen.append(("delete a", s.delete_key("a")))
    seen.append(("delete a again", s.delete_key("a")))
    s.wait(["n", "t"])
    seen.append(("wait n t", "ok"))
    try:
        s.wait(["missing"], datetime.timedelta(milliseconds=300))
        seen.append(("wait missing", "returned"))
    except RuntimeError:
        seen.append(("wait missing", "timeout"))
    s2 = client(port)  # the first client's connection still has a WAIT pending: use a fresh one
    late = threading.Thread(target=late_setter, args=(port,))  # torch's store calls release the GIL
    late.start()
    seen.append(("get late", s2.get("late")))
    late.join()
    adders = [threading.Thread(target=adder, args=(port, 20)) for _ in range(3)]
    for t in adders:
        t.start()
    for t in adders:
        t.join()
    seen.append(("cnt", s2.get("cnt")))
    big = bytes((i * 31 + 7) % 251 for i in range(5 << 20))
    s2.set("big", big)
    seen.append(("big round trip", s2.get("big") == big))
    seen.append(("raw CHECK n zz", raw_check(port, [b"/n", b"/zz"])))
    seen.append(("raw CHECK n t", raw_check(port, [b"/n", b"/t"])))
    p = dist.PrefixStore("/worker/attempt_0", s2)
    p.set("wk", "v")
    seen.append(("prefix wire name", raw_get(port, b"//worker/attempt_0/wk")))
    seen.append(("prefix add", p.add("wk_n", 3)))
    seen.append(("num_keys end", s2.num_keys()))
    return seen


EXPECTED = [
    ("get a", b"\x00\x01\x00zz"),
    ("add n 5", 5),
    ("add n -7", -2),
    ("get n", b"-2"),
    ("add t 1", 13),
    ("cas c '' one", b"one"),
    ("cas c x two", b"one"),
    ("cas c one three", b"three"),
    ("cas c2 exp des", b"exp"),
    ("num_keys", 5),  # init/ a n t c
    ("delete a", True),
    ("delete a again", False),
    ("wait n t", "ok"),
    ("wait missing", "timeout"),
    ("get late", b"arrived"),
    ("cnt", b"60"),
    ("big round trip", True),
    ("raw CHECK n zz", 1),
    ("raw CHECK n t", 0),
    ("prefix wire name", b"v"),
    ("prefix add", 3),
    ("num_keys end", 9),  # init/ n t c late cnt big wk wk_n
]


def part_a(peer):
    # torch's own server, in this process
    port = free_port()
    master = master_store(port)
    reference = scenario(port)
    del master
    # ddp.h's server
    port = free_port()
    server = subprocess.Popen([peer, "serve", str(port)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready", "store_peer serve did not start"
    ours = scenario(port)
    client(port).set("stop", "1")
    assert server.wait(timeout=30) == 0, "store_peer serve failed"
    failed = False
    for i, (ref, got) in enumerate(zip(reference, ours)):
        want = EXPECTED[i] if i < len(EXPECTED) else None
        ok = ref == got and ref == want
        failed |= not ok
        print("%-18s torch server %-16r ddp.h server %-16r %s" % (ref[0], ref[1], got[1], "ok" if ok else
                                                                    "DIFFERENT (expected %r)" % (want,)))
    if len(reference) != len(ours) or len(reference) != len(EXPECTED):
        failed = True
        print("different numbers of steps: torch %d, ddp.h %d, expected %d" % (len(reference), len(ours),
                                                                                len(EXPECTED)))
    return not failed


def part_b(peer):
    port = free_port()
    master = master_store(port)
    master.set("py_bin", py_pattern(257))
    master.set("c_counter", "10")
    master.set("py_del", "x")
    pw = dist.PrefixStore("/worker/attempt_0", master)
    pw.set("py_wk", "py-wk")
    proc = subprocess.Popen([peer, "client", str(port)], stdout=subprocess.PIPE, text=True)
    master.wait(["c_waiting"])
    master.set("py_late", "late")
    out, _ = proc.communicate(timeout=60)
    checks = [
        ("ddp.h client exit code", proc.returncode, 0),
        ("c_done", master.get("c_done"), b"1"),
        ("c_bin", master.get("c_bin"), c_pattern(300)),
        ("c_counter", master.get("c_counter"), b"13"),
        ("c_cas", master.get("c_cas"), b"second"),
        ("py_del deleted", master.delete_key("py_del"), False),
        ("c_after_timeout", master.get("c_after_timeout"), b"ok"),
        ("PrefixStore wk", pw.get("wk"), b"worker-key"),
        ("PrefixStore wk_count", pw.add("wk_count", 0), 2),
        ("raw wire name", raw_get(port, b"//worker/attempt_0/wk"), b"worker-key"),
        ("num_keys seen by ddp.h + c_done", out.split()[-1] if out.split() else "?", str(master.num_keys() - 1)),
    ]
    failed = False
    for name, got, want in checks:
        ok = got == want
        failed |= not ok
        print("%-32s %-24r %s" % (name, got if len(repr(got)) < 40 else repr(got)[:36] + "...",
                                  "ok" if ok else "expected %r" % (want,)))
    del master
    return not failed


def agent_env(port, rank, world, local_rank, local_world, group_rank):
    env = dict(os.environ, MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
               LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_world), GROUP_RANK=str(group_rank),
               ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True",
               TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_RUN_ID="none", TORCHELASTIC_MAX_RESTARTS="0")
    return env


def run_as_agent(cmd, nodes, per_node):
    """What torchrun's agent does for the workers' store, by hand: a TCPStore server on MASTER_PORT
    (use_libuv=False), workers started with its environment. Returns (all exited 0, their output)."""
    port = free_port()
    master = master_store(port)
    world = nodes * per_node
    procs = [subprocess.Popen(cmd, env=agent_env(port, r, world, r % per_node, per_node, r // per_node),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = []
    ok = True
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outs.append(out)
        ok &= p.returncode == 0
    del master
    return ok, "".join(outs)


def part_c(peer):
    if V2:
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "store_torchrun_worker.py")
        ok, out = run_as_agent([sys.executable, worker, os.path.abspath(peer)], 1, 3)
        lines = [l for l in out.splitlines() if "exchanged keys" in l]
        print("\n".join(lines))
        if not ok or len(lines) != 3:
            print(out)
            print("%d of 3 workers reported success" % len(lines))
            return False
        return True
    port = free_port()
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "store_torchrun_worker.py")
    # torch 1.13 on Python 3.11 needs --redirects/--tee: their default "0" makes Std.from_str return None
    # (torch/distributed/elastic/multiprocessing/api.py: 3.11 no longer iterates the 0 flag Std.NONE);
    # underscore spellings only (torch/distributed/run.py of 1.13: --nproc_per_node, --master_port)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--redirects", "1", "--tee", "1",
           "--master_port", str(port), worker, os.path.abspath(peer)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    lines = [l for l in proc.stdout.splitlines() if "exchanged keys" in l]
    print("\n".join(lines))
    ok = proc.returncode == 0 and len(lines) == 3
    if not ok:
        print(proc.stdout)
        print("torchrun exited with %d; %d of 3 workers reported success" % (proc.returncode, len(lines)))
    return ok


def part_d(allreduce):
    ok = True
    for nodes, per_node in ((1, 3), (2, 2)):
        good, out = run_as_agent([os.path.abspath(allreduce)], nodes, per_node)
        lines = [l for l in out.splitlines() if "all_reduce ok" in l]
        print("%d node(s) of %d: %d of %d ddp.h ranks did all_reduce" % (nodes, per_node, len(lines), nodes * per_node))
        if not good or len(lines) != nodes * per_node:
            print(out)
            ok = False
    return ok


def main():
    peer = sys.argv[1]
    print("torch", __import__("torch").__version__)
    print("== (a) torch's TCPStore client against torch's server and against ddp.h's server")
    ok_a = part_a(peer)
    print("== (b) ddp.h's client against torch's TCPStore server")
    ok_b = part_b(peer)
    print("== (c) torchrun's agent store shared by a torch worker and ddp.h workers")
    ok_c = part_c(peer)
    ok = ok_a and ok_b and ok_c
    if V2 and len(sys.argv) > 2:
        print("== (d) ddp.h programs (ddp_init, all_reduce) as torchrun's workers on torch 2.x's agent store")
        ok = part_d(sys.argv[2]) and ok
    print("store interop:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
