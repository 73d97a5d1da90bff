"""Runs the benchmarks and writes their headline figures to one results file, with the date, host and versions.

Each benchmark runs as its own subprocess (a fresh interpreter, ``HF_HUB_OFFLINE=1``, a timeout per benchmark),
with ``HF_TPU_BENCH_REPORT`` naming a file to which it appends its headline figures (``benchmarks/_report.py``),
and this checkout first on ``PYTHONPATH`` (the hf_tpu measured is the one whose commit the results name).
Writes, under ``--out`` (default ``benchmarks/results``):

- ``results.json``: the date (UTC), the host (name, CPU model, cores, RAM), the platform behind the tpu device,
  the versions of Python, torch, JAX, transformers, diffusers and hf_tpu (as the benchmarks import them), and per
  benchmark its name, command, commit, start, wall seconds, the host's load average at its start and end (other
  work on a shared host shows there), status (ok, failed or timeout), figures (name, value, unit, what it is
  compared with) and, unless ok, the tail of its stderr;
- ``results.md``: a line with the date, host and versions, then one table of every figure (what
  ``docs/performance.md`` includes);
- ``logs/NAME.out.txt`` and ``logs/NAME.err.txt``: each benchmark's whole output (not committed).

The files are rewritten after each benchmark. A run of every benchmark starts a new results file; with ``--only``
or ``--skip``, the benchmarks run replace their own entries in the existing one and the others are kept (a file
written on another host or with other versions is refused: run them all, or write elsewhere with ``--out``).
``--quick`` runs each benchmark with smaller sizes or fewer repeats (a check that they run, not figures to quote).

    python benchmarks/run_all.py [--only NAME ...] [--skip NAME ...] [--timeout S] [--quick] [--out DIR] [--list]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _report import ENVIRONMENT_VARIABLE

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STDERR_TAIL_CHARS = 4000


@dataclass(frozen=True)
class Benchmark:
    name: str
    args: tuple[str, ...] = ()  # the options of the recorded run
    quick: tuple[str, ...] = ()  # the options under --quick
    timeout: int = 600  # seconds
    script: str = ""  # NAME.py unless given

    def command(self, quick: bool) -> list[str]:
        return ["python", f"benchmarks/{self.script or self.name + '.py'}", *(self.quick if quick else self.args)]


# In the README's order; options other than a script's defaults say why. On a quiet 2-core host the benchmarks
# took 4 s (dispatch_overhead) to 2.5 min (fused_eager), 15 min in all; the timeouts leave room for a loaded one
# (tensor_parallel's torchrun rows took over 5 min each at a load average of 8).
BENCHMARKS = [
    Benchmark("dispatch_overhead", quick=("--calls", "500", "--repeats", "2"), timeout=300),
    Benchmark("import_time", quick=("--runs", "2"), timeout=600),
    Benchmark("llama_forward", quick=("--repeats", "2"), timeout=300),
    Benchmark("diffusers_pipeline", quick=("--steps", "3", "--repeats", "1"), timeout=600),
    # --skip-inductor: Inductor's cold compile of the decode step takes minutes on a small host; the headline
    # figures are tpu against the hand-written JAX decoder (the README's runs skip it too)
    Benchmark("decode", ("--skip-inductor",), ("--skip-inductor", "--repeats", "1"), timeout=900),
    Benchmark("sliding_window_decode", quick=("--repeats", "1"), timeout=900),
    Benchmark("fused_eager", quick=("--chain", "50", "--repeats", "2", "--steps", "20"), timeout=900),
    Benchmark("compile_time", quick=("--warm-runs", "1"), timeout=600),
    Benchmark("first_generate", quick=("--runs", "1"), timeout=900),
    # --no-inductor: a cold Inductor compile takes a minute or more here; the tpu rows are the figures
    Benchmark("warm_start", ("--no-inductor",), ("--runs", "1", "--no-inductor"), timeout=900),
    Benchmark("aot_package", quick=("--warm-runs", "1"), timeout=600),
    Benchmark("loading", quick=("--size-gb", "0.2", "--repeats", "1"), timeout=600),
    Benchmark("checks_cost", quick=("--rounds", "1"), timeout=600),
    Benchmark("training_step", quick=("--repeats", "2"), timeout=300),
    Benchmark("offloading", quick=("--repeats", "1"), timeout=600),
    Benchmark("stream_overlap", quick=("--rounds", "1", "--copies", "2", "--matmuls", "4"), timeout=300),
    Benchmark("stream_overlap_split_cores", ("--split-cores",),
              ("--split-cores", "--rounds", "1", "--copies", "2", "--matmuls", "4"), timeout=300,
              script="stream_overlap.py"),
    # --skip-inductor: as decode
    Benchmark("moe_decode", ("--skip-inductor",), ("--skip-inductor", "--repeats", "2"), timeout=900),
    Benchmark("attention", quick=("--seq", "256", "--repeats", "2"), timeout=600),
    Benchmark("attention_documents", ("--documents", "8", "--backward"), ("--documents", "4", "--seq", "256",
              "--repeats", "2"), timeout=600, script="attention.py"),
    Benchmark("collectives", quick=("--sizes", "4,1024", "--repeats", "1"), timeout=600),
    Benchmark("tensor_parallel", quick=("--quick",), timeout=1200),
    Benchmark("sharding", quick=("--tp", "1,2", "--repeats", "1", "--op-repeats", "3"), timeout=900),
    Benchmark("eager_offsets", quick=("--new", "5"), timeout=300),
    Benchmark("in_place_memory", quick=("--mib", "64"), timeout=600),
    Benchmark("dynamic_cache_decode", quick=("--new-tokens", "32"), timeout=900),
    Benchmark("serving", quick=("--requests", "8", "--clients", "4", "--tokens", "8"), timeout=1800),
    Benchmark("continuous_batching", quick=("--requests", "16", "--tokens", "8"), timeout=1800),
]


# ---- the host, the platform and the versions ----------------------------------------------------------------


def _first_line(path: str, prefix: str) -> str | None:
    try:
        with open(path) as file:
            return next((line.split(":", 1)[1].strip() for line in file if line.startswith(prefix)), None)
    except OSError:
        return None


def host() -> dict:
    memory_kb = _first_line("/proc/meminfo", "MemTotal")
    return {
        "hostname": socket.gethostname(),
        "cpu": _first_line("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "ram_gb": round(int(memory_kb.split()[0]) / 2**20, 1) if memory_kb else None,
    }


_PROBE = """
import importlib.metadata, json, platform
import diffusers, jax, jaxlib, torch, transformers
import hf_tpu
versions = {"python": platform.python_version(), "torch": torch.__version__, "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "transformers": transformers.__version__, "diffusers": diffusers.__version__,
            "hf_tpu": hf_tpu.__version__}
