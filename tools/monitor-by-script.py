#!/usr/bin/env python3
"""Groups a `redis-cli monitor` capture by the script that ran each command.

Usage:
    redis-cli -s /tmp/paceline-bench-*/redis.sock monitor > mon.txt   # while a bench runs
    tools/monitor-by-script.py mon.txt TURNS                          # TURNS: the trial's turns
    tools/monitor-by-script.py mon.txt --slice SECONDS                # by time slice instead

Prints, per script (named by its first key and its op: the pacer's batch ops, the
run store's op; the queue's scripts, first key `due`, by their first argument: the
fetch by its batch size, the heartbeat by its lease in ms) and per client command: how many
calls, the commands they ran (the EVALSHA and every command inside it, as INFO
commandstats counts them), per turn and per call, and the commands inside by kind.
The bench's own commands (ZCARD polls, the deliveries list, INFO) are listed as the
client commands they are; subtract them for the bench's figure.

With --slice: per slice of that many seconds, its turns (counted by the bench's own
RPUSH of a delivery, one per call), commands per turn without the bench's own, and
the top kinds per turn: `fetch` (the run store's fetch that leased or asked),
`emptyfetch` (a fetch that found nothing due), `commit`, `start`, `create`, `pacer`
(a pacer script call of the worker's own), `qother` (heartbeats and the other queue
scripts) and client commands by name: where a cold start, a steady state and a
drain differ.
"""
import collections
import re
import sys


def groups(lines):
    """(time, client command, its arguments, [commands inside]) for each client call."""
    cur = None
    for line in lines:
        m = re.match(r'^([\d.]+) \[\d+ (\S+)\] "(\w+)"(.*)$', line)
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


def name(cmd, rest):
    if cmd != 'EVALSHA':
        return cmd
    args = re.findall(r'"((?:[^"\\]|\\.)*)"', rest)
    nkeys = int(args[1])
    keys, argv = args[2:2 + nkeys], args[2 + nkeys:]
    first = keys[0] if keys else ''
    if ':pacer:' in first:
        ops = sorted({a for a in argv if a in ('acquire', 'settle', 'head', 'pull')})
        return 'pacer ' + (argv[0] if argv else '?') + (' ' + '+'.join(ops) if ops else '')
    return 'script %s (%d keys) %s' % (first.split(':')[-1], nkeys, argv[0][:12] if argv else '')


# The bench's own commands, left out of a slice's figure.
BENCH = ('ZCARD', 'INFO', 'RPUSH')


def kind(cmd, rest, inner):
    """What a client call was, for --slice: the script it ran, or its command's name."""
    if cmd != 'EVALSHA':
        return cmd
    for op in ('commit', 'start', 'create'):
        if '"%s"' % op in rest:
            return op
    if ':pacer:' in rest[:200]:
        return 'pacer'
    if '"9"' in rest[:60] and 'q:due' in rest[:120]:
        if 'HINCRBY' in inner and 'XADD' not in inner and len(inner) < 8:
            return 'emptyfetch'
        if inner[:1] == ['TIME'] and 'ZRANGE' in inner:
            return 'fetch'
        return 'qother'
    return 'otherscript'


def by_slice(lines, width):
    slices, turns, t0 = collections.defaultdict(collections.Counter), collections.Counter(), None
    for t, cmd, rest, sub in groups(lines):
        t0 = t if t0 is None else t0
        s = int((t - t0) // width)
        k = kind(cmd, rest, sub)
        slices[s][k] += 1 + len(sub)
        turns[s] += k == 'RPUSH'
    for s in sorted(slices):
        c, n = slices[s], turns[s] or 1
        total = sum(v for k, v in c.items() if k not in BENCH)
        top = ' '.join('%s %.1f' % (k, v / n) for k, v in c.most_common(12) if k not in BENCH)
        print('%6.0f s  turns %4d  per turn %6.1f  %s' % (s * width, turns[s], total / n, top))


def main():
    path = sys.argv[1]
    with open(path, errors='replace') as f:
        lines = f.read().splitlines()
    if len(sys.argv) > 3 and sys.argv[2] == '--slice':
        return by_slice(lines, float(sys.argv[3]))
    turns = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    calls, cmds, inside = collections.Counter(), collections.Counter(), collections.defaultdict(collections.Counter)
    for _, cmd, rest, sub in groups(lines):
        n = name(cmd, rest)
        calls[n] += 1
        cmds[n] += 1 + len(sub)
        inside[n].update(sub)
    total = sum(cmds.values())
    print('%d commands, %.2f per turn' % (total, total / turns))
    for n, c in cmds.most_common():
        kinds = ' '.join('%s %.1f' % (k.lower(), v / calls[n]) for k, v in inside[n].most_common(10))
        print('%-50s calls %6d  per turn %6.2f  per call %5.1f  %s' % (n, calls[n], c / turns, c / calls[n], kinds))


if __name__ == '__main__':
    main()
