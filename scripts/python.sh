# Sourced by scripts/setup.sh and scripts/compat.sh: find_python X.Y prints the path of a Python X.Y
# interpreter (pythonX.Y on PATH, else one of pyenv's versions), or fails.
find_python() {
  local want=$1 candidate
  for candidate in "python$want" "$(pyenv root 2>/dev/null)"/versions/"$want".*/bin/python"$want"; do
    if "$candidate" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$want'" 2>/dev/null; then
      command -v "$candidate" 2>/dev/null || echo "$candidate"
      return 0
    fi
  done
  return 1
}
