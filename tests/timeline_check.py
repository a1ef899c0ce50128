"""Checks a ddp.h timeline file (tests/test_timeline.sh):

    python3 tests/timeline_check.py FILE [--ranks N] [--pids 0,1] [--reducer STATS] [--names a,b,...]
                                         [--bcast-ordered]

Always: the file is JSON with a traceEvents list; every event has name (str), ph (X, B, E or M), pid and
tid (int); X, B and E have ts (a number) and X a dur >= 0; B and E balance on every lane (pid, tid) in file
order, their times never go back on a lane; the X events of a lane nest or are disjoint (what a trace
viewer draws as a stack). --ranks N: the pids are exactly 0..N-1, each named "rank R" by metadata.
--pids: the pids are exactly these. --reducer STATS: a file of lines "rank R buckets B passes P" (printed by
tests/progs/timeline_job.c from the reducer's statistics): rank R shows B reducer.bucket events and P
synchronised reducer.backward passes (args.sync 1), each bucket inside one of its passes, and a
reducer.wait inside each synchronised pass. --names: each name occurs on every rank. --bcast-ordered: the
last broadcast starts on rank 0 before it ends on every other rank (on the shared clock)."""
import json
import sys


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def main():
    args = sys.argv[1:]
    if not args:
        fail("usage: timeline_check.py FILE [options]")
    path, opts = args[0], {}
    i = 1
    while i < len(args):
        if args[i] == "--bcast-ordered":
            opts["bcast"] = True
            i += 1
        else:
            opts[args[i][2:]] = args[i + 1]
            i += 2
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{path} is not JSON: {e}")
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        fail("no traceEvents list")
    lanes, stacks, xs, names_of, by_pid = {}, {}, {}, {}, {}
    for k, e in enumerate(events):
        for key, kind in (("name", str), ("ph", str), ("pid", int), ("tid", int)):
            if not isinstance(e.get(key), kind):
                fail(f"event {k} has no {key} of type {kind.__name__}: {e}")
        ph = e["ph"]
        if ph not in ("X", "B", "E", "M"):
            fail(f"event {k}: ph {ph!r}")
        if ph == "M":
            if e["name"] == "process_name":
                names_of[e["pid"]] = e["args"]["name"]
            continue
        if not isinstance(e.get("ts"), (int, float)):
            fail(f"event {k} has no ts: {e}")
        lane = (e["pid"], e["tid"])
        by_pid.setdefault(e["pid"], []).append(e)
        if ph == "X":
            if not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0:
                fail(f"event {k}: X without a dur >= 0: {e}")
            xs.setdefault(lane, []).append(e)
            continue
        if e["ts"] < lanes.get(lane, float("-inf")):
            fail(f"event {k}: {ph} at {e['ts']} goes back in time on lane {lane}")
        lanes[lane] = e["ts"]
        st = stacks.setdefault(lane, [])
        if ph == "B":
            st.append(e)
        elif not st:
            fail(f"event {k}: E without B on lane {lane}")
        else:
            st.pop()
    for lane, st in stacks.items():
        if st:
            fail(f"lane {lane}: {len(st)} B without E ({st[-1]['name']})")
    for lane, evs in xs.items():  # nest or be disjoint; 1 ns of slack for the rounding of ts and dur
        open_ = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while open_ and open_[-1]["ts"] + open_[-1]["dur"] <= e["ts"] + 1e-3:
                open_.pop()
            if open_ and e["ts"] + e["dur"] > open_[-1]["ts"] + open_[-1]["dur"] + 1e-3:
                fail(f"lane {lane}: {e['name']} [{e['ts']}, +{e['dur']}] overlaps {open_[-1]['name']} "
                     f"[{open_[-1]['ts']}, +{open_[-1]['dur']}] without nesting")
            open_.append(e)
    pids = sorted(by_pid)
    if "ranks" in opts:
        want = list(range(int(opts["ranks"])))
        if pids != want:
            fail(f"pids {pids}, want {want}")
        for r in want:
            if names_of.get(r) != f"rank {r}":
                fail(f"pid {r} is named {names_of.get(r)!r}, want 'rank {r}'")
    if "pids" in opts:
        want = sorted(int(x) for x in opts["pids"].split(","))
        if pids != want:
            fail(f"pids {pids}, want {want}")
    for name in opts.get("names", "").split(",") if opts.get("names") else []:
        for pid in pids:
            if not any(e["name"] == name for e in by_pid[pid]):
                fail(f"rank {pid} has no {name} event")
    if "reducer" in opts:
        with open(opts["reducer"]) as f:
            stats = [line.split() for line in f if line.startswith("rank ")]
        if not stats:
            fail(f"no statistics in {opts['reducer']}")
        for _, r, _, buckets, _, passes in stats:
            r, buckets, passes = int(r), int(buckets), int(passes)
            evs = by_pid.get(r, [])
            bk = [e for e in evs if e["name"] == "reducer.bucket"]
            ps = [e for e in evs if e["name"] == "reducer.backward" and e["args"]["sync"] == 1]
            ws = [e for e in evs if e["name"] == "reducer.wait"]
            if len(bk) != buckets or len(ps) != passes:
                fail(f"rank {r}: {len(bk)} reducer.bucket and {len(ps)} synchronised reducer.backward events; the "
                     f"statistics say {buckets} and {passes}")
            inside = lambda e, p: p["ts"] - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= p["ts"] + p["dur"] + 1e-3
            for e in bk:
                if not any(inside(e, p) for p in ps):
                    fail(f"rank {r}: reducer.bucket {e['args']} at {e['ts']} is inside no synchronised pass")
            for p in ps:
                if not any(inside(w, p) for w in ws):
                    fail(f"rank {r}: the pass at {p['ts']} (iteration {p['args']['iteration']}) has no reducer.wait")
            if not all("straggler" in w["args"] for w in ws):
                fail(f"rank {r}: a reducer.wait names no straggler")
        print(f"reducer: {', '.join(f'rank {s[1]} {s[3]} buckets in {s[5]} passes' for s in stats)}, each inside its pass")
    if opts.get("bcast"):
        last = {pid: [e for e in by_pid[pid] if e["name"] == "broadcast"][-1] for pid in pids}
        root = last[0]
        for pid in pids[1:]:
            end = last[pid]["ts"] + last[pid]["dur"]
            if not root["ts"] <= end:
                fail(f"rank 0's broadcast starts at {root['ts']} after rank {pid}'s ends at {end}")
        ends = ", ".join("%.1f" % (last[p]["ts"] + last[p]["dur"]) for p in pids[1:])
        print(f"broadcast: rank 0 starts at {root['ts']:.1f} us, the others end at {ends} us")
    print(f"{path}: {len(events)} events, ranks {pids}: ok")


if __name__ == "__main__":
    main()
