#!/usr/bin/env bash
# make test-security: attacks by a second, unprivileged user on another user's job.
# Needs root (it creates two throwaway users, removed at the end); prints SKIP
# otherwise. PYTHON: the interpreter of the virtual environment with ringmpi.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
if [[ "$(id -u)" != 0 ]]; then
    echo "SKIP: make test-security needs root (it creates throwaway users to attack a job)"
    exit 0
fi
for tool in useradd userdel setpriv gcc; do
    if ! command -v "$tool" >/dev/null; then
        echo "SKIP: make test-security needs $tool"
        exit 0
    fi
done
suffix="$$"
victim="rmvic$suffix"
attacker="rmatk$suffix"
cleanup() {
    userdel "$victim" 2>/dev/null || true
    userdel "$attacker" 2>/dev/null || true
}
trap cleanup EXIT
useradd -M -N -s /usr/sbin/nologin "$victim"
useradd -M -N -s /usr/sbin/nologin "$attacker"
timeout 1200 "$PY" tests/security/attacks.py "$victim" "$attacker"
