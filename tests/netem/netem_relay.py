#!/usr/bin/python3
"""netem_relay: a userspace `tc netem` between two network namespaces, for tests/test_netns.sh.

Where the kernel has no sch_netem, the test joins its two namespace "hosts" with one TUN device in each
instead of a veth pair, and this process forwards the IP packets between the two TUN fds, impairing them
on the way like netem would:
  --delay MS     every packet leaves MS milliseconds after it arrived (each direction; default 5)
  --loss PCT     each packet is dropped with probability PCT percent (default 0)
  --reorder PCT  each packet is, with probability PCT percent, held EXTRA ms longer than its turn, so the
                 packets behind it overtake it (default 0)
  --extra LO,HI  the extra hold of a reordered packet, uniform in [LO, HI] ms (default 1,2)
  --cut-after S  cut the link S seconds after start; SIGUSR1 cuts it at once. A cut link drops every
                 packet, those already queued included, like an interface going down mid-flight.
                 SIGUSR2 heals it: packets pass again (TCP's retransmissions then get through).
  --seed N       seed of the loss / reorder draws (one generator per direction), so the same packet
                 sequence meets the same fate on every run (default 1)
usage: netem_relay.py [options] NS_A TUN_A NS_B TUN_B
NS_* are `ip netns` names (/run/netns/NAME); TUN_* are TUN devices made there with `ip tuntap add ... mode
tun` (persistent). The relay enters each namespace in turn (setns(2) through ctypes) to attach to its
device, comes back, prints "ready" on stdout once both are attached, then forwards until SIGTERM/SIGINT,
when it prints its counters on stderr and exits 0.

How: select() on both fds with the timeout set by the earliest due packet; a heap of (due, sequence,
destination, packet) holds packets in flight. Each packet is read, its fate drawn, and pushed with its due
time; due packets are written to the other device in due order (the sequence number keeps equal due
times in arrival order). Packets are raw IP (IFF_NO_PI), so the relay never parses them. A write that the
kernel refuses (queue full, device gone) drops the packet, as a full link would.
"""
import argparse
import ctypes
import fcntl
import heapq
import os
import random
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
MTU_MAX = 65536


def attach_tun(ns, dev):
    """Open /dev/net/tun inside namespace ns and attach it to device dev there; return the fd."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open("/run/netns/" + ns, os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns into network namespace " + ns)
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR)
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", dev.encode(), IFF_TUN | IFF_NO_PI))
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the relay's own network namespace")
    finally:
        os.close(target)
        os.close(home)
    os.set_blocking(fd, False)
    return fd


class Link:
    """One direction of the link: its own generator and counters."""

    def __init__(self, name, src, dst, seed):
        self.name, self.src, self.dst = name, src, dst
        self.rng = random.Random(seed)
        self.forwarded = self.lost = self.reordered = self.cut = self.refused = 0


def main():
    p = argparse.ArgumentParser(description="userspace netem between two TUN devices in two namespaces")
    p.add_argument("--delay", type=float, default=5.0)
    p.add_argument("--loss", type=float, default=0.0)
    p.add_argument("--reorder", type=float, default=0.0)
    p.add_argument("--extra", default="1,2")
    p.add_argument("--cut-after", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("ns_a")
    p.add_argument("tun_a")
    p.add_argument("ns_b")
    p.add_argument("tun_b")
    a = p.parse_args()
    lo, hi = (float(x) / 1000.0 for x in a.extra.split(","))
    delay, loss, reorder = a.delay / 1000.0, a.loss / 100.0, a.reorder / 100.0

    fd_a = attach_tun(a.ns_a, a.tun_a)
    fd_b = attach_tun(a.ns_b, a.tun_b)
    links = {fd_a: Link("a->b", fd_a, fd_b, a.seed * 2), fd_b: Link("b->a", fd_b, fd_a, a.seed * 2 + 1)}
    state = {"cut": False, "stop": False, "cut_at": None, "healed_at": None}
    start = time.monotonic()

    def on_cut(_sig, _frame):
        state["cut"] = True

    def on_heal(_sig, _frame):
        state["cut"] = False
        state["healed_at"] = time.monotonic()

    def on_stop(_sig, _frame):
        state["stop"] = True

    signal.signal(signal.SIGUSR1, on_cut)
    signal.signal(signal.SIGUSR2, on_heal)
    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    wake_r, wake_w = os.pipe()  # a signal wakes select() at once (PEP 475 would just resume the wait)
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    print("ready", flush=True)

    heap = []
    seq = 0
    while not state["stop"]:
        now = time.monotonic()
        if a.cut_after > 0 and now - start >= a.cut_after and state["healed_at"] is None:
            state["cut"] = True
        if state["cut"] and state["cut_at"] is None:
            state["cut_at"] = now
            for _due, _n, link, _pkt in heap:
                link.cut += 1
            heap = []
        while heap and heap[0][0] <= now:
            _due, _n, link, pkt = heapq.heappop(heap)
            try:
                os.write(link.dst, pkt)
                link.forwarded += 1
            except OSError:
                link.refused += 1
        timeout = max(0.0, heap[0][0] - now) if heap else 0.5
        if a.cut_after > 0 and not state["cut"] and state["healed_at"] is None:
            timeout = min(timeout, max(0.0, start + a.cut_after - now))
        try:
            ready, _, _ = select.select([fd_a, fd_b, wake_r], [], [], timeout)
        except InterruptedError:
            continue
        now = time.monotonic()
        for fd in ready:
            if fd == wake_r:
                while True:
                    try:
                        if not os.read(wake_r, 64):
                            break
                    except BlockingIOError:
                        break
                continue
            link = links[fd]
            for _ in range(64):  # drain a burst, but let the other side and due packets have their turn
                try:
                    pkt = os.read(fd, MTU_MAX)
                except BlockingIOError:
                    break
                except OSError:
                    break
                if state["cut"]:
                    link.cut += 1
                    continue
                if loss > 0 and link.rng.random() < loss:
                    link.lost += 1
                    continue
                due = now + delay
                if reorder > 0 and link.rng.random() < reorder:
                    due += link.rng.uniform(lo, hi)
                    link.reordered += 1
                seq += 1
                heapq.heappush(heap, (due, seq, link, pkt))

    for link in links.values():
        sys.stderr.write("netem_relay %s: forwarded %d, lost %d, reordered %d, dropped by the cut %d, refused %d\n"
                         % (link.name, link.forwarded, link.lost, link.reordered, link.cut, link.refused))
    if state["cut_at"] is not None:
        sys.stderr.write("netem_relay: link cut %.3f s after start\n" % (state["cut_at"] - start))
    if state["healed_at"] is not None:
        sys.stderr.write("netem_relay: link healed %.3f s after start\n" % (state["healed_at"] - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
