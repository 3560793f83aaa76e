"""Run DeepEP V1's own test scripts (the intranode, low-latency and internode scripts in a DeepEP checkout's tests/)
on epjit through ``epjit.deep_ep.install()``, one rank a GPU, and print one PASS/FAIL line a script.

    python scripts/deepep_tests.py --source /path/to/DeepEP [--gpus 4] [--small] [--only internode] [--timeout 900]
                                   [--script-args=--use-logfmt]

The checkout's tests/ is copied to a temporary directory and changed only where a test cannot hold for another
library (docs/deep_ep.md lists the changes, SUBSTITUTIONS below): its ``bench_kineto`` finds epjit's kernels
instead of DeepEP's by name, and the internode script's asserts of 8 GPUs a node go, so that it runs as virtual nodes
of one host (2 nodes of GPUs/2). ``import deep_ep`` resolves in every rank to a generated module that installs
epjit.deep_ep (with the node size across virtual nodes). No DeepEP build is used. The source defaults to
$DEEPEP_SOURCE. Also imported by the copied tests (its ``bench_kineto``) and by tests/test_deepep_tests.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCRIPTS = ("test_intranode.py", "test_low_latency.py", "test_internode.py")

# (file, text, replacement): each text must be found exactly once, or the runner refuses the checkout.
SUBSTITUTIONS = (
    # DeepEP's internode kernels need nodes of 8 GPUs; epjit's take the node size from its group.
    ("test_internode.py", "assert num_experts % num_ranks == 0 and num_local_ranks == 8",
     "assert num_experts % num_ranks == 0"),
    ("test_internode.py", "assert num_local_ranks == 8 and num_ranks > 8", "assert num_ranks > num_local_ranks"),
)
# Appended to the copied utils.py: its bench_kineto looks kernels up by DeepEP's names.
UTILS_TAIL = "\nfrom deepep_tests import bench_kineto  # epjit: kernels by epjit's names (docs/deep_ep.md)\n"

# DeepEP's kernel names as its tests look them up, and epjit's kernels of the same step.
KERNELS = {
    "dispatch": ("intranode_dispatch", "internode_dispatch", "ll_dispatch"),
    "combine": ("intranode_combine", "internode_combine", "ll_combine", "ll_combine_logfmt"),
    "notify": ("intranode_notify", "internode_notify"),
}

# Always: the internode script's low-latency block on the same Buffer, as one DeepEP Buffer serves both modes.
ALWAYS = {"test_internode.py": ["--test-ll-compatibility"]}

SMALL = {"test_intranode.py": ["--num-tokens", "1024"], "test_low_latency.py": ["--num-tokens", "64"],
         "test_internode.py": ["--num-tokens", "1024"]}

SHIM = """import sys

del sys.modules[__name__]  # install() puts epjit.deep_ep in its place
import epjit.deep_ep  # noqa: E402

epjit.deep_ep.install(num_nvl_ranks={num_nvl_ranks})
"""


def prepare(source: Path, into: Path, num_nvl_ranks: int | None) -> Path:
    """Copy ``source``/tests into ``into``/tests with the substitutions, and write the ``deep_ep`` module into
    ``into``/shim. Returns the tests directory. Raises ValueError naming a substitution that does not apply."""
    tests = into / "tests"
    shutil.copytree(source / "tests", tests)
    for name, text, replacement in SUBSTITUTIONS:
        path = tests / name
        body = path.read_text()
        if body.count(text) != 1:
            raise ValueError(f"{path}: expected {text!r} once, found it {body.count(text)} times (another DeepEP "
                             "version? update SUBSTITUTIONS in scripts/deepep_tests.py)")
        path.write_text(body.replace(text, replacement))
    utils = tests / "utils.py"
    if "def bench_kineto(" not in utils.read_text():
        raise ValueError(f"{utils}: no bench_kineto to replace")
    with utils.open("a") as f:
        f.write(UTILS_TAIL)
    shim = into / "shim"
    shim.mkdir()
    (shim / "deep_ep.py").write_text(SHIM.format(num_nvl_ranks=num_nvl_ranks))
    return tests


def bench_kineto(fn: Any, kernel_names: str | tuple[str, ...], num_tests: int = 30,
                 suppress_kineto_output: bool = False, trace_path: str | None = None,
                 barrier_comm_profiling: bool = False, num_kernels_per_period: int = 1) -> Any:
    """DeepEP's tests' profiler helper with DeepEP's signature and returns (seconds a kernel, on average; a list a
    period with ``num_kernels_per_period``), finding epjit's kernels of each named step (KERNELS). A step none of
    whose kernels ran (epjit's cached calls run no notify kernel) takes 0 s."""
    import torch
    import torch.distributed as dist

    schedule = torch.profiler.schedule(wait=1, warmup=0, active=1, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], schedule=schedule) as prof:
        for _ in range(2):
            if barrier_comm_profiling:  # as DeepEP's: a large kernel and a barrier even out the launches
                lhs = torch.randn((8192, 8192), dtype=torch.float, device="cuda")
                lhs @ lhs
                dist.all_reduce(torch.ones(1, dtype=torch.float, device="cuda"))
            for _ in range(num_tests):
                fn()
            torch.cuda.synchronize()
            prof.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_path or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("cat") == "kernel"]
    names = (kernel_names,) if isinstance(kernel_names, str) else kernel_names
    found = [_durations(events, name, num_kernels_per_period) for name in names]
    return found[0] if isinstance(kernel_names, str) else found


