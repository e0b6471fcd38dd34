#!/usr/bin/env python3
"""Groups a `redis-cli monitor` capture by time slice: commands per turn in each.

Usage:
    tools/monitor-by-slice.py mon.txt [SECONDS]      # SECONDS: the slice, 5 by default

A turn is counted by the bench's own RPUSH of a delivery (one per call); the
bench's polls (ZCARD, INFO) and that RPUSH are left out of the per-turn figure.
Per slice: its start (s), its turns, commands per turn, and the top kinds per
turn: `fetch` (the run store's fetch that leased or asked), `emptyfetch` (a
fetch that found nothing due), `commit`, `start`, `create`, `pacer` (a pacer
script call of the worker's own), `qother` (heartbeats and the other queue
scripts), and client commands by name. Shows where a cold start, a steady state
and a drain differ (tools/monitor-by-script.py groups the whole capture by
script instead).
"""
import collections
import re
import sys

LINE = re.compile(r'^([\d.]+) \[\d+ (\S+)\] "(\w+)"(.*)$')
# The bench's own commands, not the product's.
BENCH = ('ZCARD', 'INFO', 'RPUSH')


def calls(lines):
    """(time, client command, its arguments, [commands inside]) for each client call."""
    cur = None
    for line in lines:
        m = LINE.match(line)
        if not m:
            continue
        t, src, cmd, rest = m.groups()
        if src == 'lua':
            if cur is not None:
                cur[3].append(cmd.upper())
        else:
            if cur is not None:
                yield cur
            cur = [float(t), cmd.upper(), rest, []]
    if cur is not None:
        yield cur


def kind(cmd, rest, inner):
    """What a client call was, by the script it ran (or its command's name)."""
    if cmd != 'EVALSHA':
        return cmd
    for op in ('commit', 'start', 'create'):
        if f'"{op}"' in rest:
            return op
    if 'pacer' in rest[:200]:
        return 'pacer'
    if '"9"' in rest[:60] and 'q:due' in rest[:120]:
        if 'HINCRBY' in inner and 'XADD' not in inner and len(inner) < 8:
            return 'emptyfetch'
        if inner[:1] == ['TIME'] and 'ZRANGE' in inner:
            return 'fetch'
        return 'qother'
    return 'otherscript'


def main():
    width = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
    with open(sys.argv[1]) as f:
        lines = f.read().splitlines()
    slices = collections.defaultdict(collections.Counter)
    turns = collections.Counter()
    t0 = None
    for t, cmd, rest, inner in calls(lines):
        t0 = t if t0 is None else t0
        s = int((t - t0) // width)
        k = kind(cmd, rest, inner)
        slices[s][k] += 1 + len(inner)
        if k == 'RPUSH':
            turns[s] += 1
    for s in sorted(slices):
        c, n = slices[s], turns[s] or 1
        total = sum(v for k, v in c.items() if k not in BENCH)
        top = {k: round(v / n, 1) for k, v in c.most_common(12) if k not in BENCH}
        print(f'{s * width:6.0f} s  turns {turns[s]:4d}  per turn {total / n:6.1f}  {top}')


if __name__ == '__main__':
    main()
