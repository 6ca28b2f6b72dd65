#!/usr/bin/env bash
# compute-sanitizer over the MLA kernels: memcheck, racecheck, synccheck and initcheck, one after
# another, each over `tools/check_mla.py --set sanitizer --dtype both --host-reference` (26
# shapes x 2 dtypes, each checked against the float64 reference computed with NumPy, so that the
# only GPU kernels are ours and the few that make the inputs; check_mla exits 1 on a wrong result);
# then memcheck once more over `check_mla.py --set bad-values` (bad lengths and block ids, a
# negative length into get_mla_metadata, metadata of another batch: no bad value may make a kernel
# touch memory outside its arrays; check_mla exits 1 unless the bad requests are NaN, the others
# right and each error reported).
#
#   tools/sanitize.sh [LOGDIR] [TOOL ...]
#
#   LOGDIR  where the full logs go (default ./sanitizer-logs): TOOL.log for each tool (the
#           sanitizer's reports and check_mla's per-shape lines, interleaved),
#           memcheck-bad-values.log and warmup.log
#   TOOL    memcheck, racecheck, synccheck, initcheck (default: all four, in that order)
#
# Prints one summary line per tool, and "memcheck (bad values)" for the extra pass (its "ERROR
# SUMMARY: N errors", exit code, check_mla's verdict, time). Exit status 0 only if every pass
# reports 0 errors and exits 0. Exit codes in the summary: 86 = the sanitizer found errors, 1 =
# check_mla found a wrong result (or the sanitizer failed), 124 = the pass ran past
# SANITIZE_TIMEOUT.
#
# Environment:
#   PYTHON               interpreter with cupy and flashmla_cupy's dependencies (default python3)
#   COMPUTE_SANITIZER    the binary (default: on PATH, else $CUDA_HOME/bin, /usr/local/cuda/bin)
#   SANITIZE_DTYPE       bf16 | fp16 | fp8 | fp8q | both (default both: bf16 and fp16); one dtype halves each tool's time
#   SANITIZE_SEED        check_mla's seed (default 1): every tool sees the same inputs
#   SANITIZE_KERNELS     auto | ours | all: which kernels the tools check (default auto, below)
#   SANITIZE_POOL        off | keep: CuPy's memory pool (default off, below)
#   SANITIZE_TENSOR_OPS  yes | no: --check-tensor-ops (TMA checks) where supported (default yes)
#   SANITIZE_API_ERRORS  memcheck's --report-api-errors (default no, below)
#   SANITIZE_TIMEOUT     seconds per pass (default 1800)
#   SANITIZE_WARMUP      1 | 0: first a plain run, which also fills the cubin cache (default 1)
#   SANITIZE_EXTRA_ARGS  more compute-sanitizer options for every tool (word-split)
#   SANITIZE_RANGE       START:STOP, a slice of the set's items (check_mla --range; default all)
#   SANITIZE_SET         check_mla's set for the TOOLs: sanitizer (default: 28 shapes) or
#                        bad-values (e.g. SANITIZE_SET=bad-values tools/sanitize.sh LOGDIR memcheck)
#   SANITIZE_BAD_VALUES  yes | no: with SANITIZE_SET=sanitizer and memcheck among the TOOLs, the
#                        extra memcheck pass over all of --set bad-values (default yes)
#   FLASHMLA_CUPY_EXTRA_OPTIONS  NVRTC options of the kernels under test (own cache entries):
#                        -lineinfo puts source lines in the reports
#
# Choices (each overridable above):
# * Kernels checked (auto): racecheck and synccheck check only ours (--kernel-name
#   kns=flashmla: the mangled names of the split-KV, combine and metadata kernels contain their
#   namespace); the CuPy kernels that make the inputs are not ours. memcheck checks every kernel.
#   initcheck checks only ours where the sanitizer tracks what unchecked kernels write
#   (--initcheck-track-filtered-global-memory, recent versions); older ones would then take the
#   inputs written by CuPy's kernels for uninitialized, so there it checks every kernel.
# * CuPy's memory pool is off (cupy.cuda.set_allocator(None)): every array is its own
#   cudaMalloc, so memcheck sees each array's exact bounds (in the pool an array can sit inside a
#   larger cached block, where an overrun stays invisible) and use after free, and initcheck
#   sees each array fresh (reused pool memory counts as initialized by its previous owner).
# * initcheck and the outputs: check_mla --set sanitizer passes out and lse filled with NaN. The
#   kernels only write them, so the poison hides nothing on the kernels' side; an element they
#   fail to write stays NaN and check_mla reports the shape as wrong (exit 1) instead of initcheck
#   flagging the CuPy kernel that reads out afterwards. The split workspace (lse_accum, o_accum)
#   is fresh cupy.empty memory: the combine kernel reading a split row that the split-KV kernel
#   did not write is exactly what initcheck reports.
# * memcheck does not report failed CUDA API calls (--report-api-errors no): CuPy and the CUDA
#   Python bindings probe the driver with calls that may fail harmlessly, and every call of ours
#   has its result checked in Python (a failure raises, and check_mla exits non-zero).
# * Bad values get memcheck only: with them the other tools report what the kernels do by design
#   (initcheck: the combine kernel reads split rows that a bad request's NaN path left unwritten,
#   whose weights are NaN anyway; racecheck: parts of foreign metadata that overlap write the
#   same output rows).
set -u -o pipefail

