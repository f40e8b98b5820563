# Sourced by .ci/oldest.sh and .ci/newest.sh: a throw-away folder $work
# (removed on exit) with this tree's files in $work/src, and a venv made by
# the Python given in $work/venv, whose interpreter is $py.
new_venv() {  # PYTHON
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  # This tree's files (tracked and untracked, less the ignored), so that the
  # build leaves nothing (build/, *.egg-info) in the checkout.
  mkdir "$work/src"
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z -co --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$work/src"
  else  # Not a git checkout (an unpacked archive): all of it.
    cp -a . "$work/src"
  fi
  "$1" -m venv "$work/venv"
  py="$work/venv/bin/python"
}
