"""PyTorch's memory API round trip, natively and under the shim (same command): statistics,
history, snapshots and the memory viewer's reader.

Trains a small MLP for a few steps with `_record_memory_history` on, then checks:
memory_stats() (how many keys are non-zero, allocated bytes agreeing with memory_allocated()),
memory_summary(), reset_accumulated_memory_stats(), _snapshot() (segments, blocks, device_traces
with alloc and free actions), memory_snapshot(), _dump_snapshot() read back by
torch.cuda._memory_viz (segment_plot, trace_plot, memory). Prints one line per check,
`memory_api label=L check=NAME ok=True|False detail=...`, and a last `memory_api ... passed=N/M`.
"""
import os
import sys
import pickle
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402

checks = Checks("memory_api")
check = checks.check

warnings.simplefilter("ignore")



def train(steps=5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(steps):
        loss = model(torch.randn(256, 1024, device="cuda")).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return model, opt


def main():
    check("record_memory_history", lambda: (torch.cuda.memory._record_memory_history(max_entries=100000) is None, "enabled"))
    model, opt = train()
    stats = torch.cuda.memory_stats()
    nonzero = sum(1 for v in stats.values() if v)
    check("memory_stats", lambda: (nonzero >= 60, f"keys={len(stats)} nonzero={nonzero}"))
    check("stats_agree", lambda: (stats.get("allocated_bytes.all.current") == torch.cuda.memory_allocated(),
                                  f"{stats.get('allocated_bytes.all.current')} vs {torch.cuda.memory_allocated()}"))
    check("memory_summary", lambda: ("Allocated memory" in torch.cuda.memory_summary(), "table"))

    def reset_accumulated():
        torch.cuda.reset_accumulated_memory_stats()
        after = torch.cuda.memory_stats().get("allocated_bytes.all.allocated", -1)
        return after == 0, f"allocated_bytes.all.allocated={after}"

    check("reset_accumulated", reset_accumulated)
    snap = {}

    def snapshot():
        snap.update(torch.cuda.memory._snapshot())
        blocks = sum(len(s["blocks"]) for s in snap["segments"])
        actions = {e["action"] for t in snap["device_traces"] for e in t}
        return ("alloc" in actions and blocks > 0 and any(
            f for s in snap["segments"] for b in s["blocks"] for f in b.get("frames", []))), \
            f"segments={len(snap['segments'])} blocks={blocks} actions={sorted(actions)}"

    check("snapshot", snapshot)
    check("memory_snapshot", lambda: (len(torch.cuda.memory_snapshot()) > 0, "segments"))

    def dump_and_view():
        from torch.cuda import _memory_viz

        path = os.path.join(tempfile.mkdtemp(), "snap.pickle")
        torch.cuda.memory._dump_snapshot(path)
        with open(path, "rb") as f:
            loaded = pickle.load(f)
        seg = _memory_viz.segment_plot(loaded)
        trace = _memory_viz.trace_plot(loaded)
        return len(seg) > 1000 and len(trace) > 1000, f"segment_plot={len(seg)}B trace_plot={len(trace)}B"

    check("dump_and_memory_viz", dump_and_view)
    check("record_memory_history_off", lambda: (torch.cuda.memory._record_memory_history(enabled=None) is None, "off"))
    checks.summary()


if __name__ == "__main__":
    main()
