"""Check the Python stacks a traced run recorded against what Python itself saw, through the
snapshot pickle: `python3 check_python_stacks.py expected.json snap.pickle` where expected.json is
written by tests/programs/python_stacks.py and snap.pickle by `cachealloc snapshot --at-peak`
(every allocation of that program is live at its peak). Prints "OK python stacks" or what
differs."""
import json
import pickle
import sys

expected = json.load(open(sys.argv[1]))
snap = pickle.load(open(sys.argv[2], "rb"))
blocks = {}
for seg in snap["segments"]:
    for b in seg["blocks"]:
        if b["state"] == "active_allocated":
            blocks[b["requested_size"]] = [(f["name"], f["filename"], f["line"]) for f in b["frames"]]
bad = 0
for e in expected:
    want = [tuple(f) for f in e["frames"]]
    got = blocks.get(e["size"])
    if got != want:
        bad += 1
        print(f"size {e['size']} (GIL held: {e['gil']}):\n  want {want}\n  got  {got}")
print("OK python stacks" if bad == 0 and expected else f"FAIL: {bad} of {len(expected)} stacks differ")
sys.exit(1 if bad else 0)
