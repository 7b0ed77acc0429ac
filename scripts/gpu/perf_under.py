"""Where the time under one function goes, from a `perf record -g` profile:

    perf script -i perf.data | python3 scripts/gpu/perf_under.py FUNCTION [TOP]

Keeps the samples whose call chain has a frame whose symbol contains FUNCTION (e.g.
`cachealloc_ipc_share_desc`), and prints how many there are, then the TOP (30) symbols by
samples in which they are the leaf (self time), and by samples in which they appear below
FUNCTION (inclusive time, each symbol counted once a sample), each with its library. Reads
`perf script`'s default output: a header line a sample, then one frame a line (leaf first), then
a blank line."""
import collections
import re
import sys

FRAME = re.compile(r"^\s+[0-9a-f]+\s+(.*?)\s+\((.*)\)\s*$")


def samples(lines):
    frames = []
    for line in lines:
        match = FRAME.match(line)
        if match:
            symbol = re.sub(r"\+0x[0-9a-f]+$", "", match.group(1))
            frames.append((symbol, match.group(2).rsplit("/", 1)[-1]))
        elif not line.strip():
            if frames:
                yield frames
            frames = []
    if frames:
        yield frames


def main():
    function = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    total = kept = 0
    leaf = collections.Counter()
    below = collections.Counter()
    for frames in samples(sys.stdin):
        total += 1
        at = next((i for i, (symbol, _) in enumerate(frames) if function in symbol), None)
        if at is None:
            continue
        kept += 1
        leaf[frames[0]] += 1
        below.update(set(frames[:at]))
    print(f"samples {total}, under {function}: {kept} ({100 * kept / max(total, 1):.1f} %)")
    for title, counter in (("self", leaf), ("inclusive, below it", below)):
        print(f"-- {title}")
        for (symbol, library), n in counter.most_common(top):
            print(f"{100 * n / max(kept, 1):6.1f} %  {library:28.28}  {symbol[:110]}")


if __name__ == "__main__":
    main()
