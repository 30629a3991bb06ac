#!/usr/bin/env bash
# One run that shows everything ddplab's GPU path should show (issue 45), sized for a lent
# GPU machine: about 15 minutes of device time in all, a cold start of minutes, one command
# of at most 10. The steps' limits add up to about 15 minutes, but on an H200 the steps took
# 404 s together (docs/install.md); ONLY= reruns some of them in a second command.
#
#     bash tools/gpu_check.sh [REPORT]
#
# REPORT (default: $OUT/gpu-report.txt where $OUT is set, else build/gpu-report.txt) gets one
# block per step: ok or FAILED, its seconds, and the tail of what it printed; the figures
# (bandwidths, samples/s, peak CUDA memory) are in those tails. The script never stops at a
# failed step: one run shows every failure. It exits 1 if a step failed, else 0.
#
# Python: $PYTHON, else .venv/bin/python (what `make install` made), else python3. A GPU
# machine that reaches no package registry has torch with CUDA but not ddplab's other needs:
# carry them as wheels in a folder and name it in $WHEELS; they are installed, without the
# network, into a folder of their own on PYTHONPATH. Where the wheels cannot be fetched,
# `make install` does it.
#
# Without a GPU it checks its own syntax and runs the CPU half (ddplab doctor: a real 2-rank
# gloo lab), says that no GPU was found, and exits 0; tests/test_gpu_check.py runs it so.
set -uo pipefail
cd "$(dirname "$0")/.."
bash -n "$0" || { echo "gpu_check: $0 does not parse"; exit 2; }

report=${1:-${OUT:+$OUT/gpu-report.txt}}
report=${report:-build/gpu-report.txt}
mkdir -p "$(dirname "$report")"
: > "$report"
if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x .venv/bin/python ]; then py=.venv/bin/python
else py=python3; fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=0
work=$(mktemp -d -t ddplab-gpucheck-XXXXXX)
trap 'rm -rf "$work"' EXIT

# step NAME SECONDS COMMAND...: run it under a limit, log it, append its verdict to the report.
step() {
    local name=$1 limit=$2 begin rc
    shift 2
    # ONLY="a b": run just those steps (a second run inside what is left of a lease)
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then cat > /dev/null; return 0; fi
    begin=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$work/$name.log" 2>&1
    rc=$?
    local took=$(( $(date +%s) - begin ))
    if [ "$rc" -eq 0 ]; then verdict=ok
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="FAILED: over its ${limit} s limit"; failed=1
    else verdict="FAILED (exit $rc)"; failed=1; fi
    { echo "== $name: $verdict, ${took} s"; tail -n 60 "$work/$name.log"; echo; } >> "$report"
    echo "gpu_check: $name: $verdict, ${took} s"
}

if [ -n "${WHEELS:-}" ]; then
    ONLY= step wheels 120 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$work/site" "$WHEELS"/*.whl
    export PYTHONPATH="$PYTHONPATH:$work/site"
fi

gpus=$("$py" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null) || gpus=""
{ echo "ddplab GPU check, $(date -u +%Y-%m-%dT%H:%MZ), $(uname -n)"
  "$py" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| CUDA', torch.version.cuda, '| GPUs', torch.cuda.device_count(),
[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])" 2>&1
  echo; } >> "$report"

step doctor 90 "$py" -m ddplab doctor

if [ -z "$gpus" ] || [ "$gpus" -eq 0 ]; then
    echo "== no GPU: torch sees none here, so only the CPU half ran" >> "$report"
    echo "gpu_check: no GPU on this machine: the CPU half ran; report in $report"
    exit "$failed"
fi

# The GPU-marked tests: placement by GPU count, torchrun on CUDA.
step gpu_tests 120 "$py" -m pytest tests -m gpu -q -p no:cacheprovider

# Notebook 05 as a student runs it: ddplab.start's backend="auto" picks nccl with a GPU per
# rank, else gloo on a shared GPU. Outputs differ from the stored CPU ones, so nothing is
# compared: every cell must run.
step notebook_05 150 "$py" - <<'PY'
import time, nbformat
from nbclient import NotebookClient
nb = nbformat.read("notebooks/05_ddp_training.ipynb", as_version=4)
begin = time.monotonic()
NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": "notebooks"}}).execute()
for cell in nb.cells:
    if cell.get("id") in ("cell-03", "cell-05"):
        print(cell.id, "".join(o.get("text", "") for o in cell.outputs)[:800])