ALL_TOOLS=(memcheck racecheck synccheck initcheck)

usage() { sed -n '2,/^set -u/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

case "${1:-}" in -h|--help) usage; exit 0 ;; esac

logdir=./sanitizer-logs
if [[ $# -gt 0 && " ${ALL_TOOLS[*]} " != *" $1 "* ]]; then
    logdir=$1
    shift
fi
tools=("$@")
[[ ${#tools[@]} -eq 0 ]] && tools=("${ALL_TOOLS[@]}")
for t in "${tools[@]}"; do
    if [[ " ${ALL_TOOLS[*]} " != *" $t "* ]]; then
        echo "sanitize.sh: unknown tool '$t' (choose from: ${ALL_TOOLS[*]})" >&2
        exit 2
    fi
done

mkdir -p "$logdir" || exit 2
logdir=$(cd "$logdir" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 2

sanitizer=${COMPUTE_SANITIZER:-}
if [[ -z $sanitizer ]]; then
    for candidate in "$(command -v compute-sanitizer 2>/dev/null)" "${CUDA_HOME:-/nonexistent}/bin/compute-sanitizer" \
                     /usr/local/cuda/bin/compute-sanitizer; do
        if [[ -n $candidate && -x $candidate ]]; then
            sanitizer=$candidate
            break
        fi
    done
fi
if [[ -z $sanitizer || ! -x $sanitizer ]]; then
    echo "sanitize.sh: compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin); set COMPUTE_SANITIZER" >&2
    exit 2
fi
help_text=$("$sanitizer" --help 2>&1)
supports() { grep -q -F -e "$1" <<<"$help_text"; }

python=${PYTHON:-python3}
dtype=${SANITIZE_DTYPE:-both}
seed=${SANITIZE_SEED:-1}
kernels=${SANITIZE_KERNELS:-auto}
pool=${SANITIZE_POOL:-off}
timeout_s=${SANITIZE_TIMEOUT:-1800}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

# check_mla under a wrapper that can turn CuPy's memory pool off first.
read -r -d '' wrapper <<'EOF'
import runpy, sys
pool = sys.argv.pop(1)
if pool == "off":
    import cupy
    cupy.cuda.set_allocator(None)
sys.argv[0] = "tools/check_mla.py"
runpy.run_path("tools/check_mla.py", run_name="__main__")
EOF
range=${SANITIZE_RANGE:-:}
set_name=${SANITIZE_SET:-sanitizer}
bad_values=${SANITIZE_BAD_VALUES:-yes}
case $set_name in sanitizer|bad-values) ;; *) echo "sanitize.sh: SANITIZE_SET must be sanitizer or bad-values; got '$set_name'" >&2; exit 2 ;; esac
case $bad_values in yes|no) ;; *) echo "sanitize.sh: SANITIZE_BAD_VALUES must be yes or no; got '$bad_values'" >&2; exit 2 ;; esac
# The extra pass: memcheck over --set bad-values, after the tools' passes over the sanitizer set.
extra_pass=0
if [[ $set_name == sanitizer && $bad_values == yes && " ${tools[*]} " == *" memcheck "* ]]; then
    extra_pass=1
fi

app_for() {   # app_for SET RANGE: the check_mla command line, in the array `app`
    app=("$python" -c "$wrapper" "$pool" --set "$1" --dtype "$dtype" --seed "$seed" --range "$2" --host-reference)
}
app_for "$set_name" "$range"

echo "compute-sanitizer: $sanitizer ($("$sanitizer" --version 2>&1 | grep -i version | head -n 1))"
echo "app: check_mla.py --set $set_name --dtype $dtype --seed $seed --range $range --host-reference (memory pool: $pool); logs: $logdir"
if [[ $extra_pass == 1 ]]; then
    echo "then memcheck over: check_mla.py --set bad-values --dtype $dtype --seed $seed --range : --host-reference"
fi
echo "kernel build options: ${FLASHMLA_CUPY_EXTRA_OPTIONS:-(default)}"

summaries=()
failed=0

verdict() {   # the last line of check_mla's output in a log
    local line
    line=$(grep -a -E "[0-9]+ failing shape" "$1" | tail -n 1)
    echo "${line:-no verdict}"
}

if [[ ${SANITIZE_WARMUP:-1} == 1 ]]; then
    start=$SECONDS
    echo "running check_mla without a sanitizer (compiles the kernels on first use) ..."
    "${app[@]}" >"$logdir/warmup.log" 2>&1
    rc=$?
    line=$(printf '%-10s %-4s exit %-3s  check_mla: %s  (%d s)  %s' "no tool" "$([[ $rc == 0 ]] && echo ok || echo FAIL)" \
           "$rc" "$(verdict "$logdir/warmup.log")" $((SECONDS - start)) "$logdir/warmup.log")
    echo "$line"
    summaries+=("$line")
    [[ $rc == 0 ]] || failed=1
fi

run_pass() {   # run_pass TOOL LABEL LOG: one sanitizer pass over the check_mla command in `app`
    local tool=$1 label=$2 log=$3 filter=$kernels
    local opts=(--tool "$tool" --error-exitcode 86 --target-processes all --print-limit 200)
    supports '--launch-timeout' && opts+=(--launch-timeout 300)
    if [[ ${SANITIZE_TENSOR_OPS:-yes} == yes ]] && supports '--check-tensor-ops'; then
        opts+=(--check-tensor-ops yes)
    fi
    case $tool in
        memcheck)
            supports '--report-api-errors' && opts+=(--report-api-errors "${SANITIZE_API_ERRORS:-no}")
            [[ $filter == auto ]] && filter=all
            ;;
        racecheck)
            supports '--racecheck-report' && opts+=(--racecheck-report analysis)
            [[ $filter == auto ]] && filter=ours
            ;;
        synccheck)
            [[ $filter == auto ]] && filter=ours
            ;;
        initcheck)
            if supports '--initcheck-track-filtered-global-memory'; then
                opts+=(--initcheck-track-filtered-global-memory yes)
                [[ $filter == auto ]] && filter=ours
            else
                [[ $filter == ours ]] && echo "warning: this compute-sanitizer may report false uninitialized reads with SANITIZE_KERNELS=ours" >&2
                [[ $filter == auto ]] && filter=all
            fi
            ;;
    esac
    if [[ $filter == ours ]]; then
        if supports '--kernel-name'; then opts+=(--kernel-name kns=flashmla); else opts+=(--filter kns=flashmla); fi
    fi
    local extra
    # shellcheck disable=SC2206
    extra=(${SANITIZE_EXTRA_ARGS:-})

    echo "running $label (kernels: $filter) ..."
    local start=$SECONDS rc elapsed counts summary ok race line
    {
        echo "# $sanitizer ${opts[*]} ${extra[*]} ${app[*]:0:2} <wrapper> ${app[*]:3}"
        timeout --kill-after=30 "$timeout_s" "$sanitizer" "${opts[@]}" "${extra[@]}" "${app[@]}"
    } >"$log" 2>&1
    rc=$?
    elapsed=$((SECONDS - start))

    counts=$(grep -a -oE "ERROR SUMMARY: [0-9]+" "$log" | awk '{n += $3; k++} END {if (k) print n}')
    if [[ -z $counts ]]; then
        summary="no ERROR SUMMARY line"
        [[ $rc == 124 ]] && summary="timed out after $timeout_s s"
        ok=0
    else
        summary="ERROR SUMMARY: $counts error$([[ $counts == 1 ]] || echo s)"
        ok=$([[ $counts == 0 && $rc == 0 ]] && echo 1 || echo 0)
    fi
    race=$(grep -a "RACECHECK SUMMARY" "$log" | tail -n 1 | sed -e 's/^=* *//')
    line=$(printf '%-10s %-4s %s  exit %s  check_mla: %s  (%d s)%s  %s' "$label" "$([[ $ok == 1 ]] && echo ok || echo FAIL)" \
           "$summary" "$rc" "$(verdict "$log")" "$elapsed" "${race:+  [$race]}" "$log")
    echo "$line"
    summaries+=("$line")
    [[ $ok == 1 ]] || failed=1
}

for tool in "${tools[@]}"; do
    run_pass "$tool" "$tool" "$logdir/$tool.log"
done

if [[ $extra_pass == 1 ]]; then
    app_for bad-values :
    run_pass memcheck "memcheck (bad values)" "$logdir/memcheck-bad-values.log"
fi

echo
echo "summary:"
printf '  %s\n' "${summaries[@]}"
exit $failed