try:
    versions["libtpu"] = importlib.metadata.version("libtpu")
except importlib.metadata.PackageNotFoundError:
    pass
print(json.dumps({"platform": {"jax_backend": torch.tpu.get_device_properties(0).platform,
                               "device": torch.tpu.get_device_name(), "devices": torch.tpu.device_count()},
                  "versions": versions}))
"""


def environment(**variables: str) -> dict[str, str]:
    """The benchmarks' environment: this one, offline, with this checkout first on ``PYTHONPATH``."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path, **variables}


def platform_and_versions() -> dict:
    """What backs the tpu device and the versions the benchmarks import (this checkout's hf_tpu), asked of a fresh
    process in their environment: this one never starts JAX (on TPU chips the benchmarks need them free)."""
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=environment(), capture_output=True,
                          text=True, timeout=300)
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    error = (done.stderr.strip().splitlines() or ["no output"])[-1]
    print(f"warning: importing the benchmarks' packages failed ({error}): versions from the installed packages",
          file=sys.stderr)
    versions = {"python": platform.python_version()}
    for name in ("torch", "jax", "jaxlib", "transformers", "diffusers", "hf-tpu"):
        try:
            versions[name.replace("-", "_")] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name.replace("-", "_")] = None
    return {"platform": {"jax_backend": None, "error": error}, "versions": versions}


def commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+uncommitted" if changed else "")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---- running one benchmark ------------------------------------------------------------------------------------


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux: read from /proc), also those in sessions of their own."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as file:
                fields = file.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def _signal(pids: list[int], number: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass


def stop(process: subprocess.Popen) -> None:
    """Stops a benchmark and everything it started: SIGTERM, then SIGKILL to what is left after 10 s."""
    family = [process.pid, *_descendants(process.pid)]  # read first: orphans lose their parent
    _signal(family, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    _signal([pid for pid in family if os.path.exists(f"/proc/{pid}")], signal.SIGKILL)
    process.wait()


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace")
    if len(text) <= STDERR_TAIL_CHARS:
        return text
    tail = text[-STDERR_TAIL_CHARS:]
    return tail[tail.find("\n") + 1:]


def _figures(path: Path) -> list[dict]:
    """The figures a benchmark reported (a line cut short by a timeout is left out)."""
    figures = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            figures.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return figures


def run(benchmark: Benchmark, quick: bool, timeout: float, logs: Path) -> dict:
    command = benchmark.command(quick)
    out, err = logs / f"{benchmark.name}.out.txt", logs / f"{benchmark.name}.err.txt"
    with tempfile.TemporaryDirectory(prefix="hf_tpu_bench_") as scratch:
        figures_file = Path(scratch, "figures.jsonl")
        variables = {"PYTHONUNBUFFERED": "1", ENVIRONMENT_VARIABLE: str(figures_file)}
        entry = {"name": benchmark.name, "command": shlex.join(command), "started": now(), "commit": commit()}
        load = os.getloadavg()[0]
        start = time.perf_counter()
        with open(out, "w") as stdout, open(err, "w") as stderr:
            process = subprocess.Popen([sys.executable, *command[1:]], cwd=ROOT, env=environment(**variables),
                                       stdout=stdout, stderr=stderr, start_new_session=True)
            try:
                returncode = process.wait(timeout=timeout)
                status = "ok" if returncode == 0 else "failed"
            except BaseException as error:  # the timeout, Ctrl-C or SIGTERM: nothing it started is left running
                stop(process)
                if not isinstance(error, subprocess.TimeoutExpired):
                    raise
                returncode, status = process.returncode, "timeout"
        figures = _figures(figures_file)
    # the host's 1-minute load average at the start and the end: above the benchmark's own, other work shared the host
    entry.update(wall_seconds=round(time.perf_counter() - start, 1), status=status, returncode=returncode,
                 load_average=[round(load, 2), round(os.getloadavg()[0], 2)], figures=figures)
    if status == "ok" and not figures:
        entry["status"] = "failed"
        entry["error"] = "exited normally but reported no figures"
    elif status == "timeout":
        entry["error"] = f"stopped after the {timeout:g} s timeout"
    if entry["status"] != "ok":
        entry["stderr_tail"] = _tail(err)
    return entry


# ---- the results files ----------------------------------------------------------------------------------------


def same_environment(previous: dict, current: dict) -> bool:
    keys = ("host", "versions")
    return (all(previous.get(key) == current[key] for key in keys)
            and previous.get("platform", {}).get("jax_backend") == current["platform"].get("jax_backend"))


def _value(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    number = f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}" if abs(value) < 1000 else f"{value:.0f}"
    return f"{number}{unit}" if unit in ("x", "%") else f"{number} {'µs' if unit == 'us' else unit}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _reason(entry: dict) -> str:
    """Why a benchmark is not ok: run_all's note, else the last line of its stderr (the exception, usually)."""
    last = (entry.get("stderr_tail") or "").strip().splitlines()[-1:]
    return entry.get("error") or (last[0] if last else f"exit status {entry['returncode']}")


def markdown(results: dict) -> str:
    entries = results["benchmarks"]
    started = sorted(entry["started"] for entry in entries)
    span = " to ".join(dict.fromkeys(s[:16].replace("T", " ") + " UTC" for s in (started[0], started[-1])))
    machine, device = results["host"], results["platform"]
    software = ", ".join(f"{name} {version}" for name, version in results["versions"].items())
    commits = ", ".join(sorted({entry["commit"] for entry in entries if entry.get("commit")}))
    loads = [load for entry in entries for load in entry.get("load_average", [])]
    load = f"; load average {min(loads):.1f} to {max(loads):.1f}" if loads else ""
    lines = [
        f"Run {span} on `{machine['hostname']}` ({machine['cpu']}, {machine['cores']} cores, {machine['ram_gb']} GB "
        f"RAM{load}); tpu device: {device.get('device') or device.get('jax_backend')}; {software}; commit {commits}.",
        "",
        "| benchmark | figure | value | compared with |",
        "|---|---|---|---|",
    ]
    for entry in entries:
        command = " ".join(entry["command"].split()[1:]).removeprefix("benchmarks/")
        name = f"`{command}`"
        if entry["status"] != "ok":
            lines.append(f"| {name} | {entry['status']}: {_cell(_reason(entry)[:150])} | | |")
            continue
        for figure in entry["figures"]:
            lines.append(f"| {name} | {_cell(figure['name'])} | {_value(figure['value'], figure['unit'])} | "
                         f"{_cell(figure['compared_with'])} |")
    return "\n".join(lines) + "\n"


def write(out: Path, results: dict) -> None:
    results["date"] = now()
    order = {benchmark.name: index for index, benchmark in enumerate(BENCHMARKS)}
    results["benchmarks"].sort(key=lambda entry: order[entry["name"]])
    (out / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    (out / "results.md").write_text(markdown(results))


# ---- the command line -----------------------------------------------------------------------------------------


def chosen(only: list[str] | None, skip: list[str]) -> list[Benchmark]:
    names = {benchmark.name for benchmark in BENCHMARKS}
    asked = [name.removesuffix(".py") for name in (only or []) + skip]
    unknown = [name for name in asked if name not in names]
    if unknown:
        raise SystemExit(f"no benchmark named {', '.join(unknown)}; the benchmarks: {', '.join(sorted(names))}")
    only_names = {name.removesuffix(".py") for name in only} if only else names
    skipped = {name.removesuffix(".py") for name in skip}
    return [benchmark for benchmark in BENCHMARKS if benchmark.name in only_names - skipped]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these benchmarks (merged into the results)")
    parser.add_argument("--skip", nargs="+", metavar="NAME", default=[], help="run all but these (merged likewise)")
    parser.add_argument("--timeout", type=float, help="seconds each benchmark may run (default: each its own)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats: a check that all run")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where to write (default %(default)s)")
    parser.add_argument("--list", action="store_true", help="print the benchmarks and their commands, run nothing")
    args = parser.parse_args()
    selection = chosen(args.only, args.skip)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stops the running benchmark too
    if args.list:
        for benchmark in BENCHMARKS:
            print(f"{benchmark.name:<28} {shlex.join(benchmark.command(args.quick)):<70} timeout {benchmark.timeout} s")
        return

    current = {"host": host(), **platform_and_versions()}
    results_file = args.out / "results.json"
    merged: dict[str, dict] = {}
    if (args.only or args.skip) and results_file.exists():
        previous = json.loads(results_file.read_text())
        if not same_environment(previous, current):
            raise SystemExit(f"{results_file} was written on another host, platform or versions "
                             f"({previous.get('host')}, {previous.get('versions')}): run every benchmark, or pass "
                             "--out to write elsewhere")
        known = {benchmark.name for benchmark in BENCHMARKS}
        merged = {entry["name"]: entry for entry in previous["benchmarks"] if entry["name"] in known}
    (args.out / "logs").mkdir(parents=True, exist_ok=True)

    print(f"{len(selection)} benchmarks; host {current['host']}; platform {current['platform']}", flush=True)
    start = time.perf_counter()
    for index, benchmark in enumerate(selection, 1):
        print(f"[{index}/{len(selection)}] {shlex.join(benchmark.command(args.quick))} ...", end=" ", flush=True)
        entry = run(benchmark, args.quick, args.timeout or benchmark.timeout, args.out / "logs")
        merged[benchmark.name] = entry
        print(f"{entry['status']} in {entry['wall_seconds']:.0f} s, {len(entry['figures'])} figures"
              + (f" ({entry.get('error') or 'see ' + str(args.out / 'logs' / (benchmark.name + '.err.txt'))})"
                 if entry["status"] != "ok" else ""), flush=True)
        write(args.out, {**current, "benchmarks": list(merged.values())})
    failed = [name for name, entry in merged.items() if entry["status"] != "ok"]
    print(f"done in {(time.perf_counter() - start) / 60:.1f} min; wrote {args.out / 'results.json'} and "
          f"{args.out / 'results.md'}" + (f"; not ok: {', '.join(failed)}" if failed else ""))


if __name__ == "__main__":
    main()
