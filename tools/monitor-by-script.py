#!/usr/bin/env python3
"""Groups a `redis-cli monitor` capture by the script that ran each command.

Usage:
    redis-cli -s /tmp/paceline-bench-*/redis.sock monitor > mon.txt   # while a bench runs
    tools/monitor-by-script.py mon.txt TURNS                          # TURNS: the trial's turns

Prints, per script (named by its first key and its op: the pacer's batch ops, the
run store's op; the queue's scripts, first key `due`, by their first argument: the
fetch by its batch size, the heartbeat by its lease in ms) and per client command: how many
calls, the commands they ran (the EVALSHA and every command inside it, as INFO
commandstats counts them), per turn and per call, and the commands inside by kind.
The bench's own commands (ZCARD polls, the deliveries list, INFO) are listed as the
client commands they are; subtract them for the bench's figure.
"""
import collections
import re
import sys


def groups(lines):
    """(client command, its arguments, [(command inside, args)]) for each client call."""
    cur = None
    for line in lines:
        m = re.match(r'^[\d.]+ \[\d+ (\S+)\] "(\w+)"(.*)$', line)
        if not m:
            continue
        src, cmd, rest = m.groups()
        if src == 'lua':
            if cur is not None:
                cur[2].append(cmd.upper())
        else:
            if cur is not None:
                yield cur
            cur = [cmd.upper(), rest, []]
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


def main():
    path, turns = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    with open(path, errors='replace') as f:
        lines = f.read().splitlines()
    calls, cmds, inside = collections.Counter(), collections.Counter(), collections.defaultdict(collections.Counter)
    for cmd, rest, sub in groups(lines):
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
