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
stage=""
cleanup() {
    userdel "$victim" 2>/dev/null || true
    userdel "$attacker" 2>/dev/null || true
    if [[ -n "$stage" ]]; then rm -rf "$stage"; fi
}
trap cleanup EXIT
useradd -M -N -s /usr/sbin/nologin "$victim"
useradd -M -N -s /usr/sbin/nologin "$attacker"
# The throwaway users run the job from this checkout and its virtual environment. A
# checkout under a private directory (a clone in mktemp -d, or under /root) is
# unreadable to them: then both are copied to a world-readable staging folder.
venv="$(cd "$(dirname "$PY")/.." && pwd)"
as_victim() { setpriv --reuid="$(id -u "$victim")" --regid="$(id -g "$victim")" --clear-groups "$@"; }
if ! as_victim test -r "$PWD/ringmpi/__init__.py" || ! as_victim test -r "$venv/pyvenv.cfg"; then
    stage="$(mktemp -d /tmp/ringmpi-security.XXXXXX)"
    echo "staging the checkout and $venv in $stage (the throwaway users cannot read them here)"
    mkdir "$stage/repo" "$stage/venv"
    tar -C "$PWD" --exclude=./.git --exclude=./.venv --exclude=./.site-venv -cf - . | tar -C "$stage/repo" -xf -
    tar -C "$venv" -cf - . | tar -C "$stage/venv" -xf -
    chmod -R a+rX "$stage"
    PY="$stage/venv/bin/$(basename "$PY")"
    cd "$stage/repo"
fi
timeout 1200 "$PY" tests/security/attacks.py "$victim" "$attacker"
