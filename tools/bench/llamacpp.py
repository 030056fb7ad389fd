#!/usr/bin/env python3
"""llama.cpp baseline for the memory-capped benchmark: build it, convert our synthetic checkpoint, run llama-bench.

llama.cpp is NOT part of this repository. Get its source from the PyPI `llama-cpp-python` sdist (which vendors
llama.cpp and its converter) somewhere outside the repo, e.g.:

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d $BENCH_DATA/llama
    tar xzf $BENCH_DATA/llama/llama_cpp_python-0.3.36.tar.gz -C $BENCH_DATA/llama
    python tools/bench/llamacpp.py build --src $LLAMA_SRC --build $LLAMA_BUILD -j 2

($BENCH_DATA: any directory outside the repository; $LLAMA_SRC = $BENCH_DATA/llama/llama_cpp_python-0.3.36/
vendor/llama.cpp; $LLAMA_BUILD: the build directory. docs/benchmark-setup.md defines every variable.)

Subcommands (see docs/benchmark-setup.md):

    build    cmake configure + build llama-bench, llama-completion and llama-quantize (CPU, Release,
             -DGGML_NATIVE=ON)
    convert  our Qwen3-VL-MoE checkpoint -> text-only Qwen3MoeForCausalLM (tools/checkpoints/export_text_moe.py,
             same expert bytes) -> GGUF (bf16) with llama.cpp's convert_hf_to_gguf.py
    bench    llama-bench tg32 and pp64, 2 threads, each measurement = median of 3 separate llama-bench processes
             after 1 discarded one (--warmup-runs),
             each started with the GGUF evicted from the page cache and run inside a memory cgroup capped at
             --limit (tools/bench/memcgroup.py); reports tok/s and the bytes read during the timed section

Bytes read: llama-bench is run with `--progress`, which prints "generation run"/"prompt run" to stderr right
before the timed section; at that moment the child's /proc/<pid>/io `read_bytes` and the disks' sector counters
are sampled, and again when it exits (rusage). The difference is what the timed tokens (plus the final
teardown, which reads nothing) read from disk; model load and warmup are excluded.

The converter only hashes the tokenizer to name its pre-tokenizer; our offline test tokenizer is unknown to it, so
`convert` runs it with an unrecognised hash mapped to "gpt-2" (the same byte-level regex). llama-bench feeds
random token ids, so the tokenizer does not affect any number measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import hostprobe, memcgroup  # noqa: E402

DEFAULT_TARGETS = ("llama-bench", "llama-completion", "llama-quantize")  # quantize: Q4_K_M, Q8_0

# Runs convert_hf_to_gguf.py in-process with one patch: an unknown BPE pre-tokenizer hash -> "gpt-2".
_CONVERT_WRAPPER = r"""
import logging, runpy, sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base
_orig = base.TextModel.get_vocab_base_pre
def _pre(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        logging.getLogger("hf-to-gguf").warning("unrecognised BPE pre-tokenizer: using 'gpt-2' (byte-level regex)")
        return "gpt-2"
base.TextModel.get_vocab_base_pre = _pre
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


# ---------------------------------------------------------------------------------------------------------------
# build


def git_commit(src: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def build_llamacpp(src: str | Path, build_dir: str | Path, *, targets: tuple[str, ...] = DEFAULT_TARGETS,
                   jobs: int | None = None, native: bool = True) -> dict[str, object]:
    """Configure and build llama.cpp (CPU only, Release). Returns timings and the binaries' paths.

    `src` is resolved first: its `.git` file points at the sdist's git dir by a relative path, and configuring
    through a symlink makes that path dangle, which leaves build.ninja permanently dirty ("manifest still dirty
    after 100 tries").
    """
    src, build_dir = Path(src).resolve(), Path(build_dir).resolve()
    cfg = ["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
           f"-DGGML_NATIVE={'ON' if native else 'OFF'}", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
           "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF"]
    if shutil.which("ninja"):
        cfg[1:1] = ["-G", "Ninja"]
    t0 = time.perf_counter()
    subprocess.run(cfg, check=True)
    t1 = time.perf_counter()
    subprocess.run(["cmake", "--build", str(build_dir), "--target", *targets, "-j", str(jobs or os.cpu_count() or 1)],
                   check=True)
    t2 = time.perf_counter()
    return {
        "commit": git_commit(src),
        "configure_s": round(t1 - t0, 1),
        "build_s": round(t2 - t1, 1),
        "binaries": {t: str(build_dir / "bin" / t) for t in targets},
    }


# ---------------------------------------------------------------------------------------------------------------
# convert


def convert_to_gguf(hf_dir: str | Path, out_gguf: str | Path, llama_src: str | Path, *, outtype: str = "bf16",
                    text_dir: str | Path | None = None, keep_text_dir: bool = False,
                    python: str = sys.executable) -> dict[str, object]:
    """Convert our checkpoint to GGUF. A Qwen3-VL-MoE dir is exported to a text-only Qwen3MoeForCausalLM first."""
    from checkpoints.export_text_moe import export_text_moe

    hf_dir, out_gguf, llama_src = Path(hf_dir), Path(out_gguf), Path(llama_src).resolve()
    model_type = json.loads((hf_dir / "config.json").read_text()).get("model_type")
    t0 = time.perf_counter()
    export_s = 0.0
    src = hf_dir
    made_text = False
    if model_type == "qwen3_vl_moe":
        src = Path(text_dir) if text_dir else out_gguf.with_name(out_gguf.stem + ".hf-text")
        if not (src / "config.json").is_file():
            export_text_moe(hf_dir, src, overwrite=True)
            made_text = True
        export_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    out_gguf.parent.mkdir(parents=True, exist_ok=True)
    cmd = [python, "-c", _CONVERT_WRAPPER, str(llama_src), str(src), "--outtype", outtype, "--outfile", str(out_gguf)]
    subprocess.run(cmd, check=True)
    convert_s = time.perf_counter() - t1
    if made_text and not keep_text_dir:
        shutil.rmtree(src)
    return {
        "gguf": str(out_gguf),
        "gguf_bytes": out_gguf.stat().st_size,
        "text_dir": str(src) if (keep_text_dir or not made_text) else None,
        "export_s": round(export_s, 1),
        "convert_s": round(convert_s, 1),
        "llama_commit": git_commit(llama_src),
    }


# ---------------------------------------------------------------------------------------------------------------
# bench


@dataclass
class BenchRun:
    """One llama-bench process (one repetition) under the cap."""

    tok_s: float
    n_tokens: int
    timed_read_bytes: int  # child's read_bytes during the timed section
    timed_disk_read_bytes: int  # all disks, same interval
    total_read_bytes: int  # child's read_bytes over the whole process (load + warmup + timed)
    max_usage_bytes: int
    failcnt: int
    oom_kills: int
    returncode: int
    wall_s: float
    resident_after_evict: int
    error: str | None = None
    # why a run may be slow (see hostprobe.py): the GGUF's bytes in the page cache when the timed section starts
    # and when the process exits, the child's own CPU seconds, the seconds to the timed section (load + warmup),
    # each repetition's tok/s, and what the host did over the process (vmstat, CPU time by kind, disk reads)
    resident_at_timed_start: int = -1
    resident_at_exit: int = -1
    cpu_s: float = float("nan")
    to_timed_s: float = float("nan")
    samples_ts: list[float] = field(default_factory=list)
    host: dict[str, float] = field(default_factory=dict)


@dataclass
class BenchResult:
    test: str  # "tg32" / "pp64"
    limit_bytes: int | None
    gguf_bytes: int
    threads: int
    tok_s_median: float | None
    runs: list[BenchRun] = field(default_factory=list)
    warmup_runs: list[BenchRun] = field(default_factory=list)  # discarded: the steady-state rule (issue 25)
    read_bytes_per_token_median: float | None = None
    disk_read_bytes_per_token_median: float | None = None
    cmd: list[str] = field(default_factory=list)
    build_commit: str | None = None
    cpu_info: str | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _bench_once(cmd: list[str], gguf: Path, limit: int | None, *, evict: bool,
                timeout: float | None) -> tuple[BenchRun, dict]:
    marker = re.compile(r"benchmark \d+/\d+: (generation|prompt) run 1/")
    with memcgroup.MemoryCgroup("llamacpp", limit, drop_cache_on_exit=evict) as cg:
        evicted_resident = 0
        if evict:
            memcgroup.evict_page_cache([gguf])
            evicted_resident = memcgroup.resident_bytes([gguf])
        cg.reset_peak()
        oom0 = cg.oom_kills()
        host0 = hostprobe.snapshot()
        t0 = time.perf_counter()
        proc = cg.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        at_start: dict[str, int] = {}
        err_lines: list[str] = []
        out_chunks: list[str] = []

        def pump_err() -> None:
            for line in proc.stderr:  # type: ignore[union-attr]
                if not at_start and marker.search(line):
                    try:
                        at_start["proc"] = memcgroup.proc_read_bytes(proc.pid)
                    except (OSError, RuntimeError):
                        at_start["proc"] = -1
                    at_start["disk"] = memcgroup.disk_read_bytes()
                    at_start["t"] = time.perf_counter()
                    at_start["resident"] = memcgroup.resident_bytes([gguf])
                err_lines.append(line)

        def pump_out() -> None:
            out_chunks.append(proc.stdout.read())  # type: ignore[union-attr]

        threads = [threading.Thread(target=pump_err, daemon=True), threading.Thread(target=pump_out, daemon=True)]
        for t in threads:
            t.start()
        try:
            rusage = memcgroup.wait_with_rusage(proc, timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rusage = memcgroup.wait_with_rusage(proc, None)
        disk_end = memcgroup.disk_read_bytes()
        wall = time.perf_counter() - t0
        host = hostprobe.delta(host0, hostprobe.snapshot())
        resident_at_exit = memcgroup.resident_bytes([gguf])
        for t in threads:
            t.join(10)
        total_read = rusage.ru_inblock * 512
        run = BenchRun(
            tok_s=float("nan"), n_tokens=0,
            timed_read_bytes=total_read - at_start["proc"] if at_start.get("proc", -1) >= 0 else -1,
            timed_disk_read_bytes=disk_end - at_start["disk"] if "disk" in at_start else -1,
            total_read_bytes=total_read, max_usage_bytes=cg.max_usage_bytes(), failcnt=cg.failcnt(),
            oom_kills=cg.oom_kills() - oom0, returncode=proc.returncode, wall_s=round(wall, 2),
            resident_after_evict=evicted_resident, resident_at_timed_start=at_start.get("resident", -1),
            resident_at_exit=resident_at_exit, cpu_s=round(rusage.ru_utime + rusage.ru_stime, 2),
            to_timed_s=round(at_start["t"] - t0, 2) if "t" in at_start else float("nan"), host=host,
        )
    if proc.returncode != 0:
        tail = "".join(err_lines[-5:]).strip()
        run.error = f"exit {proc.returncode}" + (" (OOM-killed by the cgroup)" if run.oom_kills else "") + f": {tail}"
        return run, {}
    row = json.loads("".join(out_chunks))[0]
    run.tok_s = float(row["avg_ts"])
    run.n_tokens = int(row["n_gen"] or row["n_prompt"])
    run.samples_ts = [float(x) for x in row.get("samples_ts") or []]
    return run, row


def llama_bench(gguf: str | Path, build_dir: str | Path, *, test: str = "tg32", limit: int | str | None = None,
                threads: int = 2, runs: int = 3, evict: bool = True, extra_args: tuple[str, ...] = (),
                timeout: float | None = None, log=print, warmup_runs: int = 0) -> BenchResult:
    """Median tok/s of `runs` separate llama-bench processes for one test ("tg32", "pp64", ...), after
    `warmup_runs` discarded processes of the same command (kept in `warmup_runs`).

    `limit`: bytes, a size string, "N%" (of the GGUF's size) or None (no cap; still run in an accounting cgroup).
    """
    gguf = Path(gguf).resolve()
    m = re.fullmatch(r"(tg|pp)(\d+)", test)
    if not m:
        raise ValueError(f"test {test!r}: expected tgN or ppN")
    n = m[2]
    size = gguf.stat().st_size
    cap = memcgroup.parse_size(limit, whole=size) if limit is not None else None
    binary = Path(build_dir) / "bin" / "llama-bench"
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", "--progress",
           *(["-p", "0", "-n", n] if m[1] == "tg" else ["-p", n, "-n", "0"]), *extra_args]
    result = BenchResult(test=test, limit_bytes=cap, gguf_bytes=size, threads=threads, tok_s_median=None, cmd=cmd)
    if not evict:
        _prime_page_cache(gguf)  # "warm" means warm for every run, the first included
    for i in range(warmup_runs):
        run, _ = _bench_once(cmd, gguf, cap, evict=evict, timeout=timeout)
        result.warmup_runs.append(run)
        log(f"  {test} warm-up {i + 1}/{warmup_runs} (discarded): " + (run.error or f"{run.tok_s:.3f} tok/s"))
    for i in range(runs):
        run, meta = _bench_once(cmd, gguf, cap, evict=evict, timeout=timeout)
        if meta:
            result.build_commit = meta.get("build_commit")
            result.cpu_info = meta.get("cpu_info")
        result.runs.append(run)
        log(f"  {test} run {i + 1}/{runs}: " + (run.error or
            f"{run.tok_s:.3f} tok/s, timed read {run.timed_read_bytes / 1e9:.3f} GB "
            f"(disk {run.timed_disk_read_bytes / 1e9:.3f} GB), peak {run.max_usage_bytes / 2**30:.2f} GiB, "
            f"wall {run.wall_s:.1f} s"))
        if run.error:
            break
    ok = [r for r in result.runs if r.error is None]
    if ok and len(ok) == len(result.runs):
        result.tok_s_median = statistics.median(r.tok_s for r in ok)
        per_tok = [r.timed_read_bytes / r.n_tokens for r in ok if r.timed_read_bytes >= 0]
        disk_tok = [r.timed_disk_read_bytes / r.n_tokens for r in ok if r.timed_disk_read_bytes >= 0]
        result.read_bytes_per_token_median = statistics.median(per_tok) if per_tok else None
        result.disk_read_bytes_per_token_median = statistics.median(disk_tok) if disk_tok else None
    return result


def _prime_page_cache(path: Path, chunk: int = 8 << 20) -> None:
    """Read `path` once (outside any cgroup) so its pages are cached before a warm run."""
    with open(path, "rb", buffering=0) as f:
        while f.read(chunk):
            pass


def baseline(gguf: str | Path, build_dir: str | Path, *, limit: int | str | None, tests: tuple[str, ...] =
             ("tg32", "pp64"), threads: int = 2, runs: int = 3, evict: bool = True,
             extra_args: tuple[str, ...] = (), timeout: float | None = None, log=print,
             warmup_runs: int = 1) -> dict[str, object]:
    """Run every test of `tests` at one cap; returns a JSON-able dict with the machine and the results."""
    ok, why = memcgroup.memory_cgroup_support()
    if not ok:
        raise memcgroup.CgroupUnavailable(why)
    out: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"cpus": os.cpu_count(), "mem_total_kb": _meminfo("MemTotal"),
                    "readahead": memcgroup.readahead_settings(), "kernel": os.uname().release},
        "gguf": str(gguf),
        "limit": limit,
        "loadavg_before": os.getloadavg(),  # this VM may be shared: other processes add CPU and disk noise
        "results": {},
    }
    for test in tests:
        log(f"llama-bench {test}, limit {limit}, {threads} threads, {runs} runs, evict={evict}")
        res = llama_bench(gguf, build_dir, test=test, limit=limit, threads=threads, runs=runs, evict=evict,
                          extra_args=extra_args, timeout=timeout, log=log, warmup_runs=warmup_runs)
        out["results"][test] = res.as_dict()  # type: ignore[index]
        if res.tok_s_median is not None:
            per = res.read_bytes_per_token_median
            log(f"  => {test}: median {res.tok_s_median:.3f} tok/s"
                + (f", {per / 1e9:.3f} GB read per token" if per is not None else ""))
    out["loadavg_after"] = os.getloadavg()
    return out


