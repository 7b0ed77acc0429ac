"""scripts/gpu/lockstep.py without a GPU: its processes and turns, over a stand-in `torch` and
`models` (a step sleeps 1 ms, 2 ms in a process with LD_PRELOAD set). Checks that every label
gets its own process and its turns in the rotating order, that each set ends with each
process's final line, that the ratios come out (the slower label about 2x, a second process
of the same label about 1x), that a label's `@BUILD` runs it under `$LIB_BUILD`, and that an
unknown label or build is refused naming what is valid or missing.
Prints `OK lockstep` on success."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE_TORCH = '''
class _Cuda:
    @staticmethod
    def synchronize():
        pass

    @staticmethod
    def max_memory_reserved():
        return 3 << 20

    @staticmethod
    def max_memory_allocated():
        return 2 << 20


cuda = _Cuda()


def manual_seed(seed):
    pass
'''
FAKE_MODELS = '''
import os
import time


class _P:
    def detach(self):
        return self

    double = sum = detach

    def item(self):
        return float(os.getpid())  # each process's own: tells processes apart


class _Model:
    def parameters(self):
        return [_P()]


def build(name):
    preload = os.environ.get("LD_PRELOAD", "")
    # 1 ms natively, 2 ms under one library, 3 ms under libc (the second build of the test).
    delay = 0.003 if "/libc." in preload else 0.002 if preload else 0.001
    return (lambda i: time.sleep(delay)), _Model()
'''


def preloadable(name):
    """A library the loader can preload harmlessly: this interpreter's `name` (libm, libc)."""
    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        if re.search(rf"/{name}\.so", path):
            return path
    sys.exit(f"no {name} mapped")


def check_builds(tmp, env):
    """`shim@b` runs under `$LIB_b` (the stand-in's step 3 ms there, 2 ms under `$LIB`), and a
    build without its variable, or after a native label, is refused naming what is missing."""
    log = os.path.join(tmp, "builds.log")
    run = subprocess.run(
        [sys.executable, os.path.join(tmp, "lockstep.py"), "llama", "4", log,
         "native", "shim", "shim@b", "notrace@b.2"],
        env=dict(env, LIB_b=preloadable("libc"), SETS="1"),
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    pattern = r"ratio workload=llama field=step_ms rounds=4 \S+ (\S+)=\S+ ratio=(\S+)"
    ratios = {k: float(v) for k, v in re.findall(pattern, run.stdout)}
    assert set(ratios) == {"shim", "shim@b", "notrace@b.2"}, run.stdout
    assert 1.5 < ratios["shim"] < 2.6, ratios
    assert 2.6 < ratios["shim@b"] < 4.0 and 2.6 < ratios["notrace@b.2"] < 4.0, ratios
    refusals = ((["shim@c"], "needs LIB_c=PATH"), (["native@b"], "unknown label 'native@b'"))
    for labels, says in refusals:
        bad = subprocess.run(
            [sys.executable, os.path.join(tmp, "lockstep.py"), "llama", "1", log, *labels],
            env=env, capture_output=True, text=True, timeout=60,
        )
        assert bad.returncode != 0 and says in bad.stderr, bad.stderr


def check_sets_in_interval(tmp):
    """ratio_ci.py on a log of three sets whose processes differ (every ratio of sets 0 and 1
    about 1.0, of set 2 about 1.2): it pairs rounds within their set, gives each set's median,
    and its interval reaches set 2's ratio, where one over the rounds alone would stay near 1.0."""
    log = os.path.join(tmp, "sets.log")
    with open(log, "w") as f:
        for s, ratio in ((0, 1.0), (1, 1.0), (2, 1.2)):
            for r in range(40):
                wobble = 1 + (r % 5 - 2) / 1000
                f.write(f"workload=w label=a set={s} round={r} step_ms=10\n")
                f.write(f"workload=w label=b set={s} round={r} step_ms={10 * ratio * wobble}\n")
        # A set where b ran no round: nothing of it is paired.
        f.write("workload=w label=a set=3 round=0 step_ms=10\n")
    out = subprocess.run(
        [sys.executable, os.path.join(tmp, "ratio_ci.py"), log, "a", "b"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    m = re.search(r"rounds=120 .* ci95=\[(\S+),(\S+)\] sets=3 per_set=\[(\S+),(\S+),(\S+)\]", out)
    assert m, out
    low, high, *sets = map(float, m.groups())
    assert [round(x, 2) for x in sets] == [1.0, 1.0, 1.2], out
    assert low < 1.01 and high > 1.15, out


def main():
    tmp = tempfile.mkdtemp()
    try:
        for name in ("lockstep.py", "ratio_ci.py"):
            shutil.copy(os.path.join(ROOT, "scripts", "gpu", name), tmp)
        os.mkdir(os.path.join(tmp, "torch"))
        with open(os.path.join(tmp, "torch", "__init__.py"), "w") as f:
            f.write(FAKE_TORCH)
        with open(os.path.join(tmp, "models.py"), "w") as f:
            f.write(FAKE_MODELS)
        log = os.path.join(tmp, "steps.log")
        env = dict(os.environ, LIB=preloadable("libm"), SETS="2")
        env.pop("LD_PRELOAD", None)
        labels = ["native", "shim", "native.2"]
        run = subprocess.run(
            [sys.executable, os.path.join(tmp, "lockstep.py"), "llama", "4", log, *labels],
            env=env, capture_output=True, text=True, timeout=120,
        )
        assert run.returncode == 0, run.stderr
        rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in open(log)]
        steps = [r for r in rows if "step_ms" in r]
        finals = [r for r in rows if r.get("final") == "1"]
        assert len(steps) == 2 * 4 * 3, f"{len(steps)} step lines"
        for s in range(2):
            for r in range(4):
                turn = [x["label"] for x in steps if x["set"] == str(s) and x["round"] == str(r)]
                k = r % 3
                assert turn == labels[k:] + labels[:k], f"set {s} round {r}: turns {turn}"
        assert [f["label"] for f in finals] == labels * 2, [f["label"] for f in finals]
        for s in ("0", "1"):
            pids = {f["param_sum"] for f in finals if f["set"] == s}
            assert len(pids) == 3, f"set {s}: {len(pids)} processes for 3 labels"
        pattern = r"ratio workload=llama field=step_ms rounds=8 \S+ (\S+)=\S+ ratio=(\S+)"
        ratios = dict(re.findall(pattern, run.stdout))
        assert set(ratios) == {"shim", "native.2"}, run.stdout
        assert 1.5 < float(ratios["shim"]) < 3.0, ratios
        assert 0.6 < float(ratios["native.2"]) < 1.6, ratios
        assert all(float(x["proc_ms"]) >= 0 for x in steps), steps[0]
        check_sets_in_interval(tmp)
        check_builds(tmp, env)
        bad = subprocess.run(
            [sys.executable, os.path.join(tmp, "lockstep.py"), "llama", "1", log, "nativ"],
            env=env, capture_output=True, text=True, timeout=60,
        )
        assert bad.returncode != 0 and "unknown label 'nativ'" in bad.stderr, bad.stderr
        assert "native, shim, notrace" in bad.stderr, bad.stderr
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("OK lockstep")


main()
