# Sourced by the scripts that run on a GPU machine without installing the project (no pip there):
#     source "$ROOT/scripts/installed_layout.sh" && use_installed_layout "$ROOT"
# puts on PYTHONPATH a copy of the project laid out as pyproject.toml installs it (kernels/ and
# recipes/ become loka_torchrec subpackages), without touching the image's torch. Run Python with
# -P (or from another directory) so the source tree's own loka_torchrec does not shadow the copy.

# use_installed_layout ROOT [DIR]: copy ROOT's project into DIR (default: a new temporary folder).
use_installed_layout() {
  local root=$1 site=${2:-}
  [ -n "$site" ] || site=$(mktemp -d /tmp/loka-site.XXXXXX)
  mkdir -p "$site"
  cp -r "$root/loka_torchrec" "$root/loka_job" "$site/"
  cp -r "$root/kernels" "$site/loka_torchrec/kernels"
  cp -r "$root/recipes" "$site/loka_job/recipes"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  LOKA_SITE=$site
}