def _meminfo(key: str) -> int | None:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return None


# ---------------------------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="cmake build of llama-bench, llama-completion, llama-quantize")
    b.add_argument("--src", type=Path, required=True, help="llama.cpp source (e.g. the sdist's vendor/llama.cpp)")
    b.add_argument("--build", type=Path, required=True)
    b.add_argument("-j", "--jobs", type=int, default=None)
    c = sub.add_parser("convert", help="our checkpoint -> GGUF")
    c.add_argument("--model", type=Path, required=True, help="our Qwen3-VL-MoE (or an exported text MoE) dir")
    c.add_argument("--src", type=Path, required=True, help="llama.cpp source with convert_hf_to_gguf.py")
    c.add_argument("--out", type=Path, required=True, help="output .gguf")
    c.add_argument("--outtype", default="bf16")
    c.add_argument("--keep-text-dir", action="store_true", help="keep the exported Qwen3MoeForCausalLM dir")
    r = sub.add_parser("bench", help="llama-bench under a memory cap")
    r.add_argument("--gguf", type=Path, required=True)
    r.add_argument("--build", type=Path, required=True)
    r.add_argument("--limit", default=None, help="4GiB, N%% of the GGUF size, or omit for no cap")
    r.add_argument("--tests", default="tg32,pp64")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--runs", type=int, default=3)
    r.add_argument("--warmup-runs", type=int, default=1,
                   help="discarded llama-bench processes before the measured ones (steady state, issue 25)")
    r.add_argument("--no-evict", action="store_true",
                   help="warm runs: read the GGUF into the page cache first and never evict it")
    r.add_argument("--timeout", type=float, default=None, help="seconds per llama-bench process")
    r.add_argument("--json", type=Path, default=None, help="write the results here")
    r.add_argument("extra", nargs="*", help="extra llama-bench arguments (after --)")
    a = p.parse_args(argv)

    if a.cmd == "build":
        print(json.dumps(build_llamacpp(a.src, a.build, jobs=a.jobs), indent=2))
    elif a.cmd == "convert":
        print(json.dumps(convert_to_gguf(a.model, a.out, a.src, outtype=a.outtype, keep_text_dir=a.keep_text_dir),
                         indent=2))
    else:
        res = baseline(a.gguf, a.build, limit=a.limit, tests=tuple(a.tests.split(",")), threads=a.threads,
                       runs=a.runs, evict=not a.no_evict, extra_args=tuple(a.extra), timeout=a.timeout,
                       warmup_runs=a.warmup_runs,
                       log=lambda s: print(s, file=sys.stderr, flush=True))
        text = json.dumps(res, indent=2)
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(text + "\n")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
