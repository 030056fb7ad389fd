# Sourced by the device scripts (`. "$(dirname "$0")/carried_wheels.sh"`): install the wheels carried in .whl/
# (the transformers version we test against) into /tmp/site and put them, then the code, on PYTHONPATH. The code
# is $CODE where a script sets it (a clean snapshot), else the working tree.
CODE=${CODE:-$PWD}
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$CODE
else
    export PYTHONPATH=$CODE
fi
