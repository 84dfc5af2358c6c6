# Sourced by launch/generate.sh, serve.sh and bench.sh: sets NGPU (processes on this host) and
# defines count(), which stops the script on a count that is not a positive integer.

# A bad count stops here, naming it, where torchrun would be handed it (NGPU=abc), a failed test
# would fall through to a one-host run (NNODES=x), or a negative one would quietly become 1.
count() {  # NAME VALUE WHAT
    if [[ ! $2 =~ ^[1-9][0-9]*$ ]]; then
        echo "$(basename "$0"): error: $1='$2' is not a positive integer: give the number of $3, e.g. $1=2." >&2
        exit 2
    fi
}

# NGPU unset: the GPUs this process may use, CUDA_VISIBLE_DEVICES when set (a comma-separated
# list), else every GPU nvidia-smi lists; none found: one process, on the CPU.
if [ -z "${NGPU:-}" ]; then
    if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
        NGPU=$(printf '%s' "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c '[^[:space:]]' || true)
    else
        NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    fi
    if [ "${NGPU:-0}" -lt 1 ]; then NGPU=1; fi
fi
case "$NGPU" in
    auto|cpu|gpu|xpu) ;;  # torchrun's own names, passed on
    *) count NGPU "$NGPU" "processes on this host" ;;
esac
