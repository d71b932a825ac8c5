"""Where the test suite's CPU goes, process by process: runs pytest with a `sitecustomize.py` on PYTHONPATH that
logs each process's argv, test and CPU time (user + system) when it exits, then counts them by kind (torchrun
launchers, trainer ranks on each engine, eval.py, ...) and names the tests that cost the most. A process killed
with SIGKILL (the kill -9 tests) skips the hook, so the logged total is below pytest's own.

    python benchmarks/suite_census.py                        # the whole suite, as README runs it
    python benchmarks/suite_census.py -- tests/test_eval.py  # the arguments after -- go to pytest
    python benchmarks/suite_census.py --log census.jsonl     # count an existing log again
"""

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HOOK = """
import atexit, json, os, resource, sys
def _log():
    r = resource.getrusage(resource.RUSAGE_SELF)
    record = dict(argv=sys.argv[:3], test=os.environ.get("PYTEST_CURRENT_TEST", ""), rank=os.environ.get("RANK"),
                  cpu=r.ru_utime + r.ru_stime, vllm="vllm" in sys.modules)
    with open(LOG, "a") as f:
        f.write(json.dumps(record) + "\\n")
atexit.register(_log)
"""


def install_hook(folder, log):
    """Writes the logging sitecustomize.py into `folder`; returns the environment that makes Python load it."""
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(f"LOG = {log!r}\n" + HOOK)
    path = [folder] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def kind(record):
    """What a logged process was: 'torchrun', 'rank: <script>[ on vLLM]', or 'other: <argv[0]>'."""
    first = os.path.basename(record["argv"][0]) if record["argv"] else ""
    if record["argv"] and record["argv"][0].endswith(os.path.join("distributed", "run.py")):
        return "torchrun"
    if record["rank"] is not None and first.endswith(".py"):
        return f"rank: {first}" + (" on vLLM" if record["vllm"] else "")
    return f"other: {first}"


def census(records):
    """{kind: (processes, CPU-seconds)}, costliest first."""
    out = collections.defaultdict(lambda: [0, 0.0])
    for r in records:
        out[kind(r)][0] += 1
        out[kind(r)][1] += r["cpu"]
    return dict(sorted(((k, tuple(v)) for k, v in out.items()), key=lambda kv: -kv[1][1]))


def by_test(records):
    """{test: CPU-seconds of the processes it started}, costliest first (pytest's own workers not included)."""
    out = collections.Counter()
    for r in records:
        if r["test"]:
            out[r["test"].rsplit(" (", 1)[0]] += r["cpu"]
    return dict(out.most_common())


def report(records, top=15):
    for name, (n, cpu) in census(records).items():
        print(f"{n:5d} processes {cpu:8.0f} CPU-s  mean {cpu / n:5.1f}  {name}")
    print(f"logged: {len(records)} processes, {sum(r['cpu'] for r in records):.0f} CPU-s")
    for test, cpu in list(by_test(records).items())[:top]:
        print(f"{cpu:6.0f} CPU-s  {test}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log", help="count this log (written by an earlier run) instead of running pytest")
    parser.add_argument("pytest_args", nargs="*", help="pytest's arguments, after --")
    args = parser.parse_args()
    log = args.log
    if not log:
        folder = tempfile.mkdtemp(prefix="suite_census_")
        log = os.path.join(folder, "census.jsonl")
        env = install_hook(folder, log)
        code = subprocess.call([sys.executable, "-m", "pytest", "-q", *args.pytest_args], cwd=REPO, env=env)
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        print(f"pytest exited {code}; {r.ru_utime:.0f} s user + {r.ru_stime:.0f} s system in all; log: {log}")
    report([json.loads(line) for line in open(log)])