def _durations(events: list[dict], name: str, per_period: int) -> Any:
    ours = KERNELS.get(name, (name,))
    durs = [e["dur"] / 1e6 for e in sorted(events, key=lambda e: e["ts"])
            if any(f"::{k}<" in e["name"] or f"::{k}(" in e["name"] for k in ours)]
    if not durs:
        return [0.0] * per_period if per_period > 1 else 0.0
    if per_period == 1:
        return sum(durs) / len(durs)
    periods = max(len(durs) // per_period, 1)
    return [sum(durs[j::per_period]) / periods for j in range(per_period)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tests: Path, script: str, args: list[str], env: dict[str, str], nodes: list[str]) -> list[Any]:
    """One process a node (DeepEP's scripts spawn their ranks), each in its own process group."""
    port = str(_free_port())
    procs = []
    for node, devices in enumerate(nodes):
        node_env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(len(nodes)), RANK=str(node),
                        CUDA_VISIBLE_DEVICES=devices)
        procs.append(subprocess.Popen([sys.executable, script, *args], cwd=tests, env=node_env,
                                      start_new_session=True))
    return procs


def _wait(procs: list[Any], timeout: float) -> str | None:
    """None when every process exited 0; otherwise why not, after killing every process group left."""
    deadline, why = time.monotonic() + timeout, None
    try:
        while why is None and any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed:
                why = f"exit status {failed[0]}"
            elif time.monotonic() > deadline:
                why = f"timed out after {timeout:g} s"
            else:
                time.sleep(1)
        if why is None:
            failed = [p.returncode for p in procs if p.returncode != 0]
            why = f"exit status {failed[0]}" if failed else None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return why


def run(source: Path, gpus: int, only: list[str], small: bool, timeout: float, extra: list[str] | None = None) -> int:
    """Run the scripts (``extra``: more arguments for each, e.g. DeepEP's ``--use-logfmt``); print one PASS/FAIL line
    each; return how many failed."""
    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    failures = 0
    for script in only:
        internode = script == "test_internode.py"
        per_node = gpus // 2 if internode else gpus
        with tempfile.TemporaryDirectory(prefix="epjit-deepep-") as tmp:
            tests = prepare(source, Path(tmp), per_node if internode else None)
            paths = [str(Path(tmp) / "shim"), str(here), str(here.parent), env.get("PYTHONPATH", "")]
            script_env = dict(env, PYTHONPATH=os.pathsep.join(p for p in paths if p))
            if internode:
                # Each virtual node sees its GPUs only (the script binds cuda:<local rank>); epjit's group holds
                # every rank of the host, so it takes GPU local_rank % visible GPUs: the same one.
                script_env["EPJIT_SHARE_GPUS"] = "1"
                nodes = [",".join(str(g) for g in range(n * per_node, (n + 1) * per_node)) for n in range(2)]
            else:
                nodes = [",".join(str(g) for g in range(gpus))]
            args = ["--num-processes", str(per_node), *ALWAYS.get(script, []), *(SMALL[script] if small else []),
                    *(extra or [])]
            start = time.monotonic()
            why = _wait(_launch(tests, script, args, script_env, nodes), timeout)
        took = f"{time.monotonic() - start:.0f} s"
        print(f"{'PASS' if why is None else 'FAIL'} {script} ({took}{'' if why is None else ', ' + why})",
              flush=True)
        failures += why is not None
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=os.environ.get("DEEPEP_SOURCE"),
                        help="a DeepEP checkout (default: $DEEPEP_SOURCE)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all; internode needs 2 or 4)")
    parser.add_argument("--only", nargs="+", choices=[s.removesuffix(".py").removeprefix("test_") for s in SCRIPTS],
                        help="run these scripts only")
    parser.add_argument("--small", action="store_true", help="fewer tokens than the scripts' defaults")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a script (default: 900)")
    parser.add_argument("--script-args", default="",
                        help="more arguments for every script run, written with '=' since they start with '--': "
                             "--script-args=--use-logfmt (with --only low_latency: the option only DeepEP's "
                             "low-latency script has)")
    a = parser.parse_args()
    if a.source is None or not (Path(a.source) / "tests" / "utils.py").is_file():
        parser.error(f"--source (or DEEPEP_SOURCE) must name a DeepEP checkout with tests/, got {a.source}")
    gpus = a.gpus
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    if gpus < 2:
        parser.error(f"needs at least 2 GPUs, got {gpus}")
    only = [f"test_{s}.py" for s in a.only] if a.only else list(SCRIPTS)
    if gpus % 2 and "test_internode.py" in only:
        parser.error(f"test_internode.py runs as 2 virtual nodes: an even GPU count, got {gpus}")
    sys.exit(1 if run(Path(a.source), gpus, only, a.small, a.timeout, shlex.split(a.script_args)) else 0)


if __name__ == "__main__":
    main()