print(f"notebook 05 ran in {time.monotonic() - begin:.0f} s")
PY

# A 1-rank nccl lab (one GPU is enough for nccl with one rank), then 2 ranks on nccl where
# there are 2 GPUs: all_reduce on CUDA tensors, and its bus bandwidth.
ranks=$(( gpus >= 2 ? 2 : 1 ))
step nccl_lab 60 "$py" - "$ranks" <<'PY'
import sys, ddplab
def total():
    import torch, torch.distributed as dist
    t = torch.full((4,), float(dist.get_rank() + 1), device="cuda")
    dist.all_reduce(t)
    return dist.get_backend(), str(t.device), t.tolist()
def when_all_reduce_returns():
    # notebook 05's claim: on nccl the call returns once the work is queued, before the GPU did it
    import time, torch, torch.distributed as dist
    t = torch.ones(64 * 2**20, device="cuda")           # 256 MB of float32
    dist.all_reduce(t); torch.cuda.synchronize()
    begin = time.perf_counter(); dist.all_reduce(t); returned = time.perf_counter() - begin
    torch.cuda.synchronize(); finished = time.perf_counter() - begin
    return f"all_reduce of 256 MB returned after {returned * 1e3:.3f} ms, done after {finished * 1e3:.3f} ms"
with ddplab.start(world_size=int(sys.argv[1]), backend="nccl", timeout=60) as lab:
    print(lab.backend_reason)
    for rank, got in enumerate(lab.run(total)):
        print(f"rank {rank}: {got}")
    for rank, got in enumerate(lab.run(when_all_reduce_returns)):
        print(f"rank {rank}: {got}")
PY

# Two ranks on one GPU: ddplab's own refusal, then what nccl itself says (torch alone, no
# ddplab), then the same through lab.spawn, as a student's own init_process_group meets it.
[ "$gpus" -eq 1 ] && step shared_gpu 90 "$py" - <<'PY'
import os, subprocess, sys, textwrap
import ddplab
from ddplab.env import free_port
try:
    ddplab.start(world_size=2, backend="nccl")
    print("ddplab.start(world_size=2, backend='nccl') on 1 GPU: STARTED (expected a refusal)")
except Exception as exc:
    print(f"ddplab.start refused: {type(exc).__name__}: {exc}")
prog = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    rank = int(os.environ["RANK"])
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    t = torch.full((4,), rank + 1.0, device="cuda")
    dist.all_reduce(t); torch.cuda.synchronize()
    print(f"rank {rank}: all_reduce on cuda:0 gave {t.tolist()}", flush=True)
    dist.destroy_process_group()
