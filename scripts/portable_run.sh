#!/usr/bin/env bash
# Run the chapters as a reader's machine runs them, not as the build machine does:
#   * a CPU without AMX or AVX512 kernels: ATen limited to AVX2, oneDNN to AVX2 (no AMX, no AVX512,
#     no bf16 instructions), so kvlib.hardware.fast_dtype() answers fp32 as such a CPU would;
#   * torch on THREADS threads by default, as on a machine with that many cores: OMP_NUM_THREADS, and an IPython
#     start-up file that sets the count in every notebook kernel (torch caps OMP_NUM_THREADS at this machine's cores);
#   * two notebooks at once (nbval under xdist) and a busy process competing for the cores, as a
#     laptop with a browser open, or a Colab VM, always has.
# Usage: scripts/portable_run.sh PYTHON THREADS [NOTEBOOK ...]   (default: every chapter)
set -euo pipefail
cd "$(dirname "$0")/.."
py="$1"; threads="$2"; shift 2
[ "$#" -gt 0 ] || set -- book/
export ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS="$threads"
# Two notebooks at once and a busy process: more threads than cores, where OpenMP's spinning threads wait on each
# other (a 0.15 s forward took 1-2 s, a 0.5 s cell 13-28 s). Passive waits change no result, and the timed cells
# pin one thread anyway.
export OMP_WAIT_POLICY=PASSIVE
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
ipython_dir="$(mktemp -d)"
mkdir -p "$ipython_dir/profile_default/startup"
printf 'import torch\ntorch.set_num_threads(%s)  # a reader machine with this many cores\n' "$threads" \
  > "$ipython_dir/profile_default/startup/00-threads.py"
export IPYTHONDIR="$ipython_dir"
"$py" -c "while True: pass" &
busy=$!
trap 'kill "$busy" 2>/dev/null || true; rm -rf "$ipython_dir"' EXIT
echo "== portable run: AVX2 CPU, OMP_NUM_THREADS=$threads, 2 notebooks at once + 1 busy process (pid $busy) =="
"$py" -m IPython --quick -c "exec(open('$ipython_dir/profile_default/startup/00-threads.py').read())
import kvlib.hardware as h
print('torch', torch.__version__, '| capability', torch.backends.cpu.get_cpu_capability(),
      '| threads in a kernel', torch.get_num_threads(), '| fast_dtype', h.fast_dtype())"
start=$SECONDS
# In the order given (--no-loadscope-reorder): .ci/run passes the longest chapters first.
"$py" -m pytest -p no:cacheprovider -q -n 2 --dist loadfile --no-loadscope-reorder "$@"
echo "== portable run (OMP_NUM_THREADS=$threads) passed in $((SECONDS - start)) s =="