""")
port = str(free_port())
procs = [subprocess.Popen([sys.executable, "-c", prog], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2",
                                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
         for r in range(2)]
for r, p in enumerate(procs):
    try:
        out, _ = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill(); out, _ = p.communicate()
        out += "\n(no answer in 30 s: killed)"
    lines = [l for l in out.splitlines() if l.strip()]
    print(f"torch alone, rank {r}, exit {p.returncode}:", *lines[-8:], sep="\n  ")
def own_group(rank):
    import torch, torch.distributed as dist
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    t = torch.ones(4, device="cuda"); dist.all_reduce(t); torch.cuda.synchronize()
    dist.destroy_process_group()
    return t.tolist()
with ddplab.start(world_size=2, timeout=30) as lab:
    try:
        print("lab.spawn:", lab.spawn(own_group, limit=60))
    except Exception as exc:
        print(f"lab.spawn: {type(exc).__name__}: {str(exc)[-1500:]}")
PY

# Notebook 09's NCCL lines against what torch prints: a collective queued behind 12 s of GPU
# work in a group with a 3 s timeout; the process then lives on 15 s unless something ends it.
# By default; with TORCH_NCCL_BLOCKING_WAIT=1 (a plain call, and async_op=True then wait());
# with TORCH_NCCL_ASYNC_ERROR_HANDLING=1; and with the flight recorder's dump on timeout.
step nccl_watchdog 200 "$py" - <<'PY'
import glob, os, subprocess, sys, tempfile, textwrap
from ddplab.env import free_port
prog = textwrap.dedent("""
    import datetime, sys, time, torch, torch.distributed as dist
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=3),
                            device_id=torch.device("cuda", 0))
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t); torch.cuda.synchronize()
    torch.cuda._sleep(int(2.4e10))            # ~12 s of GPU work on the current stream
    begin = time.perf_counter()
    say = lambda what: print(f"t={time.perf_counter() - begin:5.1f} s: {what}", flush=True)
    try:
        if sys.argv[1] == "async":
            work = dist.all_reduce(t, async_op=True)
            say(f"all_reduce(async_op=True) returned {type(work).__name__}")
            work.wait()
            say("work.wait() returned")
        else:
            out = dist.all_reduce(t)
            say(f"all_reduce returned {out!r}")
        torch.cuda.synchronize()
        say("torch.cuda.synchronize() returned")
    except Exception as exc:
        say(f"raised {type(exc).__name__}: {str(exc)[:300]}")
    for _ in range(3):
        time.sleep(5)
        say("alive")
""")
keys = ("t=", "atchdog", "imed out", "abort", "Abort", "down", "dump", "Dump")
dumps = tempfile.mkdtemp()
for name, mode, extra in (
        ("default", "sync", {}),
        ("TORCH_NCCL_BLOCKING_WAIT=1", "sync", {"TORCH_NCCL_BLOCKING_WAIT": "1"}),
        ("TORCH_NCCL_BLOCKING_WAIT=1, async_op=True", "async", {"TORCH_NCCL_BLOCKING_WAIT": "1"}),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING=1", "sync", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}),
        ("dump on timeout", "sync", {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_BUFFER_SIZE": "2000",
                                     "TORCH_FR_DUMP_TEMP_FILE": dumps + "/fr_rank_"})):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **extra}
    try:
        done = subprocess.run([sys.executable, "-c", prog, mode], capture_output=True, text=True,
                              env=env, timeout=38)
        out, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() + (exc.stderr or b"").decode()
        rc = "none: still running at 38 s, killed"
    print(f"--- {name}: exit {rc}")
    for line in out.splitlines():
        if any(k in line for k in keys):
            print("  ", line[:260])
print("dump files:", sorted(os.path.basename(f) + f" ({os.path.getsize(f)} B)" for f in glob.glob(dumps + "/*")))
PY
step bench_nccl 60 "$py" -m ddplab.bench --backend nccl --world-sizes "$ranks" \
    --sizes 1M 64M --collectives all_reduce --repeats 3

# The memory helpers beside CUDA's own counters, for one small model.
step memory 30 "$py" - <<'PY'
import torch
from ddplab import memory
model = memory.deep_mlp().cuda()
optimizer = torch.optim.Adam(model.parameters())
x = torch.randn(64, 64, device="cuda")
model(x).sum().backward()
optimizer.step()                      # gradients and Adam's state exist now, as breakdown needs
torch.cuda.reset_peak_memory_stats()
before = torch.cuda.memory_allocated()
print("ddplab.memory.breakdown:", memory.breakdown(model, optimizer, x))
print("torch.cuda.memory_allocated before the forward:", before)
print("torch.cuda.max_memory_allocated during it:", torch.cuda.max_memory_allocated())
big = memory.deep_mlp(depth=4, width=256).cuda()
batch = torch.rand(512, 1, 8, 8, device="cuda")
saved = memory.saved_bytes(lambda: big(batch).sum(), big)
peak = memory.cuda_peak(lambda: big(batch).sum())
print(f"width 256, batch 512: saved_bytes {saved} B, cuda_peak {peak} B, ratio {peak / saved:.3f}")
PY

# Training throughput through the lab against torchrun, on the GPUs.
step bench_train 120 "$py" benchmarks/bench_train.py --repeat 1 --epochs 1 --ranks 1

echo "gpu_check: report in $report"
exit "$failed"
